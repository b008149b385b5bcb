"""Reading Lightning checkpoints safely, with errors that name the file and the fault."""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

STEP_PATTERN = re.compile(r"step=(\d+)")
REQUIRED_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "loops")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from; the message names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = path, reason


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a Lightning checkpoint with ``weights_only=True`` and check it can resume a run.

    Raises:
        CheckpointError: missing, empty, truncated, not a torch file, holding code
            (pickled objects are never unpickled), or a weights-only checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "no such file")
    if path.stat().st_size == 0:
        raise CheckpointError(path, "the file is empty (0 bytes): a save was interrupted")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first_line = str(error).strip().splitlines()[-1][:200]
        raise CheckpointError(
            path, f"refused to unpickle non-tensor objects ({first_line})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        reason = "truncated or corrupt" if zipfile.is_zipfile(path) else "not a torch checkpoint"
        raise CheckpointError(path, f"{reason} ({type(error).__name__}: {error})") from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(path, f"holds a {type(checkpoint).__name__}, not a checkpoint dict")
    missing = [key for key in REQUIRED_KEYS if key not in checkpoint]
    if missing == ["optimizer_states", "lr_schedulers"] or (
        "state_dict" in checkpoint and "optimizer_states" in missing
    ):
        raise CheckpointError(
            path, "holds weights only (no optimizer state): it cannot resume a run bit-exactly"
        )
    if missing:
        raise CheckpointError(path, f"is not a Lightning training checkpoint (missing {missing})")
    return checkpoint


def checkpoint_files(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``*step=<k>*.ckpt`` file in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    found = []
    for path in directory.glob("*.ckpt"):
        match = STEP_PATTERN.search(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)
