"""TensorBoard curves for any module: ``lr`` and ``grad_norm`` once per logging interval
(``TrainingCurves``); the spike marks on a curve's chart are ``spike_marks``'. Why these
shapes: docs/detector.md."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks.watch import _record, note_grad_norm


def logging_step(trainer: pl.Trainer, step: int) -> bool:
    """Lightning's rule for the steps ``self.log`` values reach the loggers."""
    every: int = getattr(trainer, "log_every_n_steps", 50)  # set on it, untyped
    return bool(every) and ((step + 1) % every == 0 or trainer.should_stop)


class TrainingCurves(Callback):
    """Logs ``lr`` (each optimizer's first parameter group; ``lr/<i>`` with several) and
    ``grad_norm`` (the total L2 norm of the gradients before clipping, measured on the
    device as the watchers measure it, once for all of them) at the steps Lightning logs
    ``self.log`` values (every ``log_every_n_steps``): one host read per logging step,
    none in between. The LR is the one the step's optimizer step used. Left out for a
    module that logs both itself (``logs_lr_and_grad_norm = True``, as ``TinyGPTModule``).

    Example:
        >>> trainer = pl.Trainer(callbacks=[TrainingCurves()], log_every_n_steps=10)
    """

    def __init__(self) -> None:
        self._lrs: tuple[int, dict[str, float]] | None = None
        """The LRs of the logging step being trained, as its optimizer step used them."""

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        step = trainer.global_step
        if self._wanted(trainer, pl_module) and logging_step(trainer, step):
            note_grad_norm(trainer, pl_module)  # on the device; shared with the watchers
            # The LR this step uses (a remedy's change included): at the batch's end a
            # step-interval scheduler has already moved it to the next step's.
            optimizers = trainer.optimizers
            self._lrs = (
                step,
                {
                    "lr" if len(optimizers) == 1 else f"lr/{i}": float(o.param_groups[0]["lr"])
                    for i, o in enumerate(optimizers)
                },
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        step = trainer.global_step - 1  # the step just trained
        if self._lrs is None or self._lrs[0] != step:
            return  # not a logging step, or a micro-batch before its optimizer step
        metrics, self._lrs = dict(self._lrs[1]), None
        record = _record(trainer, step)
        if record.grad_norm is not None:
            metrics["grad_norm"] = float(record.grad_norm)  # the one read of this interval
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @staticmethod
    def _wanted(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        return bool(trainer.loggers) and not getattr(pl_module, "logs_lr_and_grad_norm", False)
