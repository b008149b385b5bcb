"""Where a warning raised inside a hook that Lightning calls should point: at the user's
own call (``trainer.fit(...)``), not at the line of Lightning that ran the hook."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning

LIGHTNING_DIR = str(Path(lightning.__file__).resolve().parent)
"""Frames in files under this directory are Lightning's."""


def outside_lightning() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function calling this one that
    names the first frame above it outside Lightning (2, its direct caller, when that
    is not Lightning)."""
    frame = inspect.currentframe()
    warner = frame.f_back if frame is not None else None  # the function that warns
    caller = warner.f_back if warner is not None else None
    level = 2
    while caller is not None and str(Path(caller.f_code.co_filename).resolve()).startswith(
        LIGHTNING_DIR
    ):
        caller, level = caller.f_back, level + 1
    return level
