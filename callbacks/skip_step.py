"""OLMo-core's skip-step: drop the optimizer update of a step whose loss is an outlier."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks._common import check_finite_above, check_integer, module_history

SKIP_METRICS = ("loss", "grad_norm")
"""What a ``SkipStep`` can judge a step by."""


class SkipStep(Callback):
    r"""Skips the optimizer update of a step whose loss (or gradient norm) is above
    ``mean + sigma x std`` of the last ``window`` steps (OLMo-core's ``SkipStepOptimizer``:
    6 sigma over 128 steps).

    The decision is taken in ``on_before_optimizer_step``, after backward and before any
    clipping: a skipped step has every ``p.grad`` set to None, so ``torch.optim.AdamW``
    leaves those parameters out entirely: no weight decay, no moment update, no change of
    its ``step`` count (zeroing the gradients instead would still let weight decay and the
    momentum move the weights). The global step and the LR schedule go on, as for any step.
    That is how ``TinyGPTModule`` already skips non-finite steps; ``training_step`` is never
    made to return None, which Lightning refuses under DDP.

    Under several processes the value judged is the global one, the same on every rank:
    each rank's loss (of its own shard) is gathered with one ``all_gather`` and averaged in
    rank order; the gradient norm is measured after DDP averaged the gradients, so it is
    identical already. Every rank thus holds the same window and skips the same steps.

    Every finite value enters the window, skipped ones too (as in OLMo-core), so a loss
    that settles on a higher level stops being skipped. The window, the step count and the
    skipped steps are the callback's state (``state_dict``): a run resumed from a checkpoint
    decides exactly as the uninterrupted one. A skipped step is marked ``skipped`` in the
    module's ``history`` (its ``grad_norm`` stays the one measured before the drop), logged
    as ``skip_step/skipped`` and listed in ``skipped_steps``.

    Args:
        metric: ``"loss"`` (the module's recorded training loss) or ``"grad_norm"``.
        window: steps in the rolling window.
        sigma: skip a step whose value exceeds the window's mean + ``sigma`` x std.
        warmup: values in the window before any step can be skipped (None: ``window // 2``,
            at least 2).
        start_step: first global step that may be skipped (values are collected before).
        initial: values to start the window with, e.g. the losses of the run this one
            branches from; a checkpoint's state replaces them.

    Raises:
        ValueError: an argument out of range, or a non-finite initial value.
        TypeError: in ``setup``, for ``metric="loss"`` with a module that records no
            per-step ``history`` (like ``TinyGPTModule`` does).

    Example:
        >>> skip = SkipStep(metric="loss", window=128, sigma=6.0)
        >>> trainer = pl.Trainer(callbacks=[skip])
        >>> trainer.fit(module, datamodule=dm)
        >>> skip.skipped_steps  # [150]
    """

    def __init__(
        self,
        metric: Literal["loss", "grad_norm"] = "loss",
        window: int = 128,
        sigma: float = 6.0,
        warmup: int | None = None,
        start_step: int = 0,
        initial: Sequence[float] = (),
    ) -> None:
        super().__init__()
        if metric not in SKIP_METRICS:
            raise ValueError(f"metric={metric!r} must be one of {SKIP_METRICS}")
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
        self.metric, self.window, self.sigma = metric, window, sigma
        self.warmup, self.start_step = warmup, start_step
        self.values: deque[float] = deque(values[-window:], maxlen=window)
        self.skipped_steps: list[int] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            metric=self.metric,
            window=self.window,
            sigma=self.sigma,
            warmup=self.warmup,
            start_step=self.start_step,
        )

    @property
    @override
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # Files written before warmup and start_step joined the key: Lightning falls back.
        return self._generate_state_key(metric=self.metric, window=self.window, sigma=self.sigma)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.metric == "loss" and not hasattr(pl_module, "history"):
            raise TypeError(
                f"SkipStep(metric='loss') needs a module that records per-step values in "
                f"`history` (like TinyGPTModule); {type(pl_module).__name__} does not"
            )

    def threshold(self) -> float | None:
        """The value above which the next step is skipped (None: the window is too short)."""
        if len(self.values) < self.warmup:
            return None
        return statistics.fmean(self.values) + self.sigma * statistics.stdev(self.values)

    def decide(self, step: int, value: float) -> bool:
        """Judge one step's (global) value, then add it to the window; True: skip it."""
        if not math.isfinite(value):
            return False  # the module already drops non-finite steps; keep it out of the window
        limit = self.threshold()
        skip = step >= self.start_step and limit is not None and value > limit
        self.values.append(value)
        if skip:
            self.skipped_steps.append(step)
        return skip

    def _local_value(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        if self.metric == "grad_norm":
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
        history = module_history(pl_module)
        if not history or int(history[-1]["step"]) != trainer.global_step:
            raise RuntimeError(
                f"SkipStep(metric='loss') found no record of step {trainer.global_step} in "
                f"{type(pl_module).__name__}.history"
            )
        return float(history[-1]["loss"])

    def global_value(self, trainer: pl.Trainer, local: float) -> float:
        """This step's value over all ranks: the mean of the ranks' losses (equal shards),
        computed in rank order from one gathered tensor, so every rank gets the same float.
        The gradient norm is identical on every rank already (DDP averaged the gradients)."""
        if trainer.world_size == 1 or self.metric == "grad_norm":
            return local
        # On the strategy's device: NCCL gathers only tensors on the GPU.
        device = trainer.strategy.root_device
        gathered = trainer.strategy.all_gather(
            torch.tensor([local], dtype=torch.float64, device=device)
        )
        ranks: list[float] = gathered.reshape(trainer.world_size).tolist()
        return sum(ranks) / len(ranks)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = trainer.global_step
        if step in getattr(pl_module, "nonfinite_steps", ()):
            return  # its update is dropped already, and it has no gradient norm to judge
        history = getattr(pl_module, "history", None)
        if all(p.grad is None for p in pl_module.parameters()):
            # Another SkipStep before this one dropped the update (on every rank alike)
            # and recorded the real norm: this one still judges the step (its window
            # takes every finite value), but from that record, not from no gradients (0).
            if self.metric == "loss":
                self.decide(step, self.global_value(trainer, self._local_value(trainer, pl_module)))
            elif history and int(history[-1]["step"]) == step and "grad_norm" in history[-1]:
                self.decide(step, float(history[-1]["grad_norm"]))
            return
        value = self.global_value(trainer, self._local_value(trainer, pl_module))
        if not self.decide(step, value):
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
        for parameter in pl_module.parameters():
            parameter.grad = None
        if history and int(history[-1]["step"]) == step:
            # Now: the module, whose hook runs after the callbacks', finds no gradient and
            # records nothing, and a SpikeDetector listed before this reads it at batch end.
            history[-1]["skipped"] = 1.0
            history[-1]["grad_norm"] = norm
        for logger in trainer.loggers:  # straight to the loggers, at this step only
            logger.log_metrics({"skip_step/skipped": 1.0}, step=step)

    @override
    def state_dict(self) -> dict[str, Any]:
        # The configuration rides along so a checkpoint says how to rebuild the callback.
        return {
            "values": list(self.values),
            "skipped_steps": list(self.skipped_steps),
            "metric": self.metric,
            "window": self.window,
            "sigma": self.sigma,
            "warmup": self.warmup,
            "start_step": self.start_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = deque((float(v) for v in state_dict["values"]), maxlen=self.window)
        self.skipped_steps = [int(s) for s in state_dict["skipped_steps"]]
