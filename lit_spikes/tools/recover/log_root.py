"""The log root's own rules: ``--fresh`` empties only a recovery log root, and a first
start refuses a directory that already holds files (it would delete what is named like
its branches)."""

from __future__ import annotations

import shutil
from pathlib import Path

from lit_spikes.callbacks.run_lock import LOCK_NAME
from lit_spikes.tools.recover.ledger import LEDGER_NAME, NotALogRoot


def _entries(root: Path) -> list[str]:
    return sorted(e.name for e in root.iterdir() if e.name != LOCK_NAME)


def _named(others: list[str]) -> str:
    return f"{', '.join(others[:5])}{', ...' if len(others) > 5 else ''}"


def clear_log_root(root: Path) -> None:
    """``--fresh``: empty ``root`` but its lock.

    Raises:
        NotALogRoot: it holds files but no ledger (a typo, ``runs``, ``.``).
    """
    others = _entries(root)
    if others and not (root / LEDGER_NAME).is_file():
        raise NotALogRoot(
            f"--fresh would delete everything in {root}, but it holds no "
            f"{LEDGER_NAME}: it is not a recovery log root ({len(others)} entries: "
            f"{_named(others)}). Choose another --log_root, or empty this one yourself"
        )
    for entry in root.iterdir():
        if entry.name == LOCK_NAME:  # stays: another recover would find it locked
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def refuse_foreign_files(root: Path) -> None:
    """A first start into ``root``: the ledger is written at once, so anything else there
    is not this loop's.

    Raises:
        NotALogRoot: naming what is there.
    """
    if others := _entries(root):
        raise NotALogRoot(
            f"{root} holds no {LEDGER_NAME} but {len(others)} entries "
            f"({_named(others)}): a new "
            "recovery loop there would delete its branch directories (base, "
            "accepted, spike*, compare) if they are among them. Choose another "
            "--log_root, or empty this one yourself"
        )
