"""The callback that turns a branch's detector flags into the loop's decisions: stop at
a spike, or accept the branch once it has trained past the spike's step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks import SkipStep, Spike, SpikeDetector
from lit_spikes.callbacks.common import trainer_callbacks
from lit_spikes.callbacks.watch import read_back
from lit_spikes.loader import positioned
from lit_spikes.tools.judgement import Judgement, Rise, rise_in
from lit_spikes.tools.recover.history import HistoryLog, StepClock


@dataclass
class RiseCheck:
    """What a remedy branch's rise is held against as it reaches ``accept_after``: the
    spike's rise (``Intervention.spike_rise``) and the lineage's curve of that name."""

    metric: str
    spike: Rise
    bar: float
    window: int
    """The detector's window: each step's rise is over the median of those before it."""
    first: int
    """The branch's start: its rise is judged from there."""
    curve: dict[int, float] = field(default_factory=dict)
    """The lineage's values by step (the parent's before ``first``), growing each step."""

    def add(self, record: dict[str, Any] | None) -> None:
        """The step's value, unless ``SkipStep`` dropped its update (``skipped``): that
        loss never reached the weights, as the gate passes over that step's flag."""
        if record is not None and self.metric in record and not record.get("skipped"):
            self.curve[int(record["step"])] = float(record[self.metric])

    def judge(self, last: int) -> Judgement | None:
        """The branch's highest rise from ``first`` through ``last`` against the spike's
        (None: no step of the branch to measure)."""
        rise = rise_in(self.curve, self.first, last, self.window)
        return None if rise is None else Judgement(self.metric, rise, self.spike, self.bar)


class SpikeGate(Callback):
    """Reads the detector's new spikes each step, after it. With ``mode="stop"`` a spike
    stops the Trainer at that step, unless ``SkipStep`` dropped that step's update (the
    spike never reached the weights); with ``mode="log"`` training goes on. Calls
    ``on_accept(step)`` once the branch has trained step ``accept_after`` without a spike.

    A branch resumed from its own checkpoint may find a spike of its own (at or after
    ``start_step``) among the detector's restored ones: it was stopped there but ended
    before the ledger heard of it (a signal in the spike's step, a kill after the
    checkpoint). It stops at once, spiked there, as the uninterrupted branch did.

    With a ``check`` (a remedy branch), reaching ``accept_after`` without a flag is not
    enough: the branch's rise since its start (the step records of ``history``, listed
    before the gate) must be under the bar of the spike's rise (``judgement``), else the
    spike is still there, under the threshold, and the gate stops the branch at its
    highest step as at a spike."""

    def __init__(
        self,
        detector: SpikeDetector,
        mode: Literal["stop", "log"],
        accept_after: int | None,
        on_accept: Callable[[int], None],
        clock: StepClock,
        start_step: int = 0,
        check: RiseCheck | None = None,
        history: HistoryLog | None = None,
    ) -> None:
        self.detector, self.mode, self.clock = detector, mode, clock
        self.accept_after, self.on_accept = accept_after, on_accept
        self.start_step = start_step
        self.check, self.history = check, history
        self.judgement: Judgement | None = None
        """The branch's rise against the spike's, once it reached ``accept_after``."""
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
        if self.check is not None and self.history is not None:
            self.check.add(self.history.last)
        if not self.accepted and self.stop_spike is None:
            assert self.accept_after is not None
            if step >= self.accept_after:
                self._judge(trainer, step)

    def _judge(self, trainer: pl.Trainer, step: int) -> None:
        """Accept the branch at ``step``, unless its rise says the spike is still there:
        then stop it at its highest step, as at a spike."""
        self.judgement = self.check.judge(step) if self.check is not None else None
        if self.judgement is None or not self.judgement.still_spikes:
            self.accepted = True
            self.on_accept(step)
            return
        rise = self.judgement.rise
        self.stop_spike = Spike(
            rise.step, self.judgement.metric, rise.value, rise.median,
            position=position_of(trainer, rise.step),
        )  # fmt: skip
        trainer.should_stop = True


def skip_stepped(callbacks: Sequence[Callback]) -> list[int]:
    """Steps whose update a ``SkipStep`` among ``callbacks`` dropped (its restored state
    included)."""
    return sorted({s for cb in callbacks if isinstance(cb, SkipStep) for s in cb.skipped_steps})


def position_of(trainer: pl.Trainer, step: int) -> int:
    """The data position of global step ``step`` (the step itself for data that is not
    positioned: nothing is skipped there)."""
    data = positioned(trainer)
    return step if data is None else int(data.position_of_step(step))
