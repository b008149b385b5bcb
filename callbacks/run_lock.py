"""One training run at a time in a run directory."""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from filelock import FileLock, Timeout
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from typing_extensions import override

from lit_spikes.callbacks.common import trainer_callbacks
from lit_spikes.checkpoints import (
    AtomicCheckpointIO,
    CheckpointWriteError,
    checkpoint_files_if_any,
)

LOCK_NAME = ".lit-spikes.lock"
"""The lock file in a run directory (no TensorBoard or checkpoint glob matches it)."""


class RunDirectoryBusy(RuntimeError):
    """Another live process trains in the run directory; the message names it."""

    def __init__(self, directory: Path, holder: str) -> None:
        super().__init__(
            f"run directory {directory} is in use by another run ({holder}): two runs writing "
            "into one directory would interleave their checkpoints and TensorBoard curves. "
            "Wait for that run to end, or give this run another directory"
        )
        self.directory, self.holder = directory, holder

    def __reduce__(self) -> tuple[type[RunDirectoryBusy], tuple[Path, str]]:
        # Rebuilt from its own arguments: a branch worker's error crosses the process pool.
        return type(self), (self.directory, self.holder)


@dataclass
class _Held:
    """One locked file of this process, shared by its ``RunDirectoryLock`` objects (each
    one a hold of the reentrant ``lock``)."""

    path: Path
    lock: FileLock
    identity: os.stat_result
    """The locked file as taken: the one to remove at release, and no other."""


_HELD: dict[Path, _Held] = {}
"""This process's locks by lock-file path: a second lock on a directory this process
holds shares it (a run resumed in the same process, a Trainer built and never fitted)."""


def _forget_held_locks() -> None:
    # A forked child shares its parent's locked file descriptions: releasing them there
    # would drop the parent's lock. The child holds nothing of its own.
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_held_locks)


class AnotherHistory(RuntimeError):
    """A new run (no ``ckpt_path``) was started into a directory holding another run's
    checkpoints; the message names them and the way on."""


