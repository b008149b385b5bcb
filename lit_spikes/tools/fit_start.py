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

Only what this process wrote is undone: a ``WriteRecorder`` (Python's audit hook: every
open for writing and every mkdir, whoever calls it: Lightning, the logger, the module)
names the files it created or changed, and the identity each had at the fit's next hook.
An entry another process made or changed meanwhile is left, and the note says so; a
write through a symlink is seen where it lands, inside the run directory or not.
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
from lit_spikes.checkpoints import TEMP_MARKER, CheckpointWriteError
from lit_spikes.tools.own_writes import WriteRecorder, identity

KEPT_BYTES = 1 << 20
"""Files up to this size (config.yaml, hparams.yaml, a note of the user's) are read at
the snapshot, to be written back; larger ones are known by their identity only, and so
are checkpoints and TensorBoard event files of any size: no fit start rewrites them (a
new writer opens a new events file), and a run requeued many times holds many."""
NEVER_REWRITTEN = ("*.ckpt", "events.out.tfevents.*")


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
    others: list[str] = field(default_factory=list)
    """Made or changed by another process meanwhile: left as it is."""
    failed: list[str] = field(default_factory=list)
    """What could not be removed or written back, each with the error."""

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
        if self.others:
            text += (
                "; left as another process made or changed it during the fit's start "
                f"(lit-spikes undoes only its own writes): {', '.join(self.others)}"
            )
        if self.failed:
            text += f"; could not be restored (put back by hand): {'; '.join(self.failed)}"
        return text + ". The same command works again once the error above is fixed"


@dataclass
class DirectoryState:
    """A run directory's entries (identity: inode, size, mtime) and its small files' bytes."""

    root: Path
    existed: bool
    entries: dict[str, tuple[bool, int, int, int]] = field(default_factory=dict)
    contents: dict[str, bytes] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)
    """What the command deleted on purpose (``keep``): written back whoever wrote it."""

    @classmethod
    def of(cls, root: str | Path) -> DirectoryState:
        root = Path(root)
        state = cls(root, root.is_dir())
        for path in sorted(root.rglob("*")) if state.existed else []:
            if not _counted(path) or path.is_symlink():
                continue
            name = str(path.relative_to(root))
            state.entries[name] = identity(path)
            small = path.is_file() and path.stat().st_size <= KEPT_BYTES
            if small and not any(path.match(pattern) for pattern in NEVER_REWRITTEN):
                state.contents[name] = path.read_bytes()
        return state

    def keep(self, path: Path) -> None:
        """Read ``path`` before the command deletes it on purpose, whatever its size."""
        self.contents[str(path.relative_to(self.root))] = path.read_bytes()
        self.deleted.add(str(path.relative_to(self.root)))

    def restore(self, writes: WriteRecorder | None = None) -> Restored:
        """Remove what is new, write back what changed or went (when it was kept); with
        ``writes``, only what this process wrote, as it left it (the rest: ``others``)."""
        done = Restored()
        now = DirectoryState.of(self.root).entries
        for name in sorted(set(now) - set(self.entries), reverse=True):  # files before dirs
            path = self.root / name
            if writes is not None and not writes.made(path, directory=now[name][0]):
                done.others.append(name)
            elif now[name][0]:
                if not any(path.iterdir()):
                    _attempt(done, name, path.rmdir, done.removed, f"{name}/")
                elif writes is not None:
                    done.others.append(f"{name}/")
            else:
                _attempt(done, name, path.unlink, done.removed, name)
        for name, before in self.entries.items():
            if before[0] or now.get(name) == before:
                continue
            path = self.root / name
            if writes is not None and name not in self.deleted and not writes.changed(path):
                done.others.append(name)
                continue
            if name not in self.contents:
                done.left.append(name)
                continue
            if path.is_file() and path.read_bytes() == self.contents[name]:
                continue
            data = self.contents[name]
            _attempt(done, name, lambda p=path, d=data: _write(p, d), done.written_back, name)
        for real in writes.made_outside() if writes is not None else []:
            _attempt(done, str(real), real.unlink, done.removed, str(real))
        done.removed.reverse()
        done.others.reverse()
        return done

    def restore_under_lock(self, writes: WriteRecorder | None = None) -> str:
        """``restore`` holding the run's lock (a requeue started meanwhile keeps its files);
        the line that says what it did."""
        lock = RunDirectoryLock(self.root)
        try:
            lock.acquire()
        except (RunDirectoryBusy, OSError) as error:
            return f"lit-spikes: {self.root} was not restored after the failed fit: {error}"
        try:
            line = self.restore(writes).summary(self.root)
        finally:
            lock.release()
        if not self.existed and not any(self.root.iterdir()):
            self.root.rmdir()  # the command made it (its lock's file went last)
        return line


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _attempt(done: Restored, name: str, action: Any, into: list[str], said: str) -> None:
    """``action()``; where it fails (a file made read-only, a folder gone), the error is
    named in ``done.failed``, and the restore goes on."""
    try:
        action()
    except OSError as error:
        done.failed.append(f"{name}: {error.strerror or error}")
    else:
        into.append(said)


class FitStart(Callback):
    """Says whether a fit went past its start: a training batch ended, or a checkpoint was
    saved (a ``ModelCheckpoint(save_on_exception=True)`` keeps its file and its run's)."""

    def __init__(self) -> None:
        super().__init__()
        self.passed = False
        self.writes: WriteRecorder | None = None
        """What this process writes in the run directory until the fit passes its start."""

    def _pass(self) -> None:
        self.passed = True
        if self.writes is not None:
            self.writes.stop()  # nothing to undo from here on: the audit hook idles

    def _settle(self, *args: Any, **kwargs: Any) -> None:
        if self.writes is not None and not self.passed:
            self.writes.settle()

    setup = on_fit_start = on_sanity_check_end = on_train_start = _settle
    on_train_epoch_start = on_train_batch_start = _settle

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._pass()

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, *args: Any) -> None:
        self._pass()


def fit_or_restore(
    trainer: pl.Trainer, state: DirectoryState | None, start: FitStart, **kwargs: Any
) -> None:
    """``trainer.fit(**kwargs)``; where it raises before ``start`` (one of ``trainer``'s
    callbacks) passed, the run directory goes back to ``state`` and the exception says so
    in a note."""
    start.writes = WriteRecorder(state.root) if state is not None else None
    try:
        if start.writes is None:
            trainer.fit(**kwargs)
        else:
            with start.writes.recording():
                trainer.fit(**kwargs)
    except Exception as error:
        if state is None or start.passed or not os.path.isdir(state.root):
            raise
        line = state.restore_under_lock(start.writes)
        if isinstance(error, OSError) and _inside(error.filename, state.root):
            # A run file that cannot be written (config.yaml read-only, a full disk): no
            # bug to debug, one line with the file and the way on, as a checkpoint's
            raise CheckpointWriteError(
                Path(error.filename),
                error,
                f"cannot write {error.filename}: {error.strerror or error}: make it writable "
                "for this user (or free space), or give another --trainer.default_root_dir. "
                + line.removeprefix("lit-spikes: "),
            ) from None
        error.add_note(line)
        raise


def _inside(filename: Any, root: Path) -> bool:
    if not isinstance(filename, str | os.PathLike):
        return False
    path = Path(os.path.abspath(filename))
    return Path(os.path.abspath(root)) in path.parents


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
