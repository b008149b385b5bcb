"""Which layer went first: each statistic's band from the replayed steps before the window,
the first step each leaves it, and the reading of what left first (docs/forensics.md).

A statistic's band is its median over the band steps plus or minus ``width`` robust
standard deviations (1.4826 x the median absolute deviation), and never narrower than
``floor`` of the median's size: a statistic that barely moves (a weight norm) is not
called out for the drift of training. It *leaves* its band at the first step of the
window where it is outside it (or not finite where it was)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lit_spikes.tools.forensics.instruments import FORWARD, GRAD

Series = Mapping[tuple[str, str], Mapping[int, float]]
"""``(layer, statistic) -> {step: value}``; the run's own under the layer ``RUN``."""

RUN = "(run)"
"""The layer name of the run-wide series: the loss, the LR, the module's columns."""


@dataclass(frozen=True)
class Band:
    center: float
    spread: float

    def distance(self, value: float) -> float:
        """How many spreads ``value`` lies from the center (inf: not finite)."""
        if not math.isfinite(value):
            return math.inf
        return abs(value - self.center) / self.spread


def band_of(values: Sequence[float], floor: float) -> Band | None:
    """The band of ``values`` (None: fewer than 3 finite ones)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 3:
        return None
    center = statistics.median(finite)
    mad = statistics.median(abs(v - center) for v in finite)
    return Band(center, max(1.4826 * mad, floor * abs(center), 1e-12))


@dataclass(frozen=True)
class Exit:
    """A statistic leaving its band."""

    layer: str
    stat: str
    step: int
    value: float
    band: Band

    @property
    def distance(self) -> float:
        return self.band.distance(self.value)


def exits(
    series: Series, band_steps: range, window: range, width: float, floor: float
) -> list[Exit]:
    """Each statistic's first step in ``window`` outside its band over ``band_steps``,
    earliest first (then farthest out)."""
    found = []
    for (layer, stat), values in series.items():
        band = band_of([values[s] for s in band_steps if s in values], floor)
        if band is None:
            continue
        for step in window:
            if step in values and band.distance(values[step]) > width:
                found.append(Exit(layer, stat, step, values[step], band))
                break
    return sorted(found, key=lambda e: (e.step, -e.distance))


@dataclass(frozen=True)
class Reading:
    """What left first, read by the order a step computes in."""

    first_step: int | None
    """The step at which the first statistic left its band (None: none did)."""
    origin: str | None
    """The layer named first (None: none, or every layer at once)."""
    kind: str
    """``forward`` (its weights or outputs: the fault is in the layer or what feeds it),
    ``backward`` (its gradient alone), ``optimizer`` (every layer's update at once: the
    LR or the optimizer, no layer), ``update`` (one layer's update or state), or
    ``none``."""
    together: list[Exit]
    """Every statistic that left at that step."""


def read(found: Sequence[Exit], layers: Sequence[str]) -> Reading:
    """The origin among the exits at the first step. In a step the forward pass runs the
    layers in order, then the backward pass in reverse, then the optimizer: a layer whose
    weights or outputs left while the layers before it did not is where the forward
    fault entered (the first such layer); without one, a gradient that left alone is
    where the backward one entered (the last such layer: backward runs output first);
    the update of every layer at once is the optimizer's (the LR), not a layer's."""
    if not found:
        return Reading(None, None, "none", [])
    first = found[0].step
    together = [e for e in found if e.step == first]
    order = {name: index for index, name in enumerate(layers)}
    forward = [e for e in together if e.stat in FORWARD and e.layer in order]
    if forward:
        origin = min(forward, key=lambda e: order[e.layer]).layer
        return Reading(first, origin, "forward", together)
    backward = [e for e in together if e.stat in GRAD and e.layer in order]
    if backward:
        origin = max(backward, key=lambda e: order[e.layer]).layer
        return Reading(first, origin, "backward", together)
    updated = {e.layer for e in together if e.stat == "update_norm"}
    if len(layers) > 1 and updated >= set(layers):
        return Reading(first, None, "optimizer", together)
    in_layers = [e for e in together if e.layer in order]
    if in_layers:
        return Reading(first, max(in_layers, key=lambda e: e.distance).layer, "update", together)
    return Reading(first, None, "none", together)
