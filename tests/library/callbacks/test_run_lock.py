"""``RunDirectoryLock`` (callbacks/run_lock.py): one run per directory, held while a
checkpoint saves on exit or failure and let go after, never taking another's lock file."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback

import lit_spikes.checkpoints as checkpoints_module
from lit_spikes.callbacks import (
    PreemptionCheckpoint,
    RunDirectoryBusy,
    RunDirectoryLock,
)
from lit_spikes.callbacks.run_lock import LOCK_NAME
from lit_spikes.checkpoints import (
    CheckpointWriteError,
)
from lit_spikes.shared.training import checkpoint_path, unwritable_directory
from tests.conftest import (
    fit,
    lock_probe,
    tb_scalars,
)

N, K, EVERY = 20, 10, 5


def test_a_save_in_on_fit_end_is_on_disk_before_the_directory_is_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning tears its checkpoint plugin down before on_fit_end: a save there is on
    disk (or its error raised) before another run may take the directory."""

    class SaveAtFitEnd(Callback):
        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "final.ckpt")

    run = fit(tmp_path, "run", 2, callbacks=[SaveAtFitEnd()])
    assert (run.spec.run_dir / "final.ckpt").exists()
    assert not (run.spec.run_dir / LOCK_NAME).exists()

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"final\.ckpt.*No space left"):
        fit(tmp_path, "full", 2, callbacks=[SaveAtFitEnd()])
    assert not (tmp_path / "full" / LOCK_NAME).exists()


