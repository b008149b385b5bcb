"""Reading Lightning checkpoints safely, with errors that name the file and the fault."""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
import sys
import threading
import warnings
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

STEP_PATTERN = re.compile(r"step=(\d+)")
VERSION_PATTERN = re.compile(r"-v(\d+)\.ckpt$")
"""ModelCheckpoint's suffix for a second file of one name (``step=20-v1.ckpt``)."""
REQUIRED_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "loops")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from; the message names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self) -> tuple[type[CheckpointError], tuple[Path, str]]:
        # Rebuilt from its own arguments: a branch worker's error crosses the process pool.
        return type(self), (self.path, self.reason)


class CheckpointWriteError(OSError):
    """A checkpoint whose file could not be written in the background; the message names
    the file and the error. Whatever stood at that path before is still there (the new
    file is renamed into place only once written), unless only the final fsync of the
    directory failed, after the rename; no other file was touched."""

    def __init__(self, path: Path, error: BaseException) -> None:
        super().__init__(
            f"writing checkpoint {path} failed ({type(error).__name__}: {error}): "
            "the file there is the previous one (or, if only the directory's fsync failed, "
            "the new one, maybe not yet durable); earlier checkpoints are intact"
        )
        self.path, self.error = path, error

    def __reduce__(self) -> tuple[type[CheckpointWriteError], tuple[Path, BaseException]]:
        # Rebuilt from its own arguments: a branch worker's error crosses the process pool.
        return type(self), (self.path, self.error)


def load_checkpoint(path: str | Path, *, weights_enough: bool = False) -> dict[str, Any]:
    """Load a Lightning checkpoint with ``weights_only=True`` and check it can resume a run
    (``weights_enough``: or evaluate a model: a weights-only file will do).

    Raises:
        CheckpointError: missing, empty, truncated, not a torch file, holding code
            (pickled objects are never unpickled), or a weights-only checkpoint (unless
            ``weights_enough``).
        CheckpointWriteError: a background write of this process failed (any file: the
            readers wait for every pending write first).
    """
    path = Path(path)
    wait_for_writes()  # a file this process is still writing in the background
    if path.is_dir():
        raise CheckpointError(
            path, "a directory, not a checkpoint file (give one of its step=<k>.ckpt files)"
        )
    if not path.is_file():
        raise CheckpointError(path, "no such file")
    if path.stat().st_size == 0:
        raise CheckpointError(path, "the file is empty (0 bytes): a save was interrupted")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises anything from EOFError to IndexError here
        with open(path, "rb") as handle:  # torch files are zip archives: PK\x03\x04
            start = handle.read(4)
        if start != b"PK\x03\x04":
            raise CheckpointError(
                path, f"not a torch checkpoint (those are zip archives; this starts {start!r})"
            ) from None
        if isinstance(error, pickle.UnpicklingError):
            first_line = str(error).strip().splitlines()[-1][:200]
            raise CheckpointError(
                path, f"refused to unpickle non-tensor objects ({first_line})"
            ) from None
        raise CheckpointError(
            path, f"truncated or corrupt ({type(error).__name__}: {error})"
        ) from None
    damaged = _record_failing_crc(path)
    if damaged is not None:
        # torch.load checks no checksum: a flipped bit in a tensor loads, and a resume from
        # it trains on NaN weights to the end.
        raise CheckpointError(
            path,
            f"corrupt: its record {damaged} fails its CRC-32 check (bits changed on disk or "
            "in a copy since it was written); resume from another checkpoint",
        )
    if not isinstance(checkpoint, dict):
        raise CheckpointError(path, f"holds a {type(checkpoint).__name__}, not a checkpoint dict")
    missing = [key for key in REQUIRED_KEYS if key not in checkpoint]
    # What Lightning's save_checkpoint(weights_only=True) leaves out, nothing else.
    lightning_weights = missing == ["optimizer_states", "lr_schedulers"]
    if weights_enough and lightning_weights and "pytorch-lightning_version" in checkpoint:
        return checkpoint
    if lightning_weights or ("state_dict" in checkpoint and "optimizer_states" in missing):
        raise CheckpointError(
            path, "holds weights only (no optimizer state): it cannot resume a run bit-exactly"
        )
    if missing:
        raise CheckpointError(path, f"is not a Lightning training checkpoint (missing {missing})")
    return checkpoint


