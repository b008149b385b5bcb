"""The verdict as a pure function of the replays' numbers: which steps each replay
flagged, and whether its loss at the spike is the original's to the bit. No file, no
Trainer: the rules of the diagnosis, testable with plain numbers."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lit_spikes.tool_facts import Column
from lit_spikes.tools.judgement import RECURRENCE, Judgement, Rise

Cause = Literal["data-caused", "state-caused", "not-reproducible", "no-spike"]


@dataclass
class Replay:
    """One replay from a checkpoint, judged around the spike."""

    label: str
    ckpt_step: int
    skipped: tuple[int, int] | None
    """Half-open range of data positions left out (None: the same data)."""
    loss_at_spike: float
    max_loss: float
    """Largest loss from ``window_before`` steps before the spike to the replay's end."""
    extra: dict[str, float | None]
    """By key of the module's ``ToolFacts.columns``, its largest value over the same steps
    (None: the replay records none; the demo's ``max_logit``, its largest attention logit)."""
    flagged: list[int]
    """Steps the detector flags in that range."""
    bit_equal: bool | None
    """The loss at the spike's step equals the original's to the last bit (None: no
    original to compare with)."""
    last_step: int
    wall_s: float = 0.0
    detector_from_checkpoint: bool = False
    """The judging detector continued the run's own (its state was in the checkpoint);
    otherwise a fresh one with the configured settings and a shortened warm-up."""
    spike_excess: dict[str, float] = field(default_factory=dict)
    """By monitored name flagged at the spike's step, that step's rise."""
    rises: dict[str, Rise] = field(default_factory=dict)
    """By monitored name, its highest rise over its median from ``window_before`` steps
    before the spike on (``judgement.rise_in``): what the judgement compares."""
    spike_rises: dict[str, Rise] = field(default_factory=dict)
    """By monitored name, its rise at the spike's step: the spike's own height, which a
    same-data replay reproduces and the other-data replays are held against."""
    judgement: Judgement | None = None
    """An other-data replay's rise against the same-data one's (``judged``)."""

    @property
    def spiked(self) -> bool:
        return bool(self.flagged)

    @property
    def ratio(self) -> float:
        """Its rise as a share of the spike's (``judgement``); a replay of plain numbers,
        without rises: 1.0 where it flagged a step, else 0.0."""
        if self.judgement is not None:
            return self.judgement.ratio
        return 1.0 if self.spiked else 0.0


def judged(same: Replay, other: Replay, bar: float = RECURRENCE) -> Judgement | None:
    """``other``'s highest rise against ``same``'s at the spike's step (the spike's own
    height), in the names the detector flagged at the spike (else every name measured):
    the one that comes back the most. None where neither measured a rise (plain numbers)."""
    names = [m for m in same.spike_excess if m in same.spike_rises and m in other.rises]
    names = names or [m for m in same.spike_rises if m in other.rises]
    found = [Judgement(m, other.rises[m], same.spike_rises[m], bar) for m in names]
    return max(found, key=lambda j: j.ratio, default=None)


def deciding_ratio(others: Sequence[Replay]) -> float:
    """The median of the other-data replays' ratios: the majority of three decides."""
    return statistics.median(o.ratio for o in others)


@dataclass
class Verdict:
    """The diagnosis: the cause and the replays it rests on."""

    cause: Cause
    spike_step: int
    ckpt_step: int
    ckpt_path: str
    original_loss: float | None
    """The loss the original run logged at the spike (None: unknown)."""
    same_data: Replay
    other_data: list[Replay]
    """The other-data replays, each skipping another window (empty when the spike did not
    come back with the same data: no point asking)."""
    earlier: Replay | None
    evidence: list[str]
    columns: tuple[Column, ...] = ()
    """The module's extra columns (``ToolFacts.columns``): the replays' ``extra``."""

    def to_dict(self) -> dict[str, Any]:
        """The verdict as plain data (``--json``), each judgement with its ratio."""
        data = asdict(self)
        for replay, record in zip(self.other_data, data["other_data"], strict=True):
            if replay.judgement is not None:
                record["judgement"] = replay.judgement.to_dict()
        return data


def cause_from_same_data(spike_step: int, same: Replay) -> Cause | None:
    """What replay (a) alone decides: ``no-spike`` (the loss comes back, or cannot be
    told apart, but the step is not flagged), ``not-reproducible`` (another loss), or
    None: the spike is back, replay (b) decides."""
    if same.bit_equal is not False and spike_step not in same.flagged:
        return "no-spike"
    # Flagged but not the original loss (a fault that only made the spike larger, or a
    # setting unlike the run's) is not the run's spike.
    if same.bit_equal is False:
        return "not-reproducible"
    return None


def verdict_cause(
    spike_step: int,
    same: Replay,
    others: Sequence[Replay],
    earlier: Replay | None = None,
    recurrence: float = RECURRENCE,
) -> Cause:
    """The cause the replays show: (a) decides alone where it can; else an earlier
    checkpoint's replay (c) that does not bring the spike back to the bit says the later
    state is not the run's own history's; else the other-data replays (b) do: rising
    without the data around the spike to at least ``recurrence`` of its height (the
    median of their ratios, ``deciding_ratio``) says the state causes it, a smaller rise
    says the data does.

    Raises:
        ValueError: (a) leaves the question open and there is no replay (b).
    """
    decided = cause_from_same_data(spike_step, same)
    if decided is not None:
        return decided
    if not others:
        raise ValueError(f"the spike at step {spike_step} came back: replay (b) must decide")
    if earlier is not None and earlier.bit_equal is False:
        return "not-reproducible"
    return "state-caused" if deciding_ratio(others) >= recurrence else "data-caused"


def given_decimals(value: float) -> int | None:
    """The decimals of ``value`` as typed, when it is a rounded one (``2.7175``: 4; None:
    the shortest form of a float32 logged loss, which has 7 or more significant digits)."""
    text = repr(value)
    if "e" in text or "." not in text or len(text.replace("-", "").replace(".", "")) >= 7:
        return None
    return len(text.split(".")[1])


def bit_equal(loss: float, original: float | None) -> bool | None:
    """Whether a replay's loss is the original's to the bit: None when there is no
    original, or when the original was given rounded (``--spike_loss 2.7175``, as this
    tool prints it) and the loss rounds to it: equality cannot be told. Two NaNs are
    equal (a replayed NaN is the run's NaN)."""
    if original is None:
        return None
    if loss == original or (math.isnan(loss) and math.isnan(original)):
        return True
    decimals = given_decimals(original)
    if decimals is not None and round(loss, decimals) == original:
        return None
    return False
