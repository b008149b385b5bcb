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
import torch

from lit_spikes.tools.cli import main
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
    # The test's modules are the user's: on PYTHONPATH, as a requeue finds them (issue 61)
    env = {k: v for k, v in os.environ.items() if k != KILL_AT} | {"PYTHONPATH": str(REPO)}
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


def test_a_killed_run_requeued_is_the_uninterrupted_one(  # type: ignore[no-untyped-def]
    uninterrupted, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # here: it trains nothing
        main([*requeue, *QUIET])
    assert exit_info.value.code == 0
    assert "the run already reached its max_steps=40" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_a_run_killed_before_its_first_file_restarts_as_recorded(
    uninterrupted, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    which, whole = uninterrupted
    root = tmp_path / "killed"
    root.mkdir()  # what a kill before the first file leaves: the record (the events too,
    shutil.copy(whole / "config.yaml", root / "config.yaml")  # tools/test_cli_hunt.py)
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
        ("--trainer.gradient_clip_val", "0.5", "None"),
    ],
    "demo": [
        ("--model.optim.peak_lr", "0.5", "0.1"),
        ("--data.config.batch_size", "2", "4"),
        ("--checkpoint_every", "5", "10"),
        ("--trainer.gradient_clip_val", "0.5", "None"),
    ],
}
"""Each a requeue asking for another run: the setting, the value given, the record's."""


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def refusal(capsys: pytest.CaptureFixture[str], *argv: str, new_process: bool = False) -> str:
    """The usage error of ``lit-spikes *argv`` (exit 2), on one line. The first case of
    each test runs as a scheduler runs it, in a new process; the others in this one (a
    refusal trains nothing: a new process per case would add only its imports, ~4 s)."""
    if new_process:
        done = lit_spikes(*argv)
        assert done.returncode == 2, (argv, done.stderr[-3000:])
        return " ".join(done.stderr.split())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *QUIET])
    assert exit_info.value.code == 2, argv
    return " ".join(capsys.readouterr().err.split())


