"""TensorBoard curves for any module: ``lr`` and ``grad_norm`` once per logging interval
(``TrainingCurves``), and spikes drawn on the chart of the curve they were found on
(``mark_spike``). Why these shapes: docs/detector.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter
from typing_extensions import override

from lit_spikes.callbacks.watch import _record, note_grad_norm

SPIKES_RUN = "spikes"
"""The sibling run (a subdirectory of the run's log directory) that holds the spike marks."""


def _logging_step(trainer: pl.Trainer, step: int) -> bool:
    """Lightning's rule for the steps ``self.log`` values reach the loggers."""
    every: int = getattr(trainer, "log_every_n_steps", 50)  # set on it, untyped
    return bool(every) and ((step + 1) % every == 0 or trainer.should_stop)


class TrainingCurves(Callback):
    """Logs ``lr`` (each optimizer's first parameter group; ``lr/<i>`` with several) and
    ``grad_norm`` (the total L2 norm of the gradients before clipping, measured on the
    device as the watchers measure it, once for all of them) at the steps Lightning logs
    ``self.log`` values (every ``log_every_n_steps``): one host read per logging step,
    none in between. Left out for a module that logs both itself
    (``logs_lr_and_grad_norm = True``, as ``TinyGPTModule``).

    Example:
        >>> trainer = pl.Trainer(callbacks=[TrainingCurves()], log_every_n_steps=10)
    """

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self._wanted(trainer, pl_module) and _logging_step(trainer, trainer.global_step):
            note_grad_norm(trainer, pl_module)  # on the device; shared with the watchers

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        step = trainer.global_step - 1  # the step just trained
        if step < 0 or not self._wanted(trainer, pl_module) or not _logging_step(trainer, step):
            return
        record = _record(trainer, step)
        optimizers = trainer.optimizers
        metrics = {
            "lr" if len(optimizers) == 1 else f"lr/{i}": float(o.param_groups[0]["lr"])
            for i, o in enumerate(optimizers)
        }
        if record.grad_norm is not None:
            metrics["grad_norm"] = float(record.grad_norm)  # the one read of this interval
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @staticmethod
    def _wanted(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        return bool(trainer.loggers) and not getattr(pl_module, "logs_lr_and_grad_norm", False)


class SpikeMarks:
    """Writes spikes into the sibling run ``<log_dir>/spikes`` of each TensorBoard logger,
    under the tag of the curve they were found on: TensorBoard's Scalars view draws every
    run's series of one tag on one chart, so each spike is a point of another colour on
    its curve's chart, at the curve's own value (TensorBoard keeps one value per step and
    tag: no marker shapes; spikes of consecutive steps are joined, as the curve is)."""

    def __init__(self) -> None:
        self._writers: dict[str, SummaryWriter] = {}

    def write(self, trainer: pl.Trainer, tag: str, step: int, value: float) -> None:
        if trainer.global_rank != 0:
            return
        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger):
                continue
            where = str(Path(logger.log_dir) / SPIKES_RUN)
            writer = self._writers.get(where)
            if writer is None:
                writer = self._writers[where] = SummaryWriter(log_dir=where)
            writer.add_scalar(tag, value, step)
            writer.flush()  # beside the run's own events: on disk as they are

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
