"""A fit that fails before its first training step leaves its run directory as it was.

Lightning writes into the run directory before any of a module's code runs: the logger's
events file (before the setup hooks), ``config.yaml`` (``SaveConfigCallback.setup``),
``hparams.yaml``. A module whose ``setup``, ``configure_optimizers`` or first
``training_step`` raises, a checkpoint that does not load, a refusal of a callback at fit
start: each left those files behind, a requeue's record rewritten among them. The CLI takes
a ``DirectoryState`` of the run directory before it writes anything; when the fit raises
before a training batch ended (``FitStart``), ``restore`` removes what the command created
and writes back what it changed or removed, so the same requeue works again once its cause
is fixed. A stop (SIGTERM, Ctrl-C: not an ``Exception``) is no failure: its files stay.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks.run_lock import LOCK_NAME, RunDirectoryBusy, RunDirectoryLock
from lit_spikes.checkpoints import TEMP_MARKER

KEPT_BYTES = 1 << 20
"""Files up to this size (config.yaml, hparams.yaml, a note of the user's) are read at
the snapshot, to be written back; larger ones are known by their identity only, and so
are checkpoints and TensorBoard event files of any size: no fit start rewrites them (a
new writer opens a new events file), and a run requeued many times holds many."""
NEVER_REWRITTEN = ("*.ckpt", "events.out.tfevents.*")


def _identity(path: Path) -> tuple[bool, int, int, int]:
    stat = path.stat()
    return path.is_dir(), stat.st_ino, stat.st_size, stat.st_mtime_ns


def _counted(path: Path) -> bool:
    # The lock comes and goes with every command; a killed save's temp file is garbage
    # the lock's claim deletes (a live writer's is not ours to restore either).
    return path.name != LOCK_NAME and TEMP_MARKER not in path.name


@dataclass
class Restored:
    """What ``DirectoryState.restore`` did, by path relative to the run directory."""

    removed: list[str] = field(default_factory=list)
    written_back: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    """Changed or removed, too large to have been kept: left as the failed fit left it."""

    def summary(self, root: Path) -> str:
        parts = [
            f"{what}: {', '.join(names)}"
            for what, names in (("removed", self.removed), ("written back", self.written_back))
            if names
        ]
        done = f" ({'; '.join(parts)})" if parts else ""
        text = f"lit-spikes: the fit failed before its first step: {root} is as it was{done}"
        if self.left:
            text += f"; not restored (too large to keep): {', '.join(self.left)}"
        return text + ". The same command works again once the error above is fixed"


@dataclass
class DirectoryState:
    """A run directory's entries (identity: inode, size, mtime) and its small files' bytes."""

    root: Path
    existed: bool
    entries: dict[str, tuple[bool, int, int, int]] = field(default_factory=dict)
    contents: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def of(cls, root: str | Path) -> DirectoryState:
        root = Path(root)
        state = cls(root, root.is_dir())
        for path in sorted(root.rglob("*")) if state.existed else []:
            if not _counted(path) or path.is_symlink():
                continue
            name = str(path.relative_to(root))
            state.entries[name] = _identity(path)
            small = path.is_file() and path.stat().st_size <= KEPT_BYTES
            if small and not any(path.match(pattern) for pattern in NEVER_REWRITTEN):
                state.contents[name] = path.read_bytes()
        return state

    def keep(self, path: Path) -> None:
        """Read ``path`` before the command deletes it on purpose, whatever its size."""
        self.contents[str(path.relative_to(self.root))] = path.read_bytes()

    def restore(self) -> Restored:
        """Remove what is new, write back what changed or went (when it was kept)."""
        done = Restored()
        now = DirectoryState.of(self.root).entries
        for name in sorted(set(now) - set(self.entries), reverse=True):  # files before dirs
            path = self.root / name
            if now[name][0]:
                if not any(path.iterdir()):
                    path.rmdir()
                    done.removed.append(f"{name}/")
            else:
                path.unlink()
                done.removed.append(name)
        for name, identity in self.entries.items():
            if identity[0] or now.get(name) == identity:
                continue
            if name not in self.contents:
                done.left.append(name)
                continue
            path = self.root / name
            if path.is_file() and path.read_bytes() == self.contents[name]:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self.contents[name])
            done.written_back.append(name)
        done.removed.reverse()
        return done

    def restore_under_lock(self) -> str:
        """``restore`` holding the run's lock (a requeue started meanwhile keeps its files);
        the line that says what it did."""
        lock = RunDirectoryLock(self.root)
        try:
            lock.acquire()
        except (RunDirectoryBusy, OSError) as error:
            return f"lit-spikes: {self.root} was not restored after the failed fit: {error}"
        try:
            line = self.restore().summary(self.root)
        finally:
            lock.release()
        if not self.existed and not any(self.root.iterdir()):
            self.root.rmdir()  # the command made it (its lock's file went last)
        return line


class FitStart(Callback):
    """Says whether a fit went past its start: a training batch ended, or a checkpoint was
    saved (a ``ModelCheckpoint(save_on_exception=True)`` keeps its file and its run's)."""

    def __init__(self) -> None:
        super().__init__()
        self.passed = False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.passed = True

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, *args: Any) -> None:
        self.passed = True


def fit_or_restore(
    trainer: pl.Trainer, state: DirectoryState | None, start: FitStart, **kwargs: Any
) -> None:
    """``trainer.fit(**kwargs)``; where it raises before ``start`` (one of ``trainer``'s
    callbacks) passed, the run directory goes back to ``state`` and the exception says so
    in a note."""
    try:
        trainer.fit(**kwargs)
    except Exception as error:
        if state is not None and not start.passed and os.path.isdir(state.root):
            error.add_note(state.restore_under_lock())
        raise


def start_anew(root: Path, state: DirectoryState | None) -> None:
    """``--ckpt_path last`` in a directory whose run wrote no checkpoint: that run's
    TensorBoard events go (the new run logs the same steps from 0), said in a line; kept
    in ``state`` until the fit passed its start."""
    events = sorted(root.glob("events.out.tfevents.*"))
    for event_file in events:
        if state is not None:
            state.keep(event_file)
        event_file.unlink()
    print(
        f"lit-spikes: --ckpt_path last: {root} has no checkpoint to resume, only the "
        f"TensorBoard events of a run that wrote none ({len(events)} file(s), removed): "
        "starting it anew from step 0",
        file=sys.stderr,
    )
