"""What this process writes in a run directory, whoever in it writes: Python's audit hook
sees every open for writing, mkdir, rename and removal (Lightning's, the logger's, the
module's alike). A failed fit start undoes these and only these (``fit_start``): what
another process made or changed meanwhile is not in them. The hook, once added, stays for
the process's life (there is no removing one) and returns at once while nothing records.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def identity(path: Path) -> tuple[bool, int, int, int]:
    """A directory entry's identity: whether a folder, its inode, size and mtime."""
    stat = path.stat()
    return path.is_dir(), stat.st_ino, stat.st_size, stat.st_mtime_ns


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_HOOKED: list[bool] = []
_RECORDING: list[WriteRecorder] = []
"""The recorders listening now; the audit hook, once added, stays for the process's life
and returns at once while this is empty."""


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _RECORDING:
        return
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else None
        if writes or (writes is None and isinstance(flags, int) and flags & _WRITE_FLAGS):
            _RECORDING[-1].see(path)
    elif event in ("os.mkdir", "os.remove"):
        _RECORDING[-1].see(args[0])
    elif event in ("os.rename", "os.replace"):
        _RECORDING[-1].see(args[1])


@dataclass
class WriteRecorder:
    """The paths this process writes or creates in ``root`` (or through a symlink there),
    each with whether it existed before its first write and its identity as written."""

    root: Path
    existed: dict[Path, bool] = field(default_factory=dict)
    """Real path: whether it was there before this process first wrote it."""
    written: dict[Path, tuple[bool, int, int, int] | None] = field(default_factory=dict)
    """Real path: its identity at the fit's hook after the write (None: not seen since)."""

    def see(self, path: Any) -> None:
        if isinstance(path, int) or path is None:
            return  # a file descriptor: opened before, by path
        try:
            given = Path(os.path.abspath(os.fsdecode(path)))
            real = Path(os.path.realpath(given))
        except (TypeError, ValueError, OSError):
            return
        root = Path(os.path.abspath(self.root))
        inside = root in given.parents or root in real.parents
        if inside and real not in self.existed:
            self.existed[real] = os.path.lexists(real)
        if inside:
            self.written[real] = None

    def settle(self) -> None:
        """Note each written path's identity now (a hook of the fit, after its writes)."""
        for real, settled in self.written.items():
            if settled is None and real.exists():
                self.written[real] = identity(real)

    def ours(self, real: Path) -> bool:
        """Whether ``real`` is as this process left it (its identity as settled)."""
        settled = self.written.get(real)
        if real not in self.written or not real.exists():
            return False
        now = identity(real)
        if settled is None:
            return True  # the failure came before any hook after the write
        if real.name.startswith("events.out.tfevents.") and f".{os.getpid()}." in real.name:
            return now[1] == settled[1]  # our logger writes on into it: its inode alone
        return now == settled

    def made(self, path: Path, directory: bool) -> bool:
        """Whether this process created ``path`` (a file: and left it as it wrote it)."""
        real = Path(os.path.realpath(path))
        return not self.existed.get(real, True) and (directory or self.ours(real))

    def changed(self, path: Path) -> bool:
        """Whether ``path``, there before, was changed or removed by this process alone."""
        real = Path(os.path.realpath(path))
        return real in self.written and (not path.exists() or self.ours(real))

    def made_outside(self) -> list[Path]:
        """Files this process created outside ``root``, through a symlink in it."""
        root = Path(os.path.abspath(self.root))
        return [
            real
            for real, existed in self.existed.items()
            if root not in real.parents and not existed and real.is_file() and self.ours(real)
        ]

    @contextmanager
    def recording(self) -> Iterator[WriteRecorder]:
        """Within it (until ``stop``), this process's writes are seen."""
        if not _HOOKED:
            sys.addaudithook(_audit)  # there is no removing one: it idles when not asked
            _HOOKED.append(True)
        _RECORDING.append(self)
        try:
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        if self in _RECORDING:
            _RECORDING.remove(self)
