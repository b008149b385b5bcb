"""What survives what, on the persistence side: a full disk (at start, while saving),
``ddp_spawn``'s hand-over of the weights, and TensorBoard's curves before a checkpoint."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.summary.writer.record_writer import RecordWriter

import lit_spikes.callbacks.run_lock as run_lock
from lit_spikes.callbacks.run_lock import LOCK_NAME
from lit_spikes.checkpoints import AtomicCheckpointIO, CheckpointWriteError, load_checkpoint
from lit_spikes.shared.training import checkpoint_path
from lit_spikes.tools.cli import main as cli_main
from tests.conftest import REPO, TINY_CLI, fit, lock_probe, tb_steps

FULL = OSError(errno.ENOSPC, "No space left on device")


def _one_error_line(err: str) -> str:
    """The one ``lit-spikes: error:`` line of a run's stderr; no traceback beside it."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("lit-spikes: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_disk_that_fills_while_saving_keeps_the_earlier_file_and_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_save = torch.save

    def full_at_step_10(obj: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
        if "step=10" in str(getattr(handle, "name", "")):
            raise FULL
        real_save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_step_10)
    root = tmp_path / "run"
    args = ["fit", *TINY_CLI, "--trainer.default_root_dir", str(root), "--checkpoint_every", "5"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*args, "--trainer.max_steps", "12"])
    monkeypatch.undo()
    assert exit_info.value.code not in (0, None)
    line = _one_error_line(capsys.readouterr().err)
    target = checkpoint_path(root, 10)
    assert f"cannot write {target}: No space left on device (" in line
    assert " MB free on " in line and "earlier checkpoints are intact" in line
    assert int(load_checkpoint(checkpoint_path(root, 5))["global_step"]) == 5
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step=5.ckpt"]
    assert lock_probe(root) == "free"


def test_a_disk_full_at_start_names_the_lock_file_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_write = Path.write_bytes

    def full(self: Path, data: Any) -> int:
        if self.name == LOCK_NAME:
            raise FULL
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(root)])
    assert exit_info.value.code not in (0, None)
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot write {root.resolve() / LOCK_NAME}: No space left on device (" in line
    assert " MB free on " in line
    assert not root.exists() or list(root.iterdir()) == []  # no empty lock file either
    with pytest.raises(CheckpointWriteError, match="No space left"):
        run_lock.RunDirectoryLock(root).acquire()
    monkeypatch.undo()
    assert lock_probe(root) == "free"


def test_ddp_spawn_hands_the_weights_back_and_leaves_no_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning saves rank 0's weights to <mkdtemp()>/.temp.ckpt through the Trainer's
    CheckpointIO and loads them in the main process: a state dict, not a checkpoint."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the spawned worker's mkdtemp() too
    monkeypatch.setattr(tempfile, "tempdir", None)
    run = fit(tmp_path, "spawn", 4, checkpoint_every=2, strategy="ddp_spawn", devices=1)
    saved = load_checkpoint(checkpoint_path(run.spec.run_dir, 4))["state_dict"]
    fitted = run.module.state_dict()
    assert saved.keys() == fitted.keys()
    assert all(torch.equal(saved[k], fitted[k]) for k in saved)
    assert list(temp.iterdir()) == []


def test_a_state_dict_anywhere_else_is_still_no_checkpoint(tmp_path: Path) -> None:
    """Only Lightning's hand-over file is read as a bare state dict."""
    path = tmp_path / "tmpabc" / ".temp.ckpt"
    path.parent.mkdir()
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(ValueError, match="is not a Lightning training checkpoint"):
        AtomicCheckpointIO().load_checkpoint(path)


class LogsLikeTheDetector(Callback):
    """Logs straight to the loggers in on_train_batch_end, as SpikeDetector does a
    flagged step's ``spike/loss``: before the checkpoint callbacks save (Lightning runs
    them last) and with no flush of Lightning's after it."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step % 5 == 0:  # the steps that end with a checkpoint
            for logger in trainer.loggers:
                logger.log_metrics({"probe": 1.0}, step=trainer.global_step - 1)


def test_the_events_before_a_checkpoint_are_on_disk_when_its_save_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a SIGKILL the resume purges TensorBoard from the checkpoint's step on: what
    was logged before the file must already be in the events file, never to come again."""
    on_disk: dict[int, dict[str, list[int]]] = {}
    real_save = AtomicCheckpointIO.save_checkpoint

    def save(self: AtomicCheckpointIO, checkpoint: dict[str, Any], path: Any, **kw: Any) -> None:
        real_save(self, checkpoint, path, **kw)
        on_disk[int(checkpoint["global_step"])] = tb_steps(tmp_path / "run")

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", save)
    real_write = RecordWriter.write

    def slow_write(self: RecordWriter, data: bytes) -> None:  # a busy disk, a loaded CPU
        if b"probe" in data:
            time.sleep(0.5)
        real_write(self, data)

    monkeypatch.setattr(RecordWriter, "write", slow_write)
    # Lightning's plain logger, buffering as much as it can: only a flush writes events.
    logger = TensorBoardLogger(tmp_path, "run", "", max_queue=10_000, flush_secs=10_000)
    fit(tmp_path, "run", 12, checkpoint_every=5, logger=logger, callbacks=[LogsLikeTheDetector()])
    assert on_disk[5]["probe"] == [4] and on_disk[10]["probe"] == [4, 9]
    # Lightning logs self.log's values of a step (and flushes) after its checkpoint
    # callbacks ran: the step before the file follows a moment later, not in it.
    assert on_disk[5]["train/loss"] == list(range(4))


def _file_size_limit(limit: int) -> Callable[[], None]:
    """For a new process: files past ``limit`` bytes cannot be written (``EFBIG``, the
    ``OSError`` a full disk gives as ``ENOSPC``), through torch's own zip writer."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_disk_that_fills_inside_torchs_writer_is_one_line_and_exit_74(tmp_path: Path) -> None:
    root = tmp_path / "run"
    net, data = (f"tests.modules.fit_modules.{n}" for n in ("DropoutNet", "StepData"))
    run = ["fit", "--model", net, "--model.hidden", "512", "--data", data,
           "--checkpoint_every", "3", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(root)]  # fmt: skip
    cli_main([*run, "--trainer.max_steps", "3"])
    first = (root / "checkpoints" / "step=3.ckpt").read_bytes()
    assert len(first) > 6000  # the file is over the limit; config.yaml and the events are not
    done = subprocess.run(
        [sys.executable, "-m", "lit_spikes.tools.cli", *run, "--trainer.max_steps", "6",
         "--ckpt_path", "last"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=_file_size_limit(6000), timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == os.EX_IOERR == 74, done.stderr[-3000:]
    line = _one_error_line(done.stderr)
    assert f"cannot write {checkpoint_path(root, 6)}: File too large; earlier" in line
    assert (root / "checkpoints" / "step=3.ckpt").read_bytes() == first
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step=3.ckpt"]
