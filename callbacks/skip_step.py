"""OLMo-core's skip-step: drop the optimizer update of a step whose loss is an outlier."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lit_spikes.callbacks._common import check_finite_above, check_integer
from lit_spikes.callbacks._watch import (
    LOSS,
    Watcher,
    monitor_names,
    note_grad_norm,
    note_loss,
    rank_values,
    reduce_ranks,
)


class SkipStep(Watcher):
    r"""Skips the optimizer update of a step whose loss (or gradient norm) is above
    ``mean + sigma x std`` of the last ``window`` steps (OLMo-core's ``SkipStepOptimizer``:
    6 sigma over 128 steps).

    The decision is taken in ``on_before_optimizer_step``, after backward and before any
    clipping: a skipped step has every ``p.grad`` set to None, so ``torch.optim.AdamW``
    leaves those parameters out entirely: no weight decay, no moment update, no change of
    its ``step`` count (zeroing the gradients instead would still let weight decay and the
    momentum move the weights). The global step and the LR schedule go on, as for any step.
    ``training_step`` is never made to return None, which Lightning refuses under DDP.

    Under several processes the value judged is the global one, the same on every rank:
    the ranks' values are gathered (one ``all_gather`` a step for every watching callback)
    and averaged in rank order; the gradient norm is measured after DDP averaged the
    gradients, so it is identical already. Every rank thus holds the same window and skips
    the same steps.

    Every finite value enters the window, skipped ones too (as in OLMo-core), so a loss
    that settles on a higher level stops being skipped. The window and the skipped steps
    (the last ``max_records``) are the callback's state (``state_dict``), bounded however
    long the run: a run resumed from a checkpoint decides exactly as the uninterrupted one.
    A skipped step is logged as ``skip_step/skipped`` and listed in ``skipped_steps``.

    Args:
        monitor: ``"loss"`` (what ``training_step`` returns), ``"grad_norm"`` (measured
            before clipping), or a key of ``trainer.callback_metrics`` logged in
            ``training_step``.
        window: steps in the rolling window.
        sigma: skip a step whose value exceeds the window's mean + ``sigma`` x std.
        warmup: values in the window before any step can be skipped (None: ``window // 2``,
            at least 2).
        start_step: first global step that may be skipped (values are collected before).
        initial: values to start the window with, e.g. the losses of the run this one
            branches from; a checkpoint's state replaces them.
        max_records: skipped steps kept in the state (the latest).

    Raises:
        ValueError: an argument out of range, or a non-finite initial value.

    Example:
        >>> skip = SkipStep(monitor="loss", window=128, sigma=6.0)
        >>> trainer = pl.Trainer(callbacks=[skip])
        >>> trainer.fit(module, datamodule=dm)
        >>> skip.skipped_steps  # [150]
    """

    def __init__(
        self,
        monitor: str = LOSS,
        window: int = 128,
        sigma: float = 6.0,
        warmup: int | None = None,
        start_step: int = 0,
        initial: Sequence[float] = (),
        max_records: int = 1000,
    ) -> None:
        super().__init__()
        self.monitors = monitor_names(monitor, "SkipStep")
        if len(self.monitors) != 1:
            raise ValueError(f"SkipStep(monitor={monitor!r}) judges one value: give one name")
        window = check_integer("window", window, 2)
        sigma = check_finite_above("sigma", sigma, 0.0)
        warmup = max(2, window // 2) if warmup is None else warmup  # std needs 2 values
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 2 <= warmup <= window:
            raise ValueError(f"warmup={warmup!r} must be an integer in [2, window={window}]")
        start_step = check_integer("start_step", start_step, 0)
        values = [float(v) for v in initial]
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise ValueError(f"initial={bad!r}: every initial value must be finite")
        self.monitor, self.window, self.sigma = self.monitors[0], window, sigma
        self.warmup, self.start_step = warmup, start_step
        self.max_records = check_integer("max_records", max_records, 1)
        self.values: deque[float] = deque(values[-window:], maxlen=window)
        self.skipped_steps: deque[int] = deque(maxlen=self.max_records)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            monitor=self.monitor,
            window=self.window,
            sigma=self.sigma,
            warmup=self.warmup,
            start_step=self.start_step,
        )

    def threshold(self) -> float | None:
        """The value above which the next step is skipped (None: the window is too short)."""
        if len(self.values) < self.warmup:
            return None
        return statistics.fmean(self.values) + self.sigma * statistics.stdev(self.values)

    def decide(self, step: int, value: float) -> bool:
        """Judge one step's (global) value, then add it to the window; True: skip it."""
        if not math.isfinite(value):
            return False  # not a value to judge by (the module's own guard drops it)
        limit = self.threshold()
        skip = step >= self.start_step and limit is not None and value > limit
        self.values.append(value)
        if skip:
            self.skipped_steps.append(step)
        return skip

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        note_loss(trainer, loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = trainer.global_step
        note_grad_norm(trainer, pl_module)  # for every watcher, before this drops it
        values = rank_values(trainer, step, self.monitors)
        if self.monitor not in values:
            return  # nothing to judge by (no loss: the module skipped the batch)
        if not self.decide(step, reduce_ranks(values[self.monitor], "mean")):
            return
        for parameter in pl_module.parameters():
            parameter.grad = None
        for logger in trainer.loggers:  # straight to the loggers, at this step only
            logger.log_metrics({"skip_step/skipped": 1.0}, step=step)

    @override
    def state_dict(self) -> dict[str, Any]:
        # The configuration rides along so a checkpoint says how to rebuild the callback.
        return {
            "values": list(self.values),
            "skipped_steps": list(self.skipped_steps),
            "monitor": self.monitor,
            "window": self.window,
            "sigma": self.sigma,
            "warmup": self.warmup,
            "start_step": self.start_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = deque((float(v) for v in state_dict["values"]), maxlen=self.window)
        self.skipped_steps = deque(
            (int(s) for s in state_dict["skipped_steps"]), maxlen=self.max_records
        )
