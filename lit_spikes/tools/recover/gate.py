"""The callback that turns a branch's detector flags into the loop's decisions: stop at
a spike, or accept the branch once it has trained past the spike's step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks import SkipStep, Spike, SpikeDetector
from lit_spikes.callbacks.common import trainer_callbacks
from lit_spikes.callbacks.watch import read_back
from lit_spikes.loader import positioned
from lit_spikes.tools.recover.history import StepClock


class SpikeGate(Callback):
    """Reads the detector's new spikes each step, after it. With ``mode="stop"`` a spike
    stops the Trainer at that step, unless ``SkipStep`` dropped that step's update (the
    spike never reached the weights); with ``mode="log"`` training goes on. Calls
    ``on_accept(step)`` once the branch has trained step ``accept_after`` without a spike.

    A branch resumed from its own checkpoint may find a spike of its own (at or after
    ``start_step``) among the detector's restored ones: it was stopped there but ended
    before the ledger heard of it (a signal in the spike's step, a kill after the
    checkpoint). It stops at once, spiked there, as the uninterrupted branch did."""

    def __init__(
        self,
        detector: SpikeDetector,
        mode: Literal["stop", "log"],
        accept_after: int | None,
        on_accept: Callable[[int], None],
        clock: StepClock,
        start_step: int = 0,
    ) -> None:
        self.detector, self.mode, self.clock = detector, mode, clock
        self.accept_after, self.on_accept = accept_after, on_accept
        self.start_step = start_step
        self.stop_spike: Spike | None = None
        self.accepted = accept_after is None
        self._seen = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored = list(self.detector.spikes)
        self._seen = self.detector.num_spikes  # from now on, only the spikes of the steps to come
        if self.mode != "stop":
            return
        dropped = set(skip_stepped(trainer_callbacks(trainer)))
        own = [s for s in restored if s.step >= self.start_step and s.step not in dropped]
        if own:
            self.stop_spike = own[0].replace(position=position_of(trainer, own[0].step))
            trainer.should_stop = True  # Lightning then trains no step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        step = self.clock.step
        read_back(trainer)  # the watchers' decisions of this step, from the device
        count = self.detector.num_spikes - self._seen
        new = list(self.detector.spikes)[len(self.detector.spikes) - count :] if count else []
        self._seen = self.detector.num_spikes
        dropped = set(skip_stepped(trainer_callbacks(trainer))) if new else set()
        for spike in new:
            if self.mode == "stop" and spike.step not in dropped:
                self.stop_spike = self.stop_spike or spike.replace(
                    position=position_of(trainer, step)
                )
                trainer.should_stop = True
        if not self.accepted and self.stop_spike is None:
            assert self.accept_after is not None
            if step >= self.accept_after:
                self.accepted = True
                self.on_accept(step)


def skip_stepped(callbacks: Sequence[Callback]) -> list[int]:
    """Steps whose update a ``SkipStep`` among ``callbacks`` dropped (its restored state
    included)."""
    return sorted({s for cb in callbacks if isinstance(cb, SkipStep) for s in cb.skipped_steps})


def position_of(trainer: pl.Trainer, step: int) -> int:
    """The data position of global step ``step`` (the step itself for data that is not
    positioned: nothing is skipped there)."""
    data = positioned(trainer)
    return step if data is None else int(data.position_of_step(step))
