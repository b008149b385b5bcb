"""One judgement of whether a spike is still there, shared by ``diagnose`` (does a replay
bring it back?), ``recover`` (did a remedy's branch remove it?) and ``study`` (through
diagnose): how high the curve rises over its own recent median, as a share of how high
the original spike rose. A detector's flag is a threshold crossed; a spike that only just
crossed it and a replay that rose to four fifths of it but not over it are the same
spike, and this measure says so (docs/recover-and-diagnose.md, "One judgement").

    rise(t)  = ln(value(t) / median(t))   (a positive curve, as a loss is; else
               value(t) - median(t)), median(t): of the ``window`` finite values before t
    height   = the largest rise(t) over the judged steps
    ratio    = height of the replay or branch / the original spike's rise at its step
    still spikes  <=>  ratio >= bar   (default ``RECURRENCE`` = 0.5)

A rise is a factor over the median ("5x its median"), so that a spike's size in one
replay and another compares whatever the loss's scale: a state-caused spike that reached
100x its median in the run and 20x with other data (the data set only where an Adam
update sent the weights) is the same spike again (ratio 0.65), not a fifth of it.

The detector's threshold stays the floor against noise: a step it does not flag in the
original run is no spike to judge (diagnose's ``no-spike``), and a branch it flags
anew is stopped there whatever its ratio.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

RECURRENCE = 0.5
"""The default bar: a replay or branch rising at least half the original spike's height
over its median still has the spike (``DiagnoseConfig.recurrence``,
``RecoverConfig.recurrence``)."""


def check_bar(value: float, owner: str) -> float:
    """``value`` as a bar of ``owner`` (``DiagnoseConfig.recurrence``).

    Raises:
        ValueError: a bar outside (0, 1], naming ``owner`` and the value.
    """
    if not (isinstance(value, int | float) and math.isfinite(value) and 0 < value <= 1):
        raise ValueError(
            f"{owner}={value!r} must be in (0, 1]: the share of the original spike's rise "
            f"at which it counts as still there (default {RECURRENCE})"
        )
    return float(value)


@dataclass(frozen=True)
class Rise:
    """The highest point of a curve over the judged steps, against its median there."""

    step: int
    value: float
    """The curve's value at ``step`` (NaN or inf: a non-finite step)."""
    median: float
    """The median of the ``window`` finite values before ``step``."""

    @property
    def height(self) -> float:
        """How far the value rose over its median: for a positive curve (a loss),
        ``ln(value / median)``, so that "5x its median" is one height whatever the loss's
        scale, and a spike to 100x is not dwarfed by one to 5000x; else ``value -
        median``. inf for a non-finite value."""
        if not math.isfinite(self.value):
            return math.inf
        if self.median > 0:
            return math.log(self.value / self.median) if self.value > 0 else -math.inf
        return self.value - self.median

    def describe(self) -> str:
        """``0.0161 at step 172 (2.66x its median 0.00606)``."""
        if not math.isfinite(self.value):
            return f"{self.value} at step {self.step}"
        if self.median > 0:
            times = self.value / self.median
            return (
                f"{self.value:.4g} at step {self.step} ({times:.3g}x its median {self.median:.4g})"
            )
        return (
            f"{self.value:.4g} at step {self.step} ({self.value - self.median:+.4g} over its "
            f"median {self.median:.4g})"
        )

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Rise:
        return cls(int(record["step"]), float(record["value"]), float(record["median"]))


def rise_in(
    curve: Mapping[int, float],
    first: int,
    last: int,
    window: int,
    prior: Sequence[float] = (),
) -> Rise | None:
    """The highest rise of ``curve`` (value by step) over steps ``first`` to ``last``:
    each step's value over the median of the ``window`` finite values before it, from
    ``prior`` (values before the curve's first step, oldest first) and the curve. None
    where no step there has a value before it to measure from."""
    history = [float(v) for v in prior if math.isfinite(v)]
    best: Rise | None = None
    for step in sorted(curve):
        value = float(curve[step])
        if first <= step <= last and history:
            here = Rise(step, value, statistics.median(history[-window:]))
            if best is None or _higher(here, best):
                best = here
        if math.isfinite(value):
            history.append(value)
    return best


def _higher(a: Rise, b: Rise) -> bool:
    return not math.isnan(a.height) and (math.isnan(b.height) or a.height > b.height)


def rise_ratio(rise: Rise, spike: Rise) -> float:
    """``rise``'s height as a share of ``spike``'s: a non-finite spike is back only as a
    non-finite value (1.0, else 0.0); a spike that did not rise is back at any rise."""
    if math.isinf(spike.height):
        return 1.0 if math.isinf(rise.height) else 0.0
    if math.isinf(rise.height):
        return math.inf
    if spike.height <= 0:
        return math.inf if rise.height > 0 else 0.0
    return max(0.0, rise.height / spike.height)


@dataclass(frozen=True)
class Judgement:
    """Whether a replay or branch still has a spike: its rise against the spike's."""

    metric: str
    """The curve judged (the loss, or the name the detector flagged the spike by)."""
    rise: Rise
    spike: Rise
    """The original spike's rise, measured the same way."""
    bar: float

    @property
    def ratio(self) -> float:
        return rise_ratio(self.rise, self.spike)

    @property
    def still_spikes(self) -> bool:
        return self.ratio >= self.bar

    def describe(self) -> str:
        """``rises 0.77 of the spike's height (loss 0.0161 at step 172, ...): the spike is
        still there (bar 0.5)``."""
        ratio = "inf" if math.isinf(self.ratio) else f"{self.ratio:.2f}"
        verdict = "the spike is still there" if self.still_spikes else "the spike is gone"
        return (
            f"rises {ratio} of the spike's height ({self.metric} {self.rise.describe()}; "
            f"the spike {self.spike.describe()}): {verdict} (bar {self.bar:g})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "still_spikes": self.still_spikes}

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Judgement:
        rise, spike = Rise.of(record["rise"]), Rise.of(record["spike"])
        return cls(str(record["metric"]), rise, spike, float(record["bar"]))
