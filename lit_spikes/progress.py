"""A progress bar for step-based runs: global steps out of ``max_steps``.

Lightning's default bar counts batches of the current epoch against the batches left,
and names the epoch out of ``max_epochs - 1``. This project's runs are one endless epoch
bounded by ``max_steps``, resumed mid-way from step checkpoints, so that bar reads
``Epoch 0/-2 ... 400/299`` for a run resumed at step 100. This one reads
``Step ... 400/400``, and a resumed run starts where its checkpoint is (``100/400``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from typing_extensions import override


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, counting global steps up to ``trainer.max_steps``.

    Raises:
        ValueError: (in ``setup``) a Trainer without ``max_steps``: then there is no step
            count to show; use Lightning's own bar.

    Example:
        >>> trainer = pl.Trainer(max_steps=400, callbacks=[StepProgressBar()])
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and (trainer.max_steps is None or trainer.max_steps < 1):
            raise ValueError(
                f"StepProgressBar needs a Trainer with max_steps >= 1; got max_steps="
                f"{trainer.max_steps}: set it, or drop the callback for Lightning's own bar"
            )
        super().setup(trainer, pl_module, stage)

    @property
    @override
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps

    def _get_train_description(self, current_epoch: int) -> str:
        description = "Step"
        # as Lightning pads "Epoch k": the validation bar's label must not shift the bars
        return f"{description:{len(self.validation_description)}}"

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # The parent shows ``batch_idx + 1``: make that the global step just completed.
        super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)


def with_step_progress_bar(callbacks: list[Any]) -> list[Any]:
    """``callbacks`` plus a StepProgressBar, unless they hold a progress bar already."""
    if any(isinstance(callback, ProgressBar) for callback in callbacks):
        return callbacks
    return [*callbacks, StepProgressBar()]
