"""A study's findings as frequencies: for each, in how many seeds (or spikes) it holds,
with a 95% Wilson score interval (which, unlike the normal approximation, stays inside
[0, 1] and is not zero-width at 0 of n or n of n)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Z95 = 1.959963984540054
"""The standard normal's 97.5% quantile."""


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``k`` of ``n`` (``(nan, nan)`` for n 0)."""
    if not 0 <= k <= n:
        raise ValueError(f"wilson: k={k} must be in [0, n={n}]")
    if n == 0:
        return math.nan, math.nan
    p = k / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At 0 of n (n of n) the bound is 0 (1) exactly; the formula leaves a rounding error.
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


@dataclass(frozen=True)
class Finding:
    """One claim and how often the study saw it hold."""

    key: str
    """Short name (the CSV's first column)."""
    text: str
    """The claim, in words."""
    holds: int
    """Seeds (or spikes) in which it holds."""
    n: int
    """Seeds (or spikes) in which it could be judged."""
    unit: str = "seeds"
    """What ``n`` counts."""

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.holds, self.n)

    def sentence(self) -> str:
        lo, hi = self.interval
        return (
            f"{self.text}: {self.holds} of {self.n} {self.unit} (95% Wilson interval "
            f"{lo:.2f}-{hi:.2f})"
        )


SeedCells = Mapping[str, Mapping[str, Any]]
"""One seed's cell results by kind (``reference``, ``resume_exact``, ...)."""


def count(
    seeds: Sequence[SeedCells], needs: Sequence[str], holds: Callable[[SeedCells], bool]
) -> tuple[int, int]:
    """(seeds where ``holds``, seeds judged: those with every cell of ``needs``)."""
    judged = [s for s in seeds if all(kind in s for kind in needs)]
    return sum(bool(holds(s)) for s in judged), len(judged)
