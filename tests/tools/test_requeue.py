"""A requeue is the recorded run (issue 52): a job killed at a step (SIGKILL, from inside
its own process) and started again with the short command ``lit-spikes fit
--trainer.default_root_dir D --ckpt_path last`` ends with the uninterrupted run's files,
bit for bit, and its config.yaml, for the project's module and a module of the user's.
Each run is a new process, as a scheduler starts it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_CLI, assert_states_equal, load_ckpt
from tests.modules.killer import KILL_AT

pytestmark = pytest.mark.slow

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
SETTINGS = [  # each one a requeue of the demo dropped (issue 52, items 1 and 2)
    "--trainer.max_steps", "40", "--checkpoint_every", "10",
    "--trainer.val_check_interval", "10", "--trainer.limit_val_batches", "2",
    "--trainer.log_every_n_steps", "5", "--trainer.precision", "64-true",
    "--trainer.callbacks+=tests.modules.killer.KillAtStep",
]  # fmt: skip
RUNS = {
    "demo": [*TINY_CLI, "--model.optim.max_steps", "60", *SETTINGS],
    "user": ["--model", "tests.modules.fit_modules.DropoutNet", "--data",
             "tests.modules.fit_modules.StepData", *SETTINGS],
}  # fmt: skip
FILES = [f"step={s}.ckpt" for s in (10, 20, 30, 40)]


def lit_spikes(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != KILL_AT}
    if kill_at is not None:
        env[KILL_AT] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "lit_spikes.tools.cli", *args, *QUIET],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module", params=sorted(RUNS))
def uninterrupted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp(request.param) / "whole"
    done = lit_spikes("fit", *RUNS[request.param], "--trainer.default_root_dir", str(root))
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, root


def assert_same_run(whole: Path, requeued: Path) -> None:
    assert sorted(p.name for p in (requeued / "checkpoints").iterdir()) == FILES
    assert_states_equal(
        load_ckpt(whole / "checkpoints" / FILES[-1]),
        load_ckpt(requeued / "checkpoints" / FILES[-1]),
    )
    recorded = [(r / "config.yaml").read_text().replace(str(r), "RUN") for r in (whole, requeued)]
    assert recorded[0] == recorded[1]  # but the run directory's own name


def test_a_killed_run_requeued_is_the_uninterrupted_one(uninterrupted, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    which, whole = uninterrupted
    root = tmp_path / "killed"
    first = lit_spikes("fit", *RUNS[which], "--trainer.default_root_dir", str(root), kill_at="17")
    assert first.returncode == -9, first.stderr[-3000:]  # SIGKILL at step 17
    requeue = ["fit", "--trainer.default_root_dir", str(root), "--ckpt_path", "last"]
    done = lit_spikes(*requeue)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(whole, root)
    # Once finished, the same command again: exit 0, one line, nothing written.
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    again = lit_spikes(*requeue)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run already reached its max_steps=40" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_a_run_killed_before_its_first_file_restarts_as_recorded(
    uninterrupted, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    which, whole = uninterrupted
    root = tmp_path / "killed"
    first = lit_spikes("fit", *RUNS[which], "--trainer.default_root_dir", str(root), kill_at="4")
    assert first.returncode == -9, first.stderr[-3000:]
    assert not list((root / "checkpoints").glob("*.ckpt"))
    # The job's whole command again, as a job script holds it: its callbacks taken once
    run = [*RUNS[which], "--trainer.default_root_dir", str(root)]
    done = lit_spikes("fit", *run, "--ckpt_path", "last")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(whole, root)


OTHER_RUNS = {
    "user": [
        ("--model.lr", "0.5", "0.01"),
        ("--model.dropout", "0.0", "0.3"),
        ("--data.batch_size", "2", "8"),
        ("--trainer.precision", "32-true", "'64-true'"),
    ],
    "demo": [
        ("--model.optim.peak_lr", "0.5", "0.1"),
        ("--data.config.batch_size", "2", "4"),
        ("--checkpoint_every", "5", "10"),
    ],
}
"""Each a requeue asking for another run: the setting, the value given, the record's."""


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_requeue_asking_for_another_run_is_refused_and_changes_nothing(  # type: ignore[no-untyped-def]
    uninterrupted, tmp_path: Path
) -> None:
    """Another model or data value on a requeue was taken silently (``--model.lr``: into
    config.yaml and the hyper-parameters; ``--model.dropout``: another run trained) or
    failed after rewriting config.yaml, after which the plain requeue failed every time."""
    which, whole = uninterrupted
    root = tmp_path / "killed"
    (root / "checkpoints").mkdir(parents=True)  # what a kill after step 10 leaves
    shutil.copy(whole / "config.yaml", root / "config.yaml")
    shutil.copy(whole / "checkpoints" / FILES[0], root / "checkpoints" / FILES[0])
    before = snapshot(root)
    requeue = ["fit", "--trainer.default_root_dir", str(root), "--ckpt_path", "last"]
    for flag, value, recorded in OTHER_RUNS[which]:
        done = lit_spikes(*requeue, flag, value)
        assert done.returncode == 2, (flag, done.stderr[-3000:])
        err = " ".join(done.stderr.split())
        shown = repr(value) if flag == "--trainer.precision" else value
        assert f"{flag}={shown}" in err, err
        assert f"(the record's: {recorded})" in err and "another --trainer.default_root_dir" in err
        assert snapshot(root) == before, f"{flag} wrote into the run directory"
    done = lit_spikes(*requeue)  # the plain requeue still works
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(whole, root)
    # What a requeue may change is applied and recorded: the run extended to step 50
    done = lit_spikes(*requeue, "--trainer.max_steps", "50", "--trainer.log_every_n_steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (root / "checkpoints" / "step=50.ckpt").is_file()
    record = (root / "config.yaml").read_text()
    assert "  max_steps: 50\n" in record and "  log_every_n_steps: 2\n" in record