class RunDirectoryLock(Callback):
    """Holds an exclusive lock on a run directory while a fit trains in it, so that a
    second run started into the same directory from another process (a job requeued while
    the first is still writing its preemption checkpoint, one command typed in two
    terminals) stops before it trains or writes a file there, instead of interleaving its
    checkpoints and TensorBoard curves with those of the run already there.

    The lock is a ``filelock.FileLock`` on ``<directory>/.lit-spikes.lock`` (``flock``:
    the kernel releases it when its process dies, so a killed run leaves no stale lock
    behind; where a filesystem has none, filelock's own fallback). The file names its
    holder (pid, host, start, command) for the other run's error, and is removed when the
    run ends. Locks of one process on one directory share it (a run resumed in the same
    process goes on). Only global rank 0 takes it.

    ``setup`` takes it at the latest, but Lightning's logger creates its first file just
    before ``setup`` (a resumed run's TensorBoard purge marker among it): ``RunSpec.trainer()``
    and ``lit-spikes fit`` take it as soon as the Trainer is built, with ``acquire_for``.
    With a Trainer of your own, call ``acquire_for(trainer)`` before ``fit`` to get the same.
    It is released in ``teardown`` once the checkpoint files are written (just before
    Lightning's logger writes its last events) or, when a fit fails, in ``on_exception``
    once they are; with a ``ModelCheckpoint(save_on_exception=True)``, which writes in
    its own ``on_exception`` after this one, at the end of ``AtomicCheckpointIO``'s
    teardown (or as that save fails: Lightning then skips teardown). A copy sent to
    another process (a spawned DDP worker) or a forked child holds nothing.

    Every full checkpoint saved while it is there flushes the Trainer's loggers first
    (``on_save_checkpoint``): the events logged before a file are on disk before it, so
    a run killed right after a save and resumed from it loses no curve.

    A new run (a fit without ``ckpt_path``) into a directory whose checkpoint callbacks'
    directories hold ``step=<k>.ckpt`` files of a run is refused at fit start, as
    ``lit-spikes fit`` refuses it: its files (``step=<k>-v1.ckpt``) and TensorBoard steps
    would mix with that run's. Lightning's ``ckpt_path="last"`` finds no ``last.ckpt``
    here and would start such a run (with a warning only).

    Args:
        directory: the run directory (TensorBoard's, and the checkpoints' parent).

    Raises:
        RunDirectoryBusy: from ``acquire``/``acquire_for`` (and so ``setup``), when another
            process holds the directory.
        CheckpointWriteError: from the same, when the lock file cannot be written (a full
            disk: with the space left); nothing is left behind.
        AnotherHistory: from ``on_fit_start``, for a new run into another run's checkpoints.

    Example:
        >>> lock = RunDirectoryLock("runs/x")
        >>> trainer = pl.Trainer(default_root_dir="runs/x", callbacks=[lock])
        >>> lock.acquire_for(trainer)  # RunDirectoryBusy here, before anything is written
        >>> trainer.fit(module, datamodule=dm)  # released as the fit ends
    """

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        self.directory = Path(directory)
        self._held: _Held | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_held"] = None  # a descriptor number means nothing in another process
        return state

    @property
    def path(self) -> Path:
        return self.directory / LOCK_NAME

    @property
    def held(self) -> bool:
        return self._held is not None and _HELD.get(self._held.path) is self._held

    def acquire(self) -> None:
        """Take the lock (a no-op when this object holds it already; shared when another
        object of this process holds it).

        Raises:
            RunDirectoryBusy: another process holds it.
            CheckpointWriteError: the lock file cannot be written.
        """
        if self.held:
            return
        path = self.directory.resolve() / LOCK_NAME  # one key however the path is spelled
        shared = _HELD.get(path)
        if shared is not None:
            shared.lock.acquire()  # reentrant: one more hold
            self._held = shared
            return
        self._held = _HELD[path] = _lock_file(path)

    def acquire_for(self, trainer: pl.Trainer) -> None:
        """``acquire()`` as ``trainer`` is built, in the process that will write the run's
        files: global rank 0. A strategy that trains in processes it starts itself
        (``ddp_spawn``, ``ddp_fork``) leaves it to ``setup`` in its rank-0 worker."""
        if not isinstance(trainer.strategy.launcher, _MultiProcessingLauncher):
            self._acquire_on_rank_zero(trainer)

    def _acquire_on_rank_zero(self, trainer: pl.Trainer) -> None:
        # The launcher's environment says the rank too: a Trainer being built may not
        # know its global rank yet (Lightning's subprocess launcher sets it in fit).
        if trainer.is_global_zero and trainer.local_rank == 0 and trainer.node_rank == 0:
            self.acquire()

    def release(self) -> None:
        """Give the lock up, and remove the file once no object of this process holds it
        (a no-op when not held)."""
        held, self._held = self._held, None
        if held is None or _HELD.get(held.path) is not held:
            return  # never held, or inherited through a fork: the parent's to release
        if held.lock.lock_counter > 1:
            held.lock.release()
            return
        del _HELD[held.path]
        _remove_and_release(held)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._acquire_on_rank_zero(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning restored the fit's checkpoint (ckpt_path is this fit's now), and
        # after ModelCheckpoint's setup resolved its directory.
        if trainer.ckpt_path is not None:
            return
        directories = {
            Path(cb.dirpath)
            for cb in trainer_callbacks(trainer)
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None
        }
        held = {d: steps for d in sorted(directories) if (steps := checkpoint_files_if_any(d))}
        refuse = bool(held)
        if trainer.world_size > 1:  # every rank stops, or none (a rank may not see the files)
            refuse = trainer.strategy.reduce_boolean_decision(refuse, all=False)
        if not refuse:
            return
        if not held:
            raise AnotherHistory("another rank found another run's checkpoints: see its error")
        directory, steps = next(iter(held.items()))
        raise AnotherHistory(
            f"{directory} holds the checkpoints of a run (step={steps[0][0]} to "
            f"step={steps[-1][0]}), and this fit starts a new one (no ckpt_path; Lightning's "
            "'last' finds no last.ckpt here): its files and TensorBoard steps would mix with "
            f"that run's. Resume it (fit(..., ckpt_path='{steps[-1][1]}')), or train into "
            "another directory"
        )

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A checkpoint is only as complete as the curves that lead to it: a resume from it
        # purges TensorBoard from its step on, so what was logged before it (a detector's
        # spike/loss of this step) is on disk before the file is (TensorBoardLogger.save
        # waits for its writer thread and flushes).
        for logger in trainer.loggers:
            logger.save()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # After on_fit_end, where a callback may have saved once more (saves are synchronous).
        self.release()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning calls no teardown hook after a failure. A ModelCheckpoint saving on
        # exception writes in its on_exception, after this one (checkpoint callbacks come
        # last): then AtomicCheckpointIO releases the lock at its teardown's end, after
        # every on_exception. Otherwise it goes now: deferring always would keep it until
        # the process exits when a later on_exception raises (Lightning then skips its
        # teardown).
        checkpoint_io = getattr(trainer.strategy, "checkpoint_io", None)
        writes_later = any(
            getattr(cb, "save_on_exception", False) for cb in trainer_callbacks(trainer)
        )
        if writes_later and isinstance(checkpoint_io, AtomicCheckpointIO):
            checkpoint_io.call_after_teardown(self.release)
            return
        self.release()


def _lock_file(path: Path) -> _Held:
    """The lock on ``path`` (created), which then names this process.

    Raises:
        RunDirectoryBusy: another process holds it.
        CheckpointWriteError: it cannot be written; nothing is left behind.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointWriteError(path.parent, error) from None
    lock = FileLock(path, timeout=0, thread_local=False)  # released in whatever thread
    try:
        lock.acquire()
    except Timeout:
        raise RunDirectoryBusy(path.parent, _read_holder(path)) from None
    except OSError as error:
        raise CheckpointWriteError(path, error) from None
    held = _Held(path, lock, os.stat(path))
    try:
        _write_holder(path)
    except OSError as error:  # a full disk: no run starts, and no empty lock file stays
        _remove_and_release(held)
        raise CheckpointWriteError(path, error) from None
    return held


def _write_holder(path: Path) -> None:
    path.write_bytes(_holder_description().encode())


def _remove_and_release(held: _Held) -> None:
    """Remove the lock file while still holding it, then release it. Only our own file:
    a directory removed and made again meanwhile holds another run's."""
    try:
        if os.path.samestat(os.stat(held.path), held.identity):
            held.path.unlink()
    except FileNotFoundError:
        pass
    finally:
        held.lock.release()


def _holder_description() -> str:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    command = " ".join(sys.argv)[:300]
    return f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {command}"


def _read_holder(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            text = handle.read(1000).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
