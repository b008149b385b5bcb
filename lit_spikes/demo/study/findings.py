"""The seed's findings as frequencies: for each, in how many seeds it holds, with a 95%
Wilson score interval (which, unlike the normal approximation, stays inside [0, 1] and
is not zero-width at 0 of n or n of n)."""

from __future__ import annotations

import math
from collections import Counter
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
    """Seeds in which it holds."""
    n: int
    """Seeds in which it could be judged."""

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.holds, self.n)

    def sentence(self) -> str:
        lo, hi = self.interval
        return (
            f"{self.text}: {self.holds} of {self.n} seeds (95% Wilson interval {lo:.2f}-{hi:.2f})"
        )


SeedCells = Mapping[str, Mapping[str, Any]]
"""One seed's cell results by kind (``reference``, ``scale_lr``, ...)."""


def _count(
    seeds: Sequence[SeedCells], needs: Sequence[str], holds: Callable[[SeedCells], bool]
) -> tuple[int, int]:
    judged = [s for s in seeds if all(kind in s for kind in needs)]
    return sum(bool(holds(s)) for s in judged), len(judged)


def _below(kind: str) -> Callable[[SeedCells], bool]:
    return lambda s: s[kind]["val_bpc"] < s["reference"]["val_bpc"]


def findings(seeds: Sequence[SeedCells]) -> list[Finding]:
    """Each of the seed's findings over ``seeds`` (each a seed's cells by kind). "Doing
    nothing" is the reference run: from the checkpoint on, the exact resume is it."""
    rules: list[tuple[str, str, Sequence[str], Callable[[SeedCells], bool]]] = [
        (
            "spike",
            "a post-warm-up loss spike is flagged in the reference run",
            ["reference"],
            lambda s: s["reference"]["onset"] is not None,
        ),
        (
            "exact_resume_equal",
            "the exact resume equals the reference (every parameter torch.equal, every loss)",
            ["resume_exact"],
            lambda s: s["resume_exact"]["params_equal"] and s["resume_exact"]["losses_equal"],
        ),
        (
            "fresh_adamw_worse",
            "a fresh AdamW ends above doing nothing (val bits/char)",
            ["reference", "fresh_adamw"],
            lambda s: not _below("fresh_adamw")(s),
        ),
        (
            "other_data_differs",
            "another data seed gives another trajectory (a loss differs)",
            ["other_data_seed"],
            lambda s: not s["other_data_seed"]["losses_equal"],
        ),
        (
            "scale_lr_better",
            "halving the LR ends below doing nothing",
            ["reference", "scale_lr"],
            _below("scale_lr"),
        ),
        (
            "skip_before_better",
            "skipping the data window that ends at the spike ends below doing nothing",
            ["reference", "skip_before"],
            _below("skip_before"),
        ),
        (
            "skip_straddle_better",
            "skipping the data window that straddles the spike ends below doing nothing",
            ["reference", "skip_straddle"],
            _below("skip_straddle"),
        ),
        (
            "clip_no_cure",
            "clipping the gradient norm ends no lower than doing nothing (no cure)",
            ["reference", "clip"],
            lambda s: not _below("clip")(s),
        ),
        (
            "qk_norm_bounds_logit",
            "QK-norm keeps the largest attention logit below the plain run's",
            ["reference", "qk_norm"],
            lambda s: s["qk_norm"]["max_logit"] < s["reference"]["max_logit"],
        ),
    ]
    out = []
    for key, text, needs, holds in rules:
        k, n = _count(seeds, needs, holds)
        out.append(Finding(key, text, k, n))
    causes = Counter(s["diagnose"]["cause"] for s in seeds if "diagnose" in s)
    diagnosed = sum(causes.values())
    for cause in sorted(causes):
        out.append(
            Finding(
                f"diagnose_{cause}",
                f"diagnose calls the seed's first spike {cause} (of the seeds with a spike)",
                causes[cause],
                diagnosed,
            )
        )
    return out
