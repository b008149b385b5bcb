"""Prune old step checkpoints without ever deleting one a rollback or resume needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lit_spikes.callbacks.common import check_integer, trainer_callbacks
from lit_spikes.checkpoints import checkpoint_files


class CheckpointRetention(Callback):
    """Deletes old ``step=<k>.ckpt`` files in ``dirpath``, keeping:

    - the newest ``keep_last`` files;
    - every file within ``rollback_distance`` steps behind the last step trained, and the
      newest one at least that far behind (the file a rollback for a spike now would use);
      after a step whose update was skipped for a non-finite loss or gradient, the newest
      file written before it instead (rollbacks pass over every later one);
    - the file this run was resumed from.

    A spike flagged steps ago and acted on only now may find its rollback target pruned:
    roll back when the spike is flagged (``recover`` does), or keep a longer distance.

    Pruning runs at the start of a step and at the end of training, so the checkpoint the
    previous step wrote is complete (written atomically) before any older one goes.

    Args:
        dirpath: the run's checkpoint directory: the one a ``ModelCheckpoint`` of the
            Trainer writes to (None: that one). Another is refused at fit start: it would
            delete another run's files (a typo in a hand-typed path).
        keep_last: newest files always kept, at least 1.
        rollback_distance: steps behind the current one that a rollback may need.

    Raises:
        ValueError: ``keep_last`` not an integer >= 1, ``rollback_distance`` not one >= 0;
            at fit start, a ``dirpath`` no ``ModelCheckpoint`` of the Trainer writes to (or
            None with no single one to take).

    Example:
        >>> trainer = pl.Trainer(callbacks=[CheckpointRetention("runs/x/checkpoints", 3, 100)])
    """

    def __init__(
        self, dirpath: str | Path | None = None, keep_last: int = 3, rollback_distance: int = 100
    ):
        super().__init__()
        # 2.5 failed at the first prune; a NaN distance deleted every rollback target.
        keep_last = check_integer("keep_last", keep_last, 1)
        rollback_distance = check_integer("rollback_distance", rollback_distance, 0)
        self._given = None if dirpath is None else Path(dirpath)
        self.dirpath = self._given or Path()  # set at fit start when not given
        self.keep_last = keep_last
        self.rollback_distance = rollback_distance
        self.deleted: list[Path] = []

    def keep(
        self,
        files: list[tuple[int, Path]],
        step: int,
        resumed: Path | None,
        first_nonfinite: int | None = None,
    ) -> set[Path]:
        """The files to keep at global step ``step`` (``files`` sorted by step), after a
        skipped non-finite update at step ``first_nonfinite`` if any."""
        kept = {path for _, path in files[-self.keep_last :]}
        # At global step g the last step trained is g - 1: a spike there rolls back to a
        # file at or before g - 1 - distance (a spike in the coming step, to a later one).
        horizon = step - 1 - self.rollback_distance
        kept |= {path for s, path in files if s > horizon}
        # A file of step s holds the updates of steps 0..s-1: those after a non-finite
        # step are refused as rollback targets (newest_valid_checkpoint).
        target = horizon if first_nonfinite is None else min(horizon, first_nonfinite)
        behind = [path for s, path in files if s <= target]
        if behind:
            kept.add(behind[-1])
        if resumed is not None:
            kept |= {path for _, path in files if path.resolve() == resumed.resolve()}
        return kept

    @rank_zero_only
    def prune(self, trainer: pl.Trainer) -> None:
        if not self.dirpath.is_dir():
            return
        files = checkpoint_files(self.dirpath)
        resumed = Path(trainer.ckpt_path) if trainer.ckpt_path else None
        # The non-finite steps as read back by whatever drops their updates (a SkipStep,
        # a module that does it itself), without a host read each step: complete up to
        # the newest checkpoint (a save reads back first), which is all the files need.
        nonfinite: list[int] = []
        for owner in [trainer.lightning_module, *trainer_callbacks(trainer)]:
            nonfinite += getattr(owner, "nonfinite_steps_read", None) or []
        first_nonfinite = min(nonfinite) if nonfinite else None
        kept = self.keep(files, trainer.global_step, resumed, first_nonfinite)
        for _, path in files:
            if path not in kept:
                path.unlink(missing_ok=True)
                self.deleted.append(path)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After every setup: a ModelCheckpoint's directory is resolved by then.
        written = sorted(
            {
                Path(cb.dirpath).resolve()
                for cb in trainer_callbacks(trainer)
                if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None
            }
        )
        if self._given is None:
            if len(written) != 1:
                raise ValueError(
                    "CheckpointRetention(dirpath=None) takes the directory of the Trainer's "
                    f"ModelCheckpoint, but it has {len(written)} ({written}): give dirpath"
                )
            self.dirpath = written[0]
        elif self._given.resolve() not in written:
            raise ValueError(
                f"CheckpointRetention(dirpath={str(self._given)!r}) would prune a directory no "
                f"ModelCheckpoint of this Trainer writes to (they write to "
                f"{[str(w) for w in written] or 'none'}): it would delete another run's files. "
                "Give the run's checkpoint directory, or leave dirpath out to take it"
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.prune(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.prune(trainer)
