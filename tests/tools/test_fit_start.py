"""A fit that fails before its first step leaves its run directory byte for byte as it was
(issue 52): every error a module, its data, a checkpoint or a callback raises at fit start
left a new events file, a requeue's or a new run's config.yaml and hparams.yaml behind.
Driven through the CLI with a module written for the test that raises at a hook."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.cli import SaveConfigCallback

from lit_spikes.tools import fit_start
from lit_spikes.tools.cli import main
from lit_spikes.tools.fit_start import DirectoryState
from tests.conftest import REPO, TINY_CLI
from tests.modules.failing_modules import FAIL_AT, OTHERS_WRITE

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
RUN = [
    "--model", "tests.modules.failing_modules.FailingNet",
    "--data", "tests.modules.failing_modules.FailingData",
    "--trainer.max_steps", "20", "--checkpoint_every", "10",
    "--trainer.val_check_interval", "10", "--trainer.limit_val_batches", "1",
]  # fmt: skip
RESTORED = "the fit failed before its first step"


def snapshot(root: Path) -> dict[str, bytes | None] | None:
    if not root.exists():
        return None
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in root.rglob("*")
    }


def fit(root: Path, *args: str, fail_at: str | None = None) -> None:
    """``lit-spikes fit`` in this process, failing where ``fail_at`` says."""
    torch.set_flush_denormal(False)  # as a new process has it (the demo's fit sets it)
    os.environ.pop(FAIL_AT, None)
    if fail_at is not None:
        os.environ[FAIL_AT] = fail_at
    try:
        main(["fit", "--trainer.default_root_dir", str(root), *args, *QUIET])
    finally:
        os.environ.pop(FAIL_AT, None)


def failed_fit(root: Path, *args: str, fail_at: str) -> str:
    """The note of a fit that failed where planted (and only there)."""
    with pytest.raises(RuntimeError, match=f"planted failure in {fail_at.split(':')[0]}") as info:
        fit(root, *args, fail_at=fail_at)
    return " ".join(getattr(info.value, "__notes__", []))


@pytest.fixture(scope="module")
def stopped_at_10(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 20 steps as a kill after step 10 leaves it: step=10.ckpt, the record, events."""
    root = tmp_path_factory.mktemp("run") / "run"
    fit(root, *RUN)
    (root / "checkpoints" / "step=20.ckpt").unlink()
    return root


REQUEUE_FAILURES = [
    "setup",
    "data_setup",
    "configure_optimizers",
    "on_load_checkpoint",
    "on_train_start",
    "training_step:10",
]
"""Where a requeue of the run fails, before its first step (each wrote files before). Not
``train_dataloader``: a dataloader hook that raises leaves Lightning's class wrappers in
the process (tests/conftest.py); it is restored the same way."""


@pytest.mark.parametrize("where", REQUEUE_FAILURES)
def test_a_requeue_failing_at_fit_start_leaves_the_run_as_it_was(
    stopped_at_10: Path, tmp_path: Path, where: str
) -> None:
    root = tmp_path / "run"
    shutil.copytree(stopped_at_10, root)
    before = snapshot(root)
    note = failed_fit(root, "--ckpt_path", "last", fail_at=where)
    assert RESTORED in note and "events.out.tfevents" in note, note
    assert snapshot(root) == before


@pytest.mark.parametrize("where", ["callback_setup", "callback_on_train_start"])
def test_a_requeue_of_the_project_module_refused_by_a_callback_leaves_the_run(
    tmp_path: Path, where: str
) -> None:
    root = tmp_path / "demo"
    callback = "--trainer.callbacks+=tests.modules.failing_modules.FailingCallback"
    fit(root, *TINY_CLI, "--checkpoint_every", "10", callback)
    (root / "checkpoints" / "step=20.ckpt").unlink()
    before = snapshot(root)
    note = failed_fit(root, "--ckpt_path", "last", fail_at=where)
    assert RESTORED in note, note
    assert snapshot(root) == before


def test_a_new_run_failing_at_its_first_step_leaves_no_directory(tmp_path: Path) -> None:
    root = tmp_path / "new"
    note = failed_fit(root, *RUN, fail_at="training_step:0")
    for written in ("config.yaml", "events.out.tfevents", "hparams.yaml"):
        assert written in note, note
    assert not root.exists()
    (tmp_path / "mine").mkdir()  # a directory of the user's stays, with what it held
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    failed_fit(
        tmp_path / "mine", *RUN, "--trainer.num_sanity_val_steps", "1", fail_at="validation_step"
    )
    assert snapshot(tmp_path / "mine") == {"notes.txt": b"mine"}


def test_a_failure_after_the_first_step_keeps_the_run_files(tmp_path: Path) -> None:
    """A crash at step 3 is no start that failed: its curves and record stay to debug it,
    and ``--ckpt_path last`` restarts the recorded run."""
    root = tmp_path / "run"
    note = failed_fit(root, *RUN, fail_at="training_step:3")
    assert RESTORED not in note
    assert {"config.yaml", "hparams.yaml"} <= set(snapshot(root) or {})
    assert list(root.glob("events.out.tfevents.*"))


def test_a_restart_failing_at_fit_start_gets_the_first_starts_events_back(
    stopped_at_10: Path, tmp_path: Path
) -> None:
    """``--ckpt_path last`` where no file was written removes the first start's events to
    start anew; a start that then fails puts them back."""
    root = tmp_path / "run"
    shutil.copytree(stopped_at_10, root)
    shutil.rmtree(root / "checkpoints")
    before = snapshot(root)
    events = [p.name for p in root.glob("events.out.tfevents.*")]
    note = failed_fit(root, "--ckpt_path", "last", fail_at="configure_optimizers")
    assert len(events) == 1 and events[0] in note.partition("written back:")[2], note
    assert snapshot(root) == before