def test_a_failing_run_holds_its_directory_while_a_checkpoint_saves_on_exception(
    tmp_path: Path,
) -> None:
    """ModelCheckpoint(save_on_exception=True) writes in its on_exception, which runs after
    the lock's (checkpoint callbacks come last): the directory is let go only after it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    held: list[bool] = []
    real = checkpoints_module.atomic_write

    def watched(path: Path, write: Any) -> None:
        held.append((path.parent.parent / LOCK_NAME).exists())
        real(path, write)

    class Boom(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                raise RuntimeError("boom at step 3")

    emergency = ModelCheckpoint(
        dirpath=tmp_path / "run" / "checkpoints",
        filename="crash-{step}",
        save_on_exception=True,
        every_n_train_steps=99,  # not the run's own (100): another state key
    )
    checkpoints_module.atomic_write = watched  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="boom at step 3"):
            fit(tmp_path, "run", 10, checkpoint_every=100, callbacks=[Boom(), emergency])
    finally:
        checkpoints_module.atomic_write = real
    assert held == [True]
    assert (tmp_path / "run" / "checkpoints" / "crash-step=3.ckpt").exists()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_failing_save_on_exception_still_lets_go_of_the_directory(tmp_path: Path) -> None:
    """A save in ModelCheckpoint's on_exception that fails (a full disk, written at once as
    under DDP) makes Lightning skip teardown, where the directory was to be released: it
    stayed locked until the process exited (a notebook's kernel, a retrying service)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    real = checkpoints_module.atomic_write

    def full_disk_for_crash_files(path: Path, write: Any) -> None:
        if Path(path).name.startswith("crash-"):
            raise OSError(28, "No space left on device")
        real(path, write)

    class Boom(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                raise RuntimeError("boom at step 3")

    emergency = ModelCheckpoint(
        dirpath=tmp_path / "run" / "checkpoints",
        filename="crash-{step}",
        save_on_exception=True,
        every_n_train_steps=99,
    )
    checkpoints_module.atomic_write = full_disk_for_crash_files  # type: ignore[assignment]
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(OSError, match="No space left"):
            fit(
                tmp_path,
                "run",
                10,
                checkpoint_every=100,
                callbacks=[Boom(), emergency],
            )
    finally:
        checkpoints_module.atomic_write = real
        # The skipped teardown left Lightning's SIGTERM handler too: not into the next
        # tests' processes (a forked lock holder would outlive its terminate()).
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert lock_probe(tmp_path / "run") == "free"


# Lightning's note that ckpt_path="last" finds no last.ckpt, as the docstring says.
@pytest.mark.filterwarnings(
    'ignore:.fit\\(ckpt_path="last"\\) is set, but there is no last:UserWarning'
)
def test_a_new_run_into_another_runs_checkpoints_is_refused_from_python_too(
    tmp_path: Path,
) -> None:
    """What lit-spikes fit refuses: RunSpec (and Lightning's ckpt_path="last", which finds
    no last.ckpt here and would start from step 0) mixed step=<k>-v1.ckpt files and
    duplicate TensorBoard steps into the first run's directory."""
    from lit_spikes.callbacks import AnotherHistory

    first = fit(tmp_path, "run", N, checkpoint_every=EVERY)
    files = sorted(p.name for p in (first.spec.run_dir / "checkpoints").iterdir())
    before = tb_scalars(first.spec.run_dir)
    for ckpt_path in (None, "last"):
        with pytest.raises(AnotherHistory, match=r"holds the checkpoints of a run \(step=5 to "):
            fit(tmp_path, "run", N, checkpoint_every=EVERY, ckpt_path=ckpt_path)
        assert sorted(p.name for p in (first.spec.run_dir / "checkpoints").iterdir()) == files
        assert tb_scalars(first.spec.run_dir) == before
        assert not (first.spec.run_dir / LOCK_NAME).exists()
    # Resuming it goes on, into the same directory
    resumed = fit(
        tmp_path,
        "run",
        N + 5,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(first.spec.run_dir, N),
    )
    assert min(resumed.losses) == N


def test_a_failed_cleanup_after_the_lock_is_taken_releases_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lit_spikes.shared import training

    def unreadable(directory: Path) -> list[Path]:
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(training, "remove_leftovers", unreadable)
    with pytest.raises(PermissionError):
        training.RunSpec(tmp_path, "run", 4, checkpoint_every=2).trainer()
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released: no fit will release it


def test_a_failing_on_exception_of_another_callback_still_lets_the_directory_go(
    tmp_path: Path,
) -> None:
    """Lightning skips its teardown when an on_exception raises: the lock is let go in
    its own on_exception (no checkpoint is saved on exception after it)."""

    class Boom(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("boom")

    class FailingOnException(Callback):
        def on_exception(self, *args: Any) -> None:
            raise OSError(28, "No space left on device")

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(OSError, match="No space left"):
            callbacks = [Boom(), FailingOnException()]
            fit(tmp_path, "run", N, checkpoint_every=EVERY, callbacks=callbacks)
        assert not (tmp_path / "run" / LOCK_NAME).exists()
        # PreemptionCheckpoint's on_exception never ran (nor Lightning's teardown): its
        # handler is still installed, and must hand a signal on now, not keep it as a
        # flag no fit reads (here in a fork, which has the same handlers).
        child = multiprocessing.get_context("fork").Process(target=_sigterm_self)
        child.start()
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:  # Lightning's own handler stays too: not into the next tests' processes
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    handler = signal.getsignal(signal.SIGTERM)
    sys.exit(3 if isinstance(getattr(handler, "__self__", None), PreemptionCheckpoint) else 0)


def test_a_second_run_into_a_busy_directory_stops_before_writing_anything(
    tmp_path: Path, directory_holder: Any
) -> None:
    run_dir = tmp_path / "busy"
    holder = directory_holder(run_dir)
    with pytest.raises(RunDirectoryBusy, match=rf"in use by another run \(pid {holder.pid} on "):
        fit(tmp_path, "busy", N, checkpoint_every=EVERY)
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # no events, no checkpoints
    holder.terminate()
    holder.join()
    run = fit(tmp_path, "busy", N, checkpoint_every=EVERY)  # free again: the kernel released it
    assert run.trainer.global_step == N
    assert not (run_dir / LOCK_NAME).exists()  # removed as the run ended


def test_a_failing_run_lets_go_of_its_directory_after_its_last_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run let in before the last file is on disk could choose where to resume while a
    step file is still landing."""
    on_disk_at_release: list[list[str]] = []
    real_release = RunDirectoryLock.release

    def release(self: RunDirectoryLock) -> None:
        if self.held:
            files = (tmp_path / "failing" / "checkpoints").glob("*.ckpt")
            on_disk_at_release.append(sorted(p.name for p in files))
        real_release(self)

    monkeypatch.setattr(RunDirectoryLock, "release", release)

    class FailRightAfterASave(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == EVERY:  # step=5.ckpt was just saved
                raise RuntimeError("failed right after a save")

    with pytest.raises(RuntimeError, match="failed right after a save"):
        fit(tmp_path, "failing", N, checkpoint_every=EVERY, callbacks=[FailRightAfterASave()])
    assert on_disk_at_release == [[f"step={EVERY}.ckpt"]]
    assert lock_probe(tmp_path / "failing") == "free"


def test_a_run_never_removes_the_lock_file_of_another(
    tmp_path: Path, directory_holder: Any
) -> None:
    """A run directory removed under a run (recover --fresh) and locked again by another."""
    first = RunDirectoryLock(tmp_path / "run")
    first.acquire()
    shutil.rmtree(tmp_path / "run")
    holder = directory_holder(tmp_path / "run")
    first.release()
    with pytest.raises(RunDirectoryBusy, match=rf"\(pid {holder.pid} on "):
        RunDirectoryLock(tmp_path / "run").acquire()


def test_locks_of_one_process_on_one_directory_share_it(tmp_path: Path) -> None:
    """A run resumed in the same process, or a Trainer built and never fitted, goes on."""
    first, second = RunDirectoryLock(tmp_path), RunDirectoryLock(tmp_path)
    first.acquire()
    second.acquire()
    first.release()
    assert second.held and lock_probe(tmp_path) == "busy"
    second.release()
    assert not (tmp_path / LOCK_NAME).exists() and lock_probe(tmp_path) == "free"


def test_a_copy_in_another_process_holds_nothing_and_releases_nothing(tmp_path: Path) -> None:
    """A spawned DDP worker gets a pickled copy, a forked one the parent's memory: neither
    may release the parent's lock (nor close what its descriptor number is there)."""
    lock = RunDirectoryLock(tmp_path)
    lock.acquire()
    copy = pickle.loads(pickle.dumps(lock))
    assert not copy.held
    copy.release()
    child = multiprocessing.get_context("fork").Process(target=lock.release)
    child.start()
    child.join()
    assert child.exitcode == 0 and lock.held and lock_probe(tmp_path) == "busy"
    lock.release()
    assert lock_probe(tmp_path) == "free"


def test_a_dangling_symlink_root_is_refused_up_front(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing")
    assert unwritable_directory(link / "run") == (
        f"cannot be created ({link} is a dangling symbolic link)"
    )
    assert unwritable_directory(tmp_path / "new" / "run") is None