def _record_failing_crc(path: Path) -> str | None:
    """The first record of a torch zip file whose bytes fail the CRC-32 stored with them
    (about 2 ms per MB); None when all pass. A stored 0 is none: torch writes no
    checksums after ``torch.serialization.set_crc32_options(False)``."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    continue
                try:
                    with archive.open(info) as record:
                        while record.read(1 << 20):  # zipfile checks the CRC at the end
                            pass
                except zipfile.BadZipFile:
                    return info.filename
    except (zipfile.BadZipFile, OSError) as error:
        return f"(the archive: {error})"
    return None


def checkpoint_step(path: str | Path) -> int:
    """The global step a checkpoint file holds, read once per file version (the main job
    asks for it as it submits each branch of a file, from the training run writing them).

    Raises:
        CheckpointError, CheckpointWriteError: as ``load_checkpoint``.
    """
    wait_for_writes()
    try:
        version = Path(path).stat().st_mtime_ns
    except OSError:
        return int(load_checkpoint(path)["global_step"])  # its clear error
    return _file_step(str(path), version)


@functools.lru_cache(maxsize=64)
def _file_step(path: str, mtime_ns: int) -> int:
    return int(load_checkpoint(path)["global_step"])


def checkpoint_files(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``*step=<k>*.ckpt`` file in ``directory``, oldest first:
    by step, and files of one step (``step=20.ckpt`` and the ``step=20-v1.ckpt`` of a run
    resumed into the same directory) in the order they were written (their modification
    times; on a tie, or times a copy reset, by ``-v<n>``)."""
    wait_for_writes()  # every file this process saved is listed
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    found = []
    for path in directory.glob("*.ckpt"):
        match = STEP_PATTERN.search(path.name)
        if match:
            version = VERSION_PATTERN.search(path.name)
            written = _written_at(path)
            found.append(
                (int(match.group(1)), written, int(version.group(1)) if version else 0, path)
            )
    return [(step, path) for step, _, _, path in sorted(found)]


def checkpoint_files_if_any(directory: str | Path) -> list[tuple[int, Path]]:
    """``checkpoint_files(directory)``, empty where the directory does not exist."""
    try:
        return checkpoint_files(directory)
    except FileNotFoundError:
        return []


