"""OLMo-core's skip-step: drop the optimizer update of a step whose loss is an outlier."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lit_spikes.callbacks.common import check_finite_above, check_integer, make_state_key
from lit_spikes.callbacks.watch import (
    GRAD_NORM,
    LOSS,
    Watcher,
    monitor_names,
    not_logged,
    note_grad_norm,
    step_values,
)
from lit_spikes.callbacks.watch import _read as read_now
from lit_spikes.checkpoints import record_nonfinite


class SkipStep(Watcher):
    r"""Skips the optimizer update of a step whose loss (or gradient norm) is above
    ``mean + sigma x std`` of the last ``window`` finite values (OLMo-core's
    ``SkipStepOptimizer``: 6 sigma over 128 steps).

    The decision is taken on the device in ``on_before_optimizer_step``, after backward
    and before any clipping, and no value is read back to the host for it: the optimizer
    step runs, and a step post-hook puts back every parameter and every optimizer state
    tensor (AdamW's moments and step count) as a snapshot held them before it
    (``torch.where`` on the decision): a skipped step leaves them exactly as they were, no
    weight decay, no moment update, no step count. The global step and the LR schedule go
    on, as for any step. A NaN or inf can come at any step, so the snapshot is taken at
    every step: it holds a copy of the parameters and the optimizer state during each
    step. (An optimizer whose step counts live on the CPU while its parameters are on a
    GPU, as AdamW's default, copies the decision to the CPU for them: pass AdamW
    ``capturable=True`` or ``fused=True``.)

    Under several processes the value judged is the global one, the same on every rank:
    the ranks' values are gathered on the device (one ``all_gather`` a step for every
    watching callback) and averaged in rank order; the gradient norm is measured after
    DDP averaged the gradients, so it is identical already. Every rank thus holds the same
    window and skips the same steps.

    A step is an optimizer step: under ``accumulate_grad_batches=k`` its loss is the mean
    of its micro-batches' losses (what its backward passes were given), judged once before
    its update; a logged key is judged only at a step that logged it. A NaN or inf value
    is always skipped, in the warm-up and before ``start_step`` too (it never enters the
    window). Every finite value enters the window, skipped ones too (as in OLMo-core), so
    a loss that settles on a higher level stops being skipped; a window of equal values
    (no spread) skips no finite value. Optimizer state that is not a tensor (a Python step
    count) cannot be put back on the device and moves on a skipped step; state the skipped
    step created (an optimizer's first step) is removed, as it was (this needs the
    decision on the host: one read, at the step that creates it). Several optimizers
    under manual optimization are refused: the first one's update is made before the
    others' loss is known. The window and the skipped steps (the last ``max_records``)
    are the callback's state (``state_dict``), bounded however long the run: a run
    resumed from a checkpoint decides exactly as the uninterrupted one.
    The decisions come back to the host every 50 steps, at a checkpoint and at the fit's
    end (for the record only: they never wait for the host): then ``skipped_steps`` lists
    them and ``skip_step/skipped`` is logged at each skipped step.

    Args:
        monitor: ``"loss"`` (what ``training_step`` returns), ``"grad_norm"`` (measured
            before clipping), or a key of ``trainer.callback_metrics`` logged in
            ``training_step``.
        window: values in the rolling window.
        sigma: skip a step whose value exceeds the window's mean + ``sigma`` x std.
        warmup: values in the window before any step can be skipped (None: ``window // 2``,
            at least 2).
        start_step: first global step that may be skipped (values are collected before).
        initial: values to start the window with, e.g. the losses of the run this one
            branches from; a checkpoint's state replaces them.
        max_records: skipped steps kept in the state (the latest).
        strict: a ``callback_metrics`` name the module did not log in a training step is
            an error (as ``SpikeDetector(strict=True)``); False: that step is not judged.
            A key logged only in validation is thus refused (or never judged): a skip is
            decided before each update, from that step's own values.

    Raises:
        ValueError: an argument out of range, or a non-finite initial value.
        RuntimeError: at the fit's start, several optimizers under manual optimization; with
            ``strict``, a monitored key not logged in a training step, naming it and the
            step.

    Example:
        >>> skip = SkipStep(monitor="loss", window=128, sigma=6.0)
        >>> trainer = pl.Trainer(callbacks=[skip])
        >>> trainer.fit(module, datamodule=dm)
        >>> skip.skipped_steps  # deque([150])
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
        strict: bool = True,
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
        self.strict = strict
        self.values: deque[float] = deque(values[-window:], maxlen=window)
        self.skipped_steps: deque[int] = deque(maxlen=self.max_records)
        self.nonfinite_steps: deque[int] = deque(maxlen=self.max_records)
        """The skipped steps whose value was NaN or inf (the last ``max_records``): each
        checkpoint records them (``lit_spikes.checkpoints.NONFINITE_KEY``), and rollback
        passes over the files written after one."""
        self._window: torch.Tensor | None = None
        self._seen = len(self.values)
        """Values judged (initial ones too)."""
        self._hooks: list[RemovableHandle] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
        self._fresh: list[torch.Tensor] = []
        """Parameters without optimizer state before the step."""
        self._skip: torch.Tensor | None = None

    @property
    @override
    def state_key(self) -> str:
        return make_state_key(
            self,
            monitor=self.monitor,
            window=self.window,
            sigma=self.sigma,
            warmup=self.warmup,
            start_step=self.start_step,
        )

    def _window_on(self, device: torch.device) -> torch.Tensor:
        """The window on ``device``, oldest first, NaN in the slots not filled yet."""
        if self._window is None or self._window.device != device:
            values = [math.nan] * (self.window - len(self.values)) + list(self.values)
            self._window = torch.tensor(values, dtype=torch.float64, device=device)
        return self._window

    def _judge(self, step: int, value: torch.Tensor) -> torch.Tensor:
        """Decide one step on the value's device (a 0-dim bool), then add the value to the
        window if it is finite; nothing is read back."""
        window = self._window_on(value.device)
        filled = torch.isfinite(window)
        count = filled.sum()
        mean = torch.where(filled, window, 0.0).sum() / count
        spread = torch.where(filled, (window - mean) ** 2, 0.0).sum() / (count - 1)
        finite = torch.isfinite(value)
        # No spread, no scale to call a value an outlier by (a constant loss).
        over = finite & (count >= self.warmup) & (spread > 0)
        over = over & (value > mean + self.sigma * spread.sqrt())
        if step < self.start_step:
            over = torch.zeros_like(over)
        skip = ~finite | over  # a NaN or inf never reaches the weights
        self._window = torch.where(finite, torch.cat([window[1:], value[None]]), window)
        self._pending.append((step, torch.stack([value, skip.double()])))
        self._seen += 1
        return skip

    @override
    def take_rows(self, trainer: pl.Trainer | None, rows: list[tuple[int, list[float]]]) -> None:
        # ``values`` and ``skipped_steps`` follow the device's decisions; each skipped step
        # is logged at its step.
        for step, (value, skipped) in rows:
            if math.isfinite(value):
                self.values.append(value)
            if skipped:
                self.skipped_steps.append(step)
                if not math.isfinite(value):
                    self.nonfinite_steps.append(step)
                for logger in trainer.loggers if trainer is not None else []:
                    logger.log_metrics({"skip_step/skipped": 1.0}, step=step)

    def threshold(self) -> float | None:
        """The value above which the next step is skipped (None: too few values; inf: a
        window without spread, where only a NaN or inf is skipped), from
        the decisions read back (for inspection: training decides on the device)."""
        self._read_own()
        if len(self.values) < self.warmup:
            return None
        spread = statistics.stdev(self.values)
        return statistics.fmean(self.values) + self.sigma * spread if spread > 0 else math.inf

    def decide(self, step: int, value: float) -> bool:
        """Judge one step's (global) value, then add it to the window; True: skip it (a
        host read: outside of training)."""
        skip = self._judge(step, torch.tensor(float(value), dtype=torch.float64))
        read_now([self], self._trainer)
        return bool(skip)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here, not in setup: the optimizers are configured after the callbacks' setup.
        if not pl_module.automatic_optimization and len(trainer.optimizers) > 1:
            raise RuntimeError(
                f"SkipStep: the module uses manual optimization with {len(trainer.optimizers)}"
                " optimizers. SkipStep judges each update before it is made, and the first "
                "optimizer steps before the others' loss is known, so it cannot drop every "
                "update of an outlier batch. Use one optimizer, or SpikeDetector to record "
                "spikes without SkipStep"
            )
        self._remove_hooks()
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(self._snapshot))
            self._hooks.append(optimizer.register_step_post_hook(self._restore))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = trainer.global_step
        note_grad_norm(trainer, pl_module)  # for every watcher, once a step
        values = step_values(trainer, step, self.monitors)
        if not values.here[0]:
            if self.strict and self.monitor not in (LOSS, GRAD_NORM):
                raise RuntimeError(not_logged("SkipStep", [self.monitor], trainer, step))
            return  # nothing to judge by (no loss: the module skipped the batch)
        self._skip = self._judge(step, values.reduced("mean")[0])

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._skip, self._saved, self._fresh = None, [], []  # a step the scaler skipped ran no hook
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def _snapshot(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        # Before the step (and before the closure computes this step's gradients).
        # Under a GradScaler the closure (and so the decision) ran before this hook.
        self._saved, self._fresh = [], []
        if self._trainer is None:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                kept = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
                self._saved.append((param, param.detach().clone(), kept))
                if not state:
                    self._fresh.append(param)

    def _restore(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        skip, saved, fresh = self._skip, self._saved, self._fresh
        self._saved, self._skip, self._fresh = [], None, []
        if skip is None or not saved:
            return
        with torch.no_grad():
            for param, before, state in saved:
                param.copy_(torch.where(skip.to(param.device), before, param))
                for key, now in optimizer.state.get(param, {}).items():
                    if not isinstance(now, torch.Tensor):
                        continue  # not restorable on the device (see the docstring)
                    old = state[key] if key in state else torch.zeros_like(now)
                    now.copy_(torch.where(skip.to(now.device), old, now))
        created = [p for p in fresh if optimizer.state.get(p)]
        if created and bool(skip):  # the one host read: only at a step that created state
            for param in created:
                del optimizer.state[param]  # as before the step: no state at all

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._saved, self._skip, self._fresh = [], [], None, []

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()
        super().teardown(trainer, pl_module, stage)

    @property
    def nonfinite_steps_read(self) -> list[int]:
        """``nonfinite_steps`` as read back so far (complete up to the newest checkpoint:
        a save reads back first), without a host read: what ``CheckpointRetention`` needs."""
        return list(self.nonfinite_steps)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._read_own()
        record_nonfinite(checkpoint, self.nonfinite_steps)

    @override
    def state_dict(self) -> dict[str, Any]:
        self._read_own()  # a checkpoint holds every decision so far
        # The configuration rides along so a checkpoint says how to rebuild the callback.
        return {
            "values": list(self.values),
            "skipped_steps": list(self.skipped_steps),
            "nonfinite_steps": list(self.nonfinite_steps),
            "seen": self._seen,
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
        self.nonfinite_steps = deque(
            (int(s) for s in state_dict.get("nonfinite_steps", ())), maxlen=self.max_records
        )
        self._seen = int(state_dict.get("seen", len(self.values)))
        self._window, self._pending = None, []
