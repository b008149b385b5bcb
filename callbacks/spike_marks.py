"""``SpikeMarks``: a ``SpikeDetector``'s spikes drawn on the TensorBoard chart of the curve
they were found on, for any module, read as markers under TensorBoard's default settings.

- **Which chart.** The tag the module's loggers get the monitored curve under: a name the
  detector is told (``curves``); for ``loss`` (the returned loss), the name the module
  logs the same value under (``self.log("train_loss", loss)``, found by equality at the
  fit's first step); for a logged name, itself (``<name>_step`` where it is logged on
  step and epoch). Where the module's loggers get the curve from nobody (``loss`` logged
  under no name, ``grad_norm`` without ``TrainingCurves``), the detector logs it itself,
  at Lightning's logging steps and every flagged step.
- **How a mark looks.** Each episode onset is a run of its own, ``<log_dir>/spikes/step_<k>``,
  holding one point: TensorBoard draws a one-point series as a dot, and smoothing (0.6 by
  default) leaves a single point where it is; several points in one run were drawn as a
  smoothed line. The dot sits at the level the curve rose from, the spike's reference (the
  median of the detector's window, or its mean for a ``ratio`` or ``z_score`` rule): the
  spike's own value lies outside the range TensorBoard's default "Ignore outliers in chart
  scaling" keeps, and a mark at that height was cropped with it; so was one at the curve's
  last value before the onset where the loss had begun to rise there (the demo's 147).

Seen in headless Chromium: docs/detector.md, scripts/tensorboard_check.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

from lit_spikes.callbacks.common import trainer_callbacks
from lit_spikes.callbacks.curves import TrainingCurves, logging_step
from lit_spikes.callbacks.watch import GRAD_NORM, LOSS

MARKS_RUN = "spikes"
"""The folder of a run's log directory that holds its marks, a run per episode onset."""


def mark_run(step: int) -> str:
    """The run (under a logger's ``log_dir``) of the mark of the onset at ``step``."""
    return f"{MARKS_RUN}/step_{step}"


def write_mark(log_dir: str | Path, tag: str, step: int, level: float) -> None:
    """The mark of an onset at ``step``: a one-point run of its own under ``log_dir``, at
    ``level`` on the chart ``tag`` (nothing for a level that is not finite)."""
    if math.isfinite(level):
        writer = SummaryWriter(log_dir=str(Path(log_dir) / mark_run(step)))
        writer.add_scalar(tag, level, step)
        writer.close()  # on disk at once, beside the run's own events


@dataclass(frozen=True)
class Chart:
    """Where a monitored name's marks go."""

    tag: str
    """The tag of its curve's chart."""
    own: bool
    """Whether the detector logs the curve itself (the module's loggers get it from no
    one else)."""


def _equal_to_loss(
    metrics: Mapping[str, object], loss: torch.Tensor
) -> tuple[list[str], torch.Tensor]:
    """The logged per-step scalars (no epoch aggregates) and, on the device, whether each
    equals ``loss`` (1.0, float64): compared without a host read."""
    scalars = {
        name: value
        for name, value in metrics.items()
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not name.endswith("_epoch")
    }
    names = sorted(scalars, key=lambda name: name != LOSS)  # the module's own "loss" first
    same = [scalars[n].detach().reshape(()).to(loss.device, torch.float64) == loss for n in names]
    return names, torch.stack(same).double() if same else torch.zeros(0, dtype=torch.float64)


class SpikeMarks:
    """The marks of one detector: its charts, found at each fit's first judged step, the
    curves it logs itself, and a one-point run per episode onset (module docstring).

    Args:
        monitors: the detector's watched names.
        curves: the tag of a name's curve where the user states it (``SpikeDetector(curves=)``).
    """

    def __init__(self, monitors: Sequence[str], curves: Mapping[str, str]) -> None:
        self.monitors, self.curves = tuple(monitors), dict(curves)
        self._charts: dict[str, Chart] = {}
        self._seen: tuple[list[str], list[str]] | None = None
        self._grad_norm_logged = False

    def begin(self) -> None:
        """A fit begins: its charts are found at its first step (a resume may log anew)."""
        self._charts, self._seen = {}, None

    def observe(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor | None
    ) -> torch.Tensor | None:
        """At a judged step (``on_train_batch_end``): the first of the fit notes what the
        module logs and returns, on the device, which of it equals ``loss`` (this rank's
        float64 step loss, or None where ``loss`` is not watched), for the caller to read
        back with the step's values and hand to ``resolve``; None after the first."""
        if self._seen is not None or self._charts:
            return None
        metrics = dict(trainer.callback_metrics)
        names: list[str] = []
        same = torch.zeros(0, dtype=torch.float64)
        if loss is not None and LOSS not in self.curves:
            names, same = _equal_to_loss(metrics, loss)
        self._seen = (list(metrics), names)
        if GRAD_NORM in self.monitors and GRAD_NORM not in self.curves:
            # The module logs it itself, or TrainingCurves does.
            module_logs = bool(getattr(pl_module, "logs_lr_and_grad_norm", False))
            callbacks = trainer_callbacks(trainer)
            self._grad_norm_logged = module_logs or any(
                isinstance(c, TrainingCurves) for c in callbacks
            )
        if not names:
            self.resolve([])
        return same

    def resolve(self, same: Sequence[float]) -> None:
        """The charts, from ``observe``'s comparison read back (``same``: 1.0 where equal)."""
        if self._seen is None:
            return
        keys, names = self._seen
        equal = [n for n, s in zip(names, same, strict=True) if s]
        self._charts = {m: self._chart(m, keys, equal) for m in self.monitors}
        self._seen = None

    def charts(self) -> dict[str, Chart]:
        """Each monitored name's chart (empty until ``resolve``)."""
        return self._charts

    def _chart(self, metric: str, keys: list[str], equal: list[str]) -> Chart:
        if metric in self.curves:
            return Chart(self.curves[metric], own=False)
        if metric == LOSS:
            if not equal:
                return Chart(LOSS, own=True)
            name = equal[0]  # the forked name is the one the loggers get
            return Chart(f"{name}_step" if f"{name}_step" in equal else name, own=False)
        if metric == GRAD_NORM:
            return Chart(GRAD_NORM, own=not self._grad_norm_logged)
        return Chart(f"{metric}_step" if f"{metric}_step" in keys else metric, own=False)

    def log_curves(
        self, trainer: pl.Trainer, step: int, values: Mapping[str, float], flagged: bool
    ) -> None:
        """The values of the curves the detector logs itself at ``step`` (at Lightning's
        logging steps, and at a flagged step)."""
        own = {c.tag: values[m] for m, c in self.charts().items() if c.own and m in values}
        if own and (flagged or logging_step(trainer, step)):
            for logger in trainer.loggers:
                logger.log_metrics(own, step=step)

    def write(self, trainer: pl.Trainer, metric: str, step: int, level: float) -> None:
        """The mark of an episode onset of ``metric`` at ``step``, at ``level`` (the level
        it rose from: the spike's reference): a one-point run of its own, under each
        TensorBoard logger."""
        chart = self.charts().get(metric)
        if chart is None or trainer.global_rank != 0:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                write_mark(logger.log_dir, chart.tag, step, level)