def _written_at(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:  # removed meanwhile: its readers will say so
        return 0


TEMP_MARKER = ".tmp-"
"""Part of the name of a checkpoint being written; never matches ``*.ckpt``."""


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Write a file so that ``path`` holds either the old file or the whole new one.

    ``write`` fills a temporary file in the same directory (a rename across filesystems
    is not atomic), which is flushed and fsynced; ``os.replace`` puts it in place and the
    directory is fsynced so the rename itself survives a power cut. A process killed at
    any moment leaves at most a ``.<name>.tmp-<pid>`` file, which no glob for ``*.ckpt``
    matches and ``remove_leftovers`` deletes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}")
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` through ``atomic_write``: never a partial file under ``path``."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


class _BackgroundWriter:
    """Writes serialized checkpoints with ``atomic_write`` in one helper thread, in the
    order they were handed over, and keeps the first error for the next caller.

    Only the file's writing moves: open, write, the two fsyncs and the rename are system
    calls that release the GIL, about 4 ms of a 12 ms save of the default model. The
    serializing stays with the caller: it is Python that holds the GIL, and in a helper
    thread it stalled the training thread as long (even its backward pass, which takes
    the GIL to free tensors).

    The executor's thread is joined at interpreter exit, so a handed-over file is written
    unless the process is killed; a forked child starts with no writes of its parent's.
    """

    def __init__(self) -> None:
        # Reentrant: a signal handler may save (Lightning's SLURM requeue handler does) in
        # the main thread while that thread is inside submit or wait.
        self._lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Path, Future[None]]] = []
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.RLock()
        self._executor, self._pending = None, []

    def submit(self, path: Path, data: bytes | memoryview) -> None:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
            write = functools.partial(atomic_write, path, lambda handle: handle.write(data))
            self._pending.append((path, self._executor.submit(write)))

    def raise_failed_before_last(self) -> None:
        """Raise the error of the first failed write among those handed over before the
        last one, without waiting for the last (each error to one caller).

        Raises:
            CheckpointWriteError: for that write.
        """
        with self._lock:
            earlier = self._pending[:-1]
            failed = [e for e in earlier if e[1].done() and e[1].exception() is not None]
            if not failed:
                return
            self._pending = [entry for entry in self._pending if entry not in failed]
        path, future = failed[0]
        raise CheckpointWriteError(path, future.exception())  # type: ignore[arg-type]

    def wait(self, keep_errors: bool = False) -> None:
        """Block until every handed-over file is written; ``keep_errors``: leave a failed
        write's error for the next caller.

        Raises:
            CheckpointWriteError: for the first write that failed (the others are waited for).
        """
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return
        for _, future in pending:  # another thread waiting too returns no earlier
            future.exception()
        if keep_errors:
            return
        with self._lock:  # each error to one caller: the one that takes its entry
            mine = [entry for entry in pending if entry in self._pending]
            self._pending = [entry for entry in self._pending if entry not in pending]
        for path, future in mine:
            error = future.exception()
            if error is not None:
                raise CheckpointWriteError(path, error)


_WRITER = _BackgroundWriter()


def wait_for_writes(keep_errors: bool = False) -> None:
    """Block until every checkpoint file this process handed to the background writer is
    on disk. Every reader in this module calls it first.

    Args:
        keep_errors: raise nothing, and leave a failed write's error to the next call
            that does (a caller that must only know the writing is over).

    Raises:
        CheckpointWriteError: a background write failed.
    """
    _WRITER.wait(keep_errors)


def serialize_checkpoint(checkpoint: dict[str, Any]) -> memoryview:
    """The bytes ``torch.save`` writes for ``checkpoint``: a snapshot, so that training
    may change the tensors it holds as soon as this returns."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getbuffer()


def remove_leftovers(directory: str | Path) -> list[Path]:
    """Delete temporary files of interrupted saves in ``directory``; returns them. A file
    that a live process is still writing (its pid is in the name) is no leftover: a second
    run started into a busy directory must not break the first one's save before
    ``RunDirectoryLock`` stops it."""
    wait_for_writes()  # this process's own writes in progress are no leftovers
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = [
        p
        for p in directory.iterdir()
        if p.name.startswith(".") and TEMP_MARKER in p.name and not _written_by_another(p)
    ]
    for leftover in removed:
        leftover.unlink(missing_ok=True)
    return removed


def _written_by_another(temp: Path) -> bool:
    """Whether the process named in a temporary file's name is alive and not this one."""
    pid_text = temp.name.rpartition(TEMP_MARKER)[2]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _several_ranks() -> bool:
    """Whether this process is one rank of several (a launcher may start them whatever
    the Trainer's ``devices`` say: MPI, LSF, Kubeflow)."""
    distributed = torch.distributed
    return (
        distributed.is_available()
        and distributed.is_initialized()
        and (distributed.get_world_size() > 1)
    )


def _caught_by_lightning(error: BaseException) -> bool:
    """Whether the frame handling ``error`` is Lightning's (the first of its traceback)."""
    traceback = error.__traceback__
    module = traceback.tb_frame.f_globals.get("__name__", "") if traceback else ""
    return str(module).startswith(("lightning.", "pytorch_lightning."))


class AtomicCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` whose saves are atomic and durable (``atomic_write``)
    and whose loads use ``load_checkpoint``: ``weights_only=True`` always, and errors that
    name the file and what is wrong with it.

    Lightning's own ``_atomic_save`` is atomic only when its temporary file and the target
    share a filesystem, and never fsyncs (Lightning issues #21253, #21800).

    Args:
        background_writes: serialize the checkpoint in ``save_checkpoint`` but write the
            file (fsyncs included) in a helper thread, which a 12-14 ms save of the
            default model leaves after 9.4-9.8 ms. The file appears a few milliseconds later:
            ``load_checkpoint``, ``checkpoint_files`` and the other readers of this module
            wait for it, as does ``teardown`` (the end of every ``fit``), but code that
            opens the file itself must call ``wait_for_writes()`` first. The file's bytes
            are held in memory until written (a copy of the checkpoint's size). For one
            process only: under DDP another rank could look for the file before it is
            there, so wherever a process group of several ranks is running, the save is
            synchronous whatever this says.

    Raises:
        CheckpointWriteError: from the next save, ``teardown`` or reader, when a
            background write failed (``teardown`` of a run that is failing anyway warns
            instead, and the run's own error is raised).

    Example:
        >>> trainer = pl.Trainer(plugins=[AtomicCheckpointIO(background_writes=True)])
    """

    def __init__(self, background_writes: bool = False) -> None:
        super().__init__()
        self.background_writes = background_writes
        self._after_teardown: list[Callable[[], None]] = []

    def call_after_teardown(self, function: Callable[[], None]) -> None:
        """Call ``function`` at the end of the next ``teardown``, whatever it raises. A
        failing fit tears the plugin down after every callback's ``on_exception`` (one may
        save a checkpoint there) and the loggers' last events: ``RunDirectoryLock``
        releases the run directory then."""
        self._after_teardown.append(function)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO.save_checkpoint got storage_options={storage_options!r}; "
                "it writes local files and takes none"
            )
        if not self.background_writes or _several_ranks():
            failing = sys.exc_info()[1]  # a save in a callback's on_exception
            try:
                atomic_torch_save(checkpoint, path)
            except BaseException:
                if failing is not None and _caught_by_lightning(failing):
                    # Lightning skips teardown when an on_exception raises: what was to
                    # run after it (the run directory's release) runs now
                    self._run_after_teardown()
                raise
            return
        data = serialize_checkpoint(checkpoint)
        _WRITER.wait(keep_errors=True)  # the previous file: written long ago
        # This file is written even if the previous one failed (a preemption's checkpoint
        # after a full disk freed up): that error is raised only once this one is handed over.
        _WRITER.submit(Path(path), data)
        _WRITER.raise_failed_before_last()

    @override
    def teardown(self) -> None:
        # Lightning tears down inside its ``except`` when fit fails: raising here would
        # replace the run's own error (the one a caller catches) with this one. Only an
        # error caught in Lightning's code counts: a fit called in a caller's own
        # ``except`` (a retry) that ends well still raises.
        failing = sys.exc_info()[1]
        try:
            wait_for_writes()
        except CheckpointWriteError as error:
            if failing is None or not _caught_by_lightning(failing):
                raise
            warnings.warn(
                f"{error} (a warning, not raised: the run is already failing with "
                f"{type(failing).__name__}, which is raised instead)",
                stacklevel=2,
            )
        finally:
            self._run_after_teardown()

    def _run_after_teardown(self) -> None:
        functions, self._after_teardown = self._after_teardown, []
        for function in functions:
            function()

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                f"refusing to load {path} with weights_only=False: lit-spikes checkpoints hold "
                "only plain data, and full unpickling runs whatever code a file carries"
            )
        # A weights-only file passes here: validate and test need no more, and a fit is
        # refused by the module's on_load_checkpoint, which knows the Trainer's stage.
        return load_checkpoint(path, weights_enough=True)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        wait_for_writes()  # or a pending write would put the file back
        Path(path).unlink(missing_ok=True)


def newest_valid_checkpoint(
    directory: str | Path, max_step: int | None = None, *, refuse_nonfinite: bool = True
) -> tuple[int, Path, list[str]]:
    """The newest ``step=<k>.ckpt`` in ``directory`` (with ``k <= max_step``) that loads and
    holds the step its name says, after refusing broken ones with a warning each.

    ``refuse_nonfinite`` also refuses files written after a step whose update was skipped
    for a non-finite loss or gradient: a rollback target must come before the trouble. A
    resume that continues an interrupted run passes False: the newest file is where the
    uninterrupted run would have gone on from.

    Returns:
        ``(step, path, refused)``: ``refused`` says why each newer file was passed over.

    Raises:
        FileNotFoundError: no such directory, or no valid checkpoint in it.
        CheckpointWriteError: as ``load_checkpoint``.
    """
    refused: list[str] = []
    candidates = [
        (s, p) for s, p in checkpoint_files(directory) if max_step is None or s <= max_step
    ]
    for step, path in reversed(candidates):
        try:
            checkpoint = load_checkpoint(path)
            if int(checkpoint["global_step"]) != step:
                raise CheckpointError(
                    path, f"its name says step {step} but it holds step {checkpoint['global_step']}"
                )
            nonfinite = checkpoint.get("lit_spikes", {}).get("nonfinite_steps", [])
            if nonfinite and refuse_nonfinite:
                raise CheckpointError(
                    path, f"written after a non-finite loss or gradient at step(s) {nonfinite}"
                )
        except CheckpointError as error:
            refused.append(str(error))
            warnings.warn(f"{error}; trying the previous checkpoint", stacklevel=2)
            continue
        return step, path, refused
    limit = "" if max_step is None else f" at or before step {max_step}"
    raise FileNotFoundError(
        f"no valid checkpoint{limit} in {directory}"
        + (f"; refused: {'; '.join(refused)}" if refused else "")
    )