def test_a_failing_requeue_in_a_new_process_says_so_and_the_same_command_then_works(
    stopped_at_10: Path, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    shutil.copytree(stopped_at_10, root)
    before = snapshot(root)
    requeue = ["fit", "--trainer.default_root_dir", str(root), "--ckpt_path", "last", *QUIET]
    command = [sys.executable, "-m", "lit_spikes.tools.cli", *requeue]
    env = {**os.environ, FAIL_AT: "setup", "PYTHONPATH": str(REPO)}  # the user's modules
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RuntimeError: planted failure in setup" in done.stderr
    assert f"{RESTORED}: {root} is as it was" in done.stderr.splitlines()[-1]
    assert snapshot(root) == before
    main(requeue)  # fixed: the plain requeue trains the run to its end
    assert (root / "checkpoints" / "step=20.ckpt").is_file()


def test_the_directory_state_writes_back_removes_and_names_what_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    (root / "sub").mkdir(parents=True)
    (root / "small.yaml").write_text("a: 1\n")
    (root / "gone.txt").write_text("kept")
    (root / "sub" / "big.bin").write_bytes(b"x" * 64)
    (root / "events.out.tfevents.1").write_bytes(b"e")  # never rewritten: not read
    (root / "sub" / "step=1.ckpt").write_bytes(b"c")
    monkeypatch.setattr(fit_start, "KEPT_BYTES", 16)
    state = DirectoryState.of(root)
    assert sorted(state.contents) == ["gone.txt", "small.yaml"]
    (root / "small.yaml").write_text("a: 2\n")
    state.keep(root / "gone.txt")
    (root / "gone.txt").unlink()
    (root / "sub" / "big.bin").write_bytes(b"y" * 65)
    (root / "new" / "deeper").mkdir(parents=True)
    (root / "new" / "deeper" / "file").write_text("new")
    done = state.restore()
    assert done.removed == ["new/", "new/deeper/", "new/deeper/file"]
    assert sorted(done.written_back) == ["gone.txt", "small.yaml"]
    assert done.left == ["sub/big.bin"]
    assert (root / "small.yaml").read_text() == "a: 1\n" and (
        root / "gone.txt"
    ).read_text() == "kept"
    assert "not restored (too large to keep): sub/big.bin" in done.summary(root)


def test_a_failed_start_leaves_what_another_process_wrote_meanwhile(
    stopped_at_10: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    shutil.copytree(stopped_at_10, root)
    (root / "notes.md").write_text("the user's notes\n")
    before = snapshot(root)
    monkeypatch.setenv(OTHERS_WRITE, "1")
    note = failed_fit(root, "--ckpt_path", "last", fail_at="setup")
    after = snapshot(root)
    assert after is not None and before is not None
    theirs = {"note.txt", "tb", "tb/other", "tb/other/events.out.tfevents.1.other.1.0"}
    assert set(after) - set(before) == theirs  # this process's own new events file went
    assert after["notes.md"] == b"the user's notes\nappended by another process\n"
    assert {k: v for k, v in after.items() if k not in theirs | {"notes.md"}} == {
        k: v for k, v in before.items() if k != "notes.md"
    }
    left = note.partition("left as another process made or changed it")[2]
    for name in ("note.txt", "tb/other/events.out.tfevents.1.other.1.0", "notes.md"):
        assert name in left, note


def test_a_write_through_a_symlink_out_of_the_run_is_undone_too(
    stopped_at_10: Path, tmp_path: Path
) -> None:
    root, outside = tmp_path / "run", tmp_path / "elsewhere" / "hparams.yaml"
    shutil.copytree(stopped_at_10, root)
    outside.parent.mkdir()
    (root / "hparams.yaml").unlink()
    (root / "hparams.yaml").symlink_to(outside)  # dangling: Lightning writes through it
    note = failed_fit(root, "--ckpt_path", "last", fail_at="training_step:10")
    assert not outside.exists() and (root / "hparams.yaml").is_symlink()
    assert f"removed: {outside}" in note or str(outside) in note.partition("removed:")[2]


def test_a_run_file_that_cannot_be_written_is_one_line_and_exit_74(
    stopped_at_10: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "run"
    shutil.copytree(stopped_at_10, root)
    before = snapshot(root)
    record = root / "config.yaml"

    def refused(self: SaveConfigCallback, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(record))  # a read-only record

    monkeypatch.setattr(SaveConfigCallback, "save_config", refused)
    with pytest.raises(SystemExit) as exit_info:
        fit(root, "--ckpt_path", "last")
    err = capsys.readouterr().err
    assert exit_info.value.code == 74 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"lit-spikes: error: cannot write {record}: Permission denied: ")
    assert "another --trainer.default_root_dir" in line and f"{root} is as it was" in line
    assert snapshot(root) == before


def test_what_cannot_be_restored_is_named_and_the_rest_is_done(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / "small.yaml").write_text("a: 1\n")
    (root / "other.yaml").write_text("b: 1\n")
    state = DirectoryState.of(root)
    (root / "small.yaml").unlink()
    (root / "small.yaml").mkdir()  # a folder where the file was: it cannot be written back
    (root / "other.yaml").write_text("b: 2\n")
    done = state.restore()
    assert done.written_back == ["other.yaml"] and (root / "other.yaml").read_text() == "b: 1\n"
    assert len(done.failed) == 1 and done.failed[0].startswith("small.yaml: ")
    assert "could not be restored (put back by hand): small.yaml: " in done.summary(root)
