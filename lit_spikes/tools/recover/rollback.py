"""Where a remedy branch starts: the real checkpoint a rollback goes back to, chosen on
the lineage's branches among the files the schedule wrote (``RollbackRestore``'s choice),
so that an interrupted loop decides as the uninterrupted one."""

from __future__ import annotations

import warnings
from pathlib import Path

from lit_spikes.callbacks.rollback import RollbackRestore
from lit_spikes.checkpoints import newest_valid_checkpoint
from lit_spikes.shared.training import CHECKPOINT_DIRNAME
from lit_spikes.tools.recover.ledger import BranchRecord, Ledger

Choice = tuple[int, str | None, str | None]
"""``(step, path, owner branch)``; ``(0, None, None)``: from scratch."""


def scheduled(step: int, every: int) -> int:
    """The newest step at or before ``step`` with a scheduled checkpoint. Rollback
    targets are chosen among those, so the extra file a Ctrl-C writes never changes
    a decision: an interrupted loop decides as the uninterrupted one."""
    return step - step % every


def _scheduled_rollback(
    directory: Path, limit: int, distance: int, every: int, refused: list[str]
) -> tuple[int, str]:
    """``RollbackRestore``'s choice in ``directory`` below ``limit + distance``, passed
    back to a scheduled file; the files it refused are added to ``refused``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rollback = RollbackRestore(directory, spike_step=limit + distance, distance=distance)
        step, path = rollback.ckpt_step, rollback.ckpt_path
        refused.extend(rollback.refused)
        while step != scheduled(step, every):
            # A Ctrl-C's file, reached past a refused scheduled one: passed over too, or
            # an interrupted loop would decide otherwise
            rollback = RollbackRestore(
                directory, spike_step=scheduled(step, every) + distance, distance=distance
            )
            step, path = rollback.ckpt_step, rollback.ckpt_path
            refused.extend(rollback.refused)
    return step, str(path)


def choose_rollback(
    ledger: Ledger, root: Path, spiked: BranchRecord, onset: int, distance: int, every: int
) -> tuple[int, str | None, str | None, list[str]]:
    """The newest valid checkpoint of the lineage at least ``distance`` steps before
    ``onset``: ``RollbackRestore``'s choice in this branch's checkpoints, then in each
    ancestor's up to where the lineage left it (``every``: the checkpoint schedule).
    Returns ``(step, path, owner branch, refused files)``; ``(0, None, None, ...)``:
    from scratch."""
    distance = min(distance, onset)
    refused: list[str] = []
    bound = onset - distance
    for record, first, end in reversed(ledger.lineage(spiked.name)):
        limit = scheduled(bound if end is None else min(bound, end), every)
        directory = root / record.name / CHECKPOINT_DIRNAME
        if not directory.is_dir() or limit <= first:
            continue
        try:
            step, path = _scheduled_rollback(directory, limit, distance, every, refused)
        except FileNotFoundError:
            continue
        if step > first:  # absolute: the ledger goes on from any working directory
            return step, str(Path(path).resolve()), record.name, refused
    return 0, None, None, refused


def newest_on_lineage(
    ledger: Ledger, root: Path, branch: BranchRecord, steps: int, every: int
) -> Choice:
    """The newest valid scheduled checkpoint on the lineage through ``branch`` (a run of
    ``steps`` steps, a checkpoint every ``every``): ``(step, path, owner branch)``;
    ``(0, None, None)``: none, from scratch."""
    for record, first, end in reversed(ledger.lineage(branch.name)):
        directory = root / record.name / CHECKPOINT_DIRNAME
        if not directory.is_dir():
            continue
        limit = scheduled(steps if end is None else end, every)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step, path, _ = newest_valid_checkpoint(directory, limit)
                while step != scheduled(step, every):  # a Ctrl-C's file: passed over
                    step, path, _ = newest_valid_checkpoint(directory, scheduled(step, every))
        except FileNotFoundError:
            continue
        if step > first:
            return step, str(Path(path).resolve()), record.name
    return 0, None, None
