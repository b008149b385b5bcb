"""Reading Lightning checkpoints safely, with errors that name the file and the fault."""

from __future__ import annotations

import errno
import functools
import os
import pickle
import re
import shutil
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

from lit_spikes.file_digest import misread, save_with_digest

STEP_PATTERN = re.compile(r"step=(\d+)")
VERSION_PATTERN = re.compile(r"-v(\d+)\.ckpt$")
"""ModelCheckpoint's suffix for a second file of one name (``step=20-v1.ckpt``)."""
REQUIRED_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "loops")
NONFINITE_KEY = "nonfinite_steps"
"""A checkpoint's record of the steps whose update was dropped for a non-finite loss or
gradient (``SkipStep`` writes it, as does any module that drops such updates itself):
rollback passes over the files written after one."""


def record_nonfinite(checkpoint: dict[str, Any], steps: Iterable[int]) -> None:
    """Add ``steps`` to ``checkpoint``'s record of non-finite steps (``NONFINITE_KEY``),
    kept sorted and unique: two writers (two ``SkipStep``s, a module of its own) merge."""
    merged = {int(s) for s in checkpoint.get(NONFINITE_KEY) or ()} | {int(s) for s in steps}
    checkpoint[NONFINITE_KEY] = sorted(merged)


def nonfinite_steps_of(checkpoint: dict[str, Any]) -> list[int]:
    """The steps ``checkpoint`` records as dropped for a non-finite value ([] for none)."""
    return [int(s) for s in checkpoint.get(NONFINITE_KEY) or ()]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from; the message names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self) -> tuple[type[CheckpointError], tuple[Path, str]]:
        # Rebuilt from its own arguments: a branch worker's error crosses the process pool.
        return type(self), (self.path, self.reason)


class CheckpointWriteError(OSError):
    """A file of a run (a checkpoint, the run directory's lock) that could not be written;
    the message names the file, the error and, for a full disk, the space left. Whatever
    stood at that path before is still there (a new file is renamed into place only once
    written), and no other file was touched."""

    def __init__(self, path: Path, error: OSError, message: str | None = None) -> None:
        super().__init__(message or f"cannot write {path}: {_why(path, error)}")
        self.path, self.error, self.errno = path, error, error.errno

    def __reduce__(self) -> tuple[type[CheckpointWriteError], tuple[Path, OSError, str]]:
        # A branch worker's error crosses the process pool with its message: rebuilt from
        # its arguments alone it measured the free space again, at another moment.
        return type(self), (self.path, self.error, str(self))


def _why(path: Path, error: OSError) -> str:
    reason = error.strerror or str(error)
    intact = "; earlier checkpoints are intact" if path.suffix == ".ckpt" else ""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return reason + intact
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = f"{shutil.disk_usage(existing).free / 1e6:.1f} MB free on {existing}"
    except OSError:
        free = f"free space on {existing} unknown"
    return f"{reason} ({free}){intact}: free space, then run again"


def load_checkpoint(path: str | Path, *, weights_enough: bool = False) -> dict[str, Any]:
    """Load a Lightning checkpoint with ``weights_only=True`` and check it can resume a run
    (``weights_enough``: or evaluate a model: a weights-only file will do).

    Raises:
        CheckpointError: missing, empty, truncated, not a torch file, holding code
            (pickled objects are never unpickled), or a weights-only checkpoint (unless
            ``weights_enough``).
    """
    path = Path(path)
    checkpoint = _load_file(path)
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


def _load_file(path: Path) -> Any:
    """What a torch file holds, loaded with ``weights_only=True`` and its checksums read.

    Raises:
        CheckpointError: missing, a directory, empty, truncated, not a torch file, holding
            code, or failing a CRC-32 check.
    """
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
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = _record_failing_crc(archive)
            wrong = misread(checkpoint, archive) if damaged is None else None
    except Exception as error:  # zipfile raises more than BadZipFile on a damaged header
        damaged, wrong = f"(the archive: {type(error).__name__}: {error})", None
    if damaged is not None:
        # torch.load checks no checksum: a flipped bit in a tensor loads, and a resume from
        # it trains on NaN weights to the end.
        raise CheckpointError(
            path,
            f"corrupt: its record {damaged} fails its CRC-32 check (bits changed on disk or "
            "in a copy since it was written); resume from another checkpoint",
        )
    if wrong is not None:
        raise CheckpointError(path, f"corrupt: {wrong}; resume from another checkpoint")
    return checkpoint


def _record_failing_crc(archive: zipfile.ZipFile) -> str | None:
    """The first record of a torch zip file whose bytes fail the CRC-32 stored with them
    (about 2 ms per MB); None when all pass. A stored 0 is none: torch writes no
    checksums after ``torch.serialization.set_crc32_options(False)``.

    Raises:
        Exception: what zipfile raises on a damaged header (BadZipFile, NotImplementedError
            for an unknown compression, UnicodeDecodeError for a name, ...).
    """
    for info in archive.infolist():
        if info.CRC == 0:
            continue
        try:
            with archive.open(info) as record:
                while record.read(1 << 20):  # zipfile checks the CRC at the end
                    pass
        except zipfile.BadZipFile:
            return info.filename
    return None


