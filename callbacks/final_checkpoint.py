"""Write a checkpoint where training ends, when the regular interval does not fall there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks.common import (
    check_integer,
    ends_at_this_step,
    trainer_callbacks,
    unused_checkpoint_path,
)
from lit_spikes.callbacks.preemption import PreemptionCheckpoint


class FinalCheckpoint(Callback):
    """When training ends at a step the every-``every_n_steps`` checkpoints do not cover
    (``max_steps=22`` with a checkpoint every 5), writes ``<dirpath>/step=<k>.ckpt`` of
    that last step through the Trainer's CheckpointIO, so that extending the run later
    (``--ckpt_path latest`` with a larger ``max_steps``) repeats nothing and a run shorter
    than the interval still leaves a file. A step the interval or a preemption already
    saved is not written again, and a file of that name from another run into the same
    directory is kept (the new one is then ``step=<k>-v1.ckpt``). Whether to save depends
    only on the step, so every rank of a DDP run decides alike (a save is a collective).

    Args:
        dirpath: directory of the run's ``step=<k>.ckpt`` files.
        every_n_steps: the interval of the run's regular checkpoints.

    Raises:
        ValueError: ``every_n_steps`` not an integer >= 1.

    Example:
        >>> trainer = pl.Trainer(callbacks=[step_checkpoint(d, 50), FinalCheckpoint(d, 50)])
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int) -> None:
        super().__init__()
        every_n_steps = check_integer("every_n_steps", every_n_steps, 1)
        self.dirpath, self.every_n_steps = Path(dirpath), every_n_steps
        self.saved_path: Path | None = None
        self._saved_step: int | None = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # Where the run's length ends it: saved as the every-k files are, before the
        # step's validation, which a resume replays (ExactResume). A file written after it
        # (on_train_end) would have Lightning's restart step a ReduceLROnPlateau again.
        if ends_at_this_step(trainer):
            self._save(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer)  # ended otherwise: EarlyStopping, max_time, a stop of its own

    def _save(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        preempted = any(
            isinstance(cb, PreemptionCheckpoint) and cb.saved_path is not None
            for cb in trainer_callbacks(trainer)
        )
        written = self.saved_path is not None and self._saved_step == step
        if step == 0 or step % self.every_n_steps == 0 or preempted or written:
            return
        # Only rank 0 writes: the other ranks' names do not matter.
        path = unused_checkpoint_path(self.dirpath, step)
        self.saved_path, self._saved_step = path, step
        trainer.save_checkpoint(path, weights_only=False)
