"""One training run at a time in a run directory."""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

LOCK_NAME = ".lit-spikes.lock"
"""The lock file in a run directory (no TensorBoard or checkpoint glob matches it)."""


class RunDirectoryBusy(RuntimeError):
    """Another live process trains in the run directory; the message names it."""

    def __init__(self, directory: Path, holder: str) -> None:
        super().__init__(
            f"run directory {directory} is in use by another run ({holder}): two runs writing "
            "into one directory would interleave their checkpoints and TensorBoard curves. "
            "Wait for that run to end (then resume with --ckpt_path latest), or give this "
            "run another directory"
        )
        self.directory, self.holder = directory, holder

    def __reduce__(self) -> tuple[type[RunDirectoryBusy], tuple[Path, str]]:
        # Rebuilt from its own arguments: a branch worker's error crosses the process pool.
        return type(self), (self.directory, self.holder)


class RunDirectoryLock(Callback):
    """Holds an exclusive lock on a run directory while a fit trains in it, so that a
    second run started into the same directory (a job requeued while the first is still
    writing its preemption checkpoint, one command typed in two terminals) stops in
    ``setup``, before it writes anything, instead of interleaving its checkpoints and
    TensorBoard curves with those of the run already there.

    The lock is a ``flock`` on ``<directory>/.lit-spikes.lock``: the kernel releases it
    when its process dies, so a killed run leaves no stale lock behind. The file names its
    holder (pid, host, start, command) for the other run's error, and is removed when the
    run ends. Only global rank 0 takes it. Where the filesystem has no ``flock`` (some
    network mounts) the run warns and goes on unlocked.

    ``setup`` takes it at the latest, but Lightning's logger creates its first file just
    before ``setup`` (a resumed run's TensorBoard purge marker among it): ``RunSpec.trainer()``
    and ``lit-spikes fit`` take it as soon as the Trainer is built. With a Trainer of your
    own, call ``acquire()`` before ``fit`` to get the same.

    Args:
        directory: the run directory (TensorBoard's, and the checkpoints' parent).

    Raises:
        RunDirectoryBusy: from ``setup``, when another process holds the directory.

    Example:
        >>> lock = RunDirectoryLock("runs/x")
        >>> trainer = pl.Trainer(default_root_dir="runs/x", callbacks=[lock])
        >>> lock.acquire()  # RunDirectoryBusy here, before anything is written
        >>> trainer.fit(module, datamodule=dm)  # released as the fit ends
    """

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        self.directory = Path(directory)
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.directory / LOCK_NAME

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (a no-op when this object holds it already).

        Raises:
            RunDirectoryBusy: another process holds it.
        """
        if self._fd is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunDirectoryBusy(self.directory, holder) from None
            except OSError as error:
                os.close(fd)
                warnings.warn(
                    f"cannot lock run directory {self.directory} ({error.strerror}): a second "
                    "run started into it would not be stopped",
                    stacklevel=2,
                )
                return
            # The holder before us removes the file as it releases: if it did so between
            # our open and our flock, we locked a file nobody else will see. Again.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(os.fstat(fd), current):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, _holder_description().encode())
        self._fd = fd

    def acquire_for(self, trainer: pl.Trainer) -> None:
        """``acquire()`` in the process that writes the run's files, global rank 0. The
        launcher's environment says it too: a Trainer being built may not know its global
        rank yet (Lightning's own launcher sets it as the run starts)."""
        if trainer.is_global_zero and trainer.local_rank == 0 and trainer.node_rank == 0:
            self.acquire()

    def release(self) -> None:
        """Give the lock up and remove the file (a no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: see acquire
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # for forked children sharing the descriptor too
            os.close(fd)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.acquire_for(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.release()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.release()  # Lightning calls no teardown hook after a failure


def _holder_description() -> str:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    command = " ".join(sys.argv)[:300]
    return f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {command}"


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 1000, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