def test_a_requeue_asking_for_another_run_is_refused_and_changes_nothing(  # type: ignore[no-untyped-def]
    uninterrupted, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another model or data value on a requeue was taken silently (``--model.lr``: into
    config.yaml and the hyper-parameters; ``--model.dropout``: another run trained) or
    failed after rewriting config.yaml, after which the plain requeue failed every time.
    In this process: a refusal trains nothing (the kill and its requeue above are new
    processes)."""
    torch.set_flush_denormal(False)  # as the runs had it (a demo fit here may have set it)
    which, whole = uninterrupted
    root = tmp_path / "killed"
    (root / "checkpoints").mkdir(parents=True)  # what a kill after step 10 leaves
    shutil.copy(whole / "config.yaml", root / "config.yaml")
    shutil.copy(whole / "checkpoints" / FILES[0], root / "checkpoints" / FILES[0])
    before = snapshot(root)
    requeue = ["fit", "--trainer.default_root_dir", str(root), "--ckpt_path", "last"]
    for case, (flag, value, recorded) in enumerate(OTHER_RUNS[which]):
        err = refusal(capsys, *requeue, flag, value, new_process=case == 0)
        shown = repr(value) if flag == "--trainer.precision" else value
        assert f"{flag}={shown}" in err, err
        assert f"(the record's: {recorded})" in err and "another --trainer.default_root_dir" in err
        assert snapshot(root) == before, f"{flag} wrote into the run directory"
    # A callback the record does not list (it would stop or steer another run)
    stop = "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"
    err = refusal(capsys, *requeue, stop, "--trainer.callbacks.monitor=val_loss")
    assert f"{stop} (the record's: tests.modules.killer.KillAtStep)" in err, err
    assert snapshot(root) == before
    # The plain requeue still works; so does the job's command with its callback again
    main([*requeue, *QUIET, "--trainer.callbacks+=tests.modules.killer.KillAtStep"])
    assert_same_run(whole, root)
    # What a requeue may change is applied and recorded: the run extended to step 50
    main([*requeue, *QUIET, "--trainer.max_steps", "50", "--trainer.log_every_n_steps", "2"])
    assert (root / "checkpoints" / "step=50.ckpt").is_file()
    record = (root / "config.yaml").read_text()
    assert "  max_steps: 50\n" in record and "  log_every_n_steps: 2\n" in record


REFUSED = {
    "user": [
        (["--trainer.accumulate_grad_batches", "2"], "=2) with a StepLoader"),
        (["--model", "tests.modules.fit_modules.SelfFedNet"], "but the checkpoint's run trained"),
        (["--model.hidden", "8"], "holds the weights of another module than DropoutNet"),
    ],
    "demo": [
        (["--trainer.accumulate_grad_batches", "2"], "accumulate_grad_batches"),
        (["--model", "tests.modules.fit_modules.DropoutNet", "--data",
          "tests.modules.fit_modules.StepData"], "but the checkpoint's run trained"),
        (["--model.gpt.d_model", "32"], "--model.gpt.d_model=32 (the checkpoint's: 16)"),
    ],
}  # fmt: skip
"""Resumes from another run's file (into a new directory) that cannot train: accumulation
with the step stream, another module class, other shapes (issue 52, items 6 and 7)."""


def test_a_resume_that_cannot_train_is_refused_before_any_file(  # type: ignore[no-untyped-def]
    uninterrupted, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    which, whole = uninterrupted
    mine = tmp_path / "mine"
    for case, (args, message) in enumerate(REFUSED[which]):
        err = refusal(capsys, "fit", "--ckpt_path", str(whole / "checkpoints" / FILES[0]),
                      "--trainer.default_root_dir", str(mine), *args,
                      new_process=case < 2)  # fmt: skip
        assert message in err and not mine.exists(), (args, err)


DRAWING = [
    "--model", "tests.modules.drawing_runs.DrawingNet", "--data",
    "tests.modules.drawing_runs.DrawingData", "--trainer.gradient_clip_val", "0.5",
]  # fmt: skip
"""A module that draws everywhere (dropout, augmentation, a validation that draws)."""
VALIDATING = [
    *DRAWING, "--trainer.max_steps", "30", "--checkpoint_every", "10",
    "--trainer.val_check_interval", "5", "--trainer.callbacks+=tests.modules.killer.KillAtStep",
]  # fmt: skip
"""Validated every 5 steps, with files every 10."""


def test_a_sigterm_at_a_validating_step_requeued_is_the_run_that_got_none(tmp_path: Path) -> None:
    """Issue 54: SIGTERM in step 15, which validates off the checkpoint interval. The
    preemption file came before that validation, which the resume skipped: 15 of 30
    losses differed while the log said "continues bit-exactly"."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = lit_spikes("fit", *VALIDATING, "--trainer.default_root_dir", str(whole))
    assert done.returncode == 0, done.stderr[-3000:]
    first = lit_spikes("fit", *VALIDATING, "--trainer.default_root_dir", str(killed),
                       kill_at="14:SIGTERM")  # fmt: skip
    assert first.returncode == 128 + 15, first.stderr[-3000:]
    assert "stopped after step 15" in first.stderr and "continues bit-exactly" in first.stderr
    done = lit_spikes("fit", "--trainer.default_root_dir", str(killed), "--ckpt_path", "last")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_states_equal(
        load_ckpt(whole / "checkpoints" / "step=30.ckpt"),
        load_ckpt(killed / "checkpoints" / "step=30.ckpt"),
    )


@pytest.fixture(scope="module")
def longer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """63 steps validated every 3, files every 7 (the cadence changes nothing: issue 53)."""
    root = tmp_path_factory.mktemp("longer")
    run = [*DRAWING, "--trainer.val_check_interval", "3", "--checkpoint_every", "7"]
    done = lit_spikes("fit", *run, "--trainer.max_steps", "63", "--trainer.default_root_dir",
                      str(root))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.parametrize("every", ["7", "10"])
def test_a_finished_run_extended_is_the_longer_run(
    longer: Path, tmp_path: Path, every: str
) -> None:
    """Issue 54: 30 steps validated every 3, then ``--ckpt_path last --trainer.max_steps
    63``: from step 30's file off the checkpoint interval (FinalCheckpoint's, written after
    the final validation) and on it (before that validation). Off the interval the result
    differed from step 31 on."""
    run = [*DRAWING, "--trainer.val_check_interval", "3", "--checkpoint_every", every]
    short = tmp_path / "short"
    done = lit_spikes("fit", *run, "--trainer.max_steps", "30", "--trainer.default_root_dir",
                      str(short))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    extend = ["--trainer.default_root_dir", str(short), "--ckpt_path", "last"]
    done = lit_spikes("fit", *extend, "--trainer.max_steps", "63")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_states_equal(
        load_ckpt(longer / "checkpoints" / "step=63.ckpt"),
        load_ckpt(short / "checkpoints" / "step=63.ckpt"),
    )
