"""OPT's remedy: from a given step on, scale the scheduled learning rate."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lit_spikes.callbacks.common import check_finite_above, check_integer, make_state_key


class LRScaler(Callback):
    """Multiplies the scheduled LR by ``factor`` from global step ``start_step`` on.

    Applied in ``on_train_batch_start``, after the Trainer stepped the scheduler, and
    undone right after the optimizer's step, before the Trainer steps the scheduler again
    (a step post-hook on each optimizer): the schedule itself is untouched (its state
    stays the uninterrupted one, also for a scheduler that computes the next LR from the
    current one, as cosine annealing or StepLR do), only the LR of each step from
    ``start_step`` on is scaled, and ``lr`` is logged as applied. (A step whose
    optimizer step is skipped, as a GradScaler does on inf gradients in fp16, runs no
    post-hook: a recursive scheduler then takes that one step's scaled LR as its own.) Its
    settings are its state and name it in the checkpoint: a resumed run keeps scaling
    only if it is given the same ``LRScaler`` again. One with other settings is another
    callback (a new remedy from the resume on), and the checkpoint's scaling then ends
    there, as Lightning's warning about a checkpointed callback state that no callback
    takes says.

    Several ``LRScaler`` do not compound: each sets the LR to the scheduled one times its
    own factor, so at a step where more than one is active the last one in the Trainer's
    callback list decides (``recover`` gives its newest scaler the product of the
    lineage's factors, and lists it last).

    Args:
        factor: multiplier of the scheduled LR (OPT lowered it, e.g. 0.5).
        start_step: first global step scaled.
        end_step: first global step no longer scaled (None: to the end).

    Raises:
        ValueError: a factor that is not a finite number > 0, a start that is not an
            integer >= 0, or an end not after the start; at the fit's start, an
            optimizer without an LR scheduler (there is no scheduled LR to scale).

    Example:
        >>> trainer = pl.Trainer(callbacks=[LRScaler(factor=0.5, start_step=100)])
    """

    def __init__(self, factor: float, start_step: int = 0, end_step: int | None = None) -> None:
        super().__init__()
        factor = check_finite_above("factor", factor, 0.0)  # a float: 1 and 1.0 are one key
        start_step = check_integer("start_step", start_step, 0)
        if end_step is not None:
            end_step = check_integer("end_step", end_step, 0)
            if end_step <= start_step:
                raise ValueError(f"end_step={end_step} must be > start_step={start_step}")
        self.factor, self.start_step, self.end_step = factor, start_step, end_step
        self._scaled: list[LRScheduler] = []
        """The schedulers whose optimizer runs this step at the scaled LR."""
        self._hooks: list[RemovableHandle] = []

    @property
    @override
    def state_key(self) -> str:
        return make_state_key(
            self, factor=self.factor, start_step=self.start_step, end_step=self.end_step
        )

    def active(self, step: int) -> bool:
        return step >= self.start_step and (self.end_step is None or step < self.end_step)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scheduled = {id(config.scheduler.optimizer) for config in trainer.lr_scheduler_configs}
        for index, optimizer in enumerate(trainer.optimizers):
            if id(optimizer) not in scheduled:
                raise ValueError(
                    f"LRScaler(factor={self.factor}) scales the LR a scheduler sets, but "
                    f"optimizer {index} ({type(optimizer).__name__}) has none: return an "
                    "lr_scheduler for it from configure_optimizers (a LambdaLR of 1.0 keeps "
                    "a constant LR)"
                )
        self._remove_hooks()
        self._hooks = [
            optimizer.register_step_post_hook(self._unscale) for optimizer in trainer.optimizers
        ]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._scaled = []
        if not self.active(trainer.global_step):
            return
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            for group, scheduled in zip(
                scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True
            ):
                group["lr"] = scheduled * self.factor
            self._scaled.append(scheduler)

    def _unscale(self, optimizer: Optimizer, *args: Any) -> None:
        # Before the Trainer steps the scheduler: one that computes the next LR from the
        # current one (cosine annealing, StepLR) must not take the scaled LR as its own.
        for scheduler in self._scaled:
            if scheduler.optimizer is optimizer:
                for group, scheduled in zip(
                    optimizer.param_groups, scheduler.get_last_lr(), strict=True
                ):
                    group["lr"] = scheduled

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._scaled = [], []

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "start_step": self.start_step, "end_step": self.end_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict["factor"], state_dict["start_step"], state_dict["end_step"])
        if saved != (self.factor, self.start_step, self.end_step):
            raise ValueError(
                f"LRScaler was checkpointed as factor={saved[0]}, start_step={saved[1]}, "
                f"end_step={saved[2]}, but is now configured as factor={self.factor}, "
                f"start_step={self.start_step}, end_step={self.end_step}"
            )