def checkpoint_step(path: str | Path) -> int:
    """The global step a checkpoint file holds, read once per file version (the main job
    asks for it as it submits each branch of a file, from the training run writing them).

    Raises:
        CheckpointError: as ``load_checkpoint``.
    """
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

    Raises:
        CheckpointWriteError: the file could not be written (a full disk: with the space
            left); the old file, if any, is still there.
    """
    path = Path(path)
    temp = path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}")
    written: _WriteErrors | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "w+b") as handle:
            written = _WriteErrors(handle)
            write(cast(BinaryIO, written))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as error:
        temp.unlink(missing_ok=True)
        raise CheckpointWriteError(path, error) from None
    except BaseException:
        temp.unlink(missing_ok=True)
        if written is not None and written.error is not None:
            # torch's zip writer turns the file's OSError into its own RuntimeError
            # ("unexpected pos"): the disk's error is the one to name (a full disk)
            raise CheckpointWriteError(path, written.error) from None
        raise


class _WriteErrors:
    """A file handle that keeps the ``OSError`` a write raised, whatever the writer (torch's
    zip writer, which calls it from C++) turns it into."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.error = handle, cast(OSError | None, None)

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` through ``atomic_write``: never a partial file under ``path``."""
    atomic_write(Path(path), lambda handle: torch.save(obj, handle))


def remove_leftovers(directory: str | Path) -> list[Path]:
    """Delete temporary files of interrupted saves in ``directory``; returns them. A file
    that a live process is still writing (its pid is in the name) is no leftover: a second
    run started into a busy directory must not break the first one's save before
    ``RunDirectoryLock`` stops it."""
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

    Under ``ddp_spawn``/``ddp_fork`` Lightning hands the fitted weights back to the main
    process in a weights-only temporary file: that one is loaded as the state dict it is
    (still ``weights_only=True``), and removed with its temporary directory.

    Raises:
        CheckpointWriteError: from ``save_checkpoint``, the file could not be written.

    Example:
        >>> trainer = pl.Trainer(plugins=[AtomicCheckpointIO()])
    """

    def __init__(self) -> None:
        super().__init__()
        self._after_teardown: list[Callable[[], None]] = []

    def call_after_teardown(self, function: Callable[[], None]) -> None:
        """Call ``function`` at the end of the next ``teardown``, whatever it raises. A
        failing fit tears the plugin down after every callback's ``on_exception`` (one may
        save a checkpoint there) and the loggers' last events: ``RunDirectoryLock``
        releases the run directory then."""
        self._after_teardown.append(function)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO.save_checkpoint got storage_options={storage_options!r}; "
                "it writes local files and takes none"
            )
        failing = sys.exc_info()[1]  # a save in a callback's on_exception
        try:
            atomic_write(Path(path), lambda handle: save_with_digest(checkpoint, handle))
        except BaseException:
            if failing is not None and _caught_by_lightning(failing):
                # Lightning skips teardown when an on_exception raises: what was to
                # run after it (the run directory's release) runs now
                self._run_after_teardown()
            raise

    @override
    def teardown(self) -> None:
        self._run_after_teardown()

    def _run_after_teardown(self) -> None:
        functions, self._after_teardown = self._after_teardown, []
        for function in functions:
            function()

    @override
    def load_checkpoint(
        self, path: str | Path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                f"refusing to load {path} with weights_only=False: lit-spikes checkpoints hold "
                "only plain data, and full unpickling runs whatever code a file carries"
            )
        if _spawn_handover(Path(path)):
            state_dict = _load_file(Path(path))
            if not isinstance(state_dict, dict):
                raise CheckpointError(Path(path), "holds no state dict of the fitted weights")
            return state_dict
        # A weights-only file passes here: validate and test need no more, and a fit is
        # refused by the module's on_load_checkpoint, which knows the Trainer's stage.
        return load_checkpoint(path, weights_enough=True)

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        path = Path(path)
        path.unlink(missing_ok=True)
        if _spawn_handover(path):  # Lightning leaves its mkdtemp() directory behind
            shutil.rmtree(path.parent, ignore_errors=True)


def _spawn_handover(path: Path) -> bool:
    """Whether ``path`` is the file in which Lightning's ``_MultiProcessingLauncher`` hands
    the weights of ``ddp_spawn``/``ddp_fork``'s rank 0 back: ``<mkdtemp()>/.temp.ckpt``."""
    temp_root = Path(tempfile.gettempdir()).resolve()
    parent = path.parent.resolve()
    return (
        path.name == ".temp.ckpt" and parent.parent == temp_root and parent.name.startswith("tmp")
    )


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
            nonfinite = nonfinite_steps_of(checkpoint)
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
