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

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed mid-epoch gets no on_train_epoch_start: its bar starts here.
        super().on_train_start(trainer, pl_module)
        self._start_at_global_step(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._start_at_global_step(trainer)

    def _start_at_global_step(self, trainer: pl.Trainer) -> None:
        """The train bar at ``global_step`` of ``max_steps``: a resumed run starts where
        its checkpoint is (``reset`` also clears the speed samples, which would count the
        restored steps as done just now)."""
        if self.progress is None or self.is_disabled:
            return
        if self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        assert self.train_progress_bar_id is not None
        self.progress.reset(
            self.train_progress_bar_id,
            total=self.total_train_batches,
            completed=trainer.global_step,
            description=self._get_train_description(trainer.current_epoch),
        )

    @override
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
