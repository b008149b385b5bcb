"""The LR-sensitivity sweep of a study (Wortsman et al., 2023, "Small-scale proxies for
large-scale Transformer training instabilities"): runs from scratch at peak LRs over two
decades, with and without a variant of the module, and the paper's LR sensitivity of
each (docs/study.md gives its definition)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_spikes.tools.recover.measure import PREFERRED

LAST = 10
"""Without validation, a run's final loss is the mean training loss of its last this many
steps (and its initial loss its first step's)."""


@dataclass(frozen=True)
class SweepConfig:
    """Runs from scratch at each peak LR, with and without a variant, a few seeds a
    point."""

    lr_arg: str | None = None
    """Where a run's peak LR goes: ``model.<name>`` of its init arguments (dotted into a
    nested one: ``model.optim.peak_lr``). None: no sweep."""
    factors: list[float] = field(default_factory=lambda: [0.1, 0.3, 1.0, 3.0, 10.0])
    """The peak LRs, as multiples of the module's own (``lr_arg``'s value): two decades
    in five points by default."""
    peak_lrs: list[float] | None = None
    """The peak LRs themselves, in place of ``factors``."""
    model_args: dict[str, Any] = field(default_factory=dict)
    """Init arguments every sweep run changes (a shorter warm-up for shorter runs)."""
    variant: dict[str, Any] | str | None = None
    """Each LR again with this change: init arguments merged over the module's
    (``{"qk_norm": true}``), or the name of one of its ``ToolFacts.variants``. None: none."""
    seeds: int = 1
    """Seeds a point: the study's first ones."""
    steps: int | None = None
    """Length of each sweep run (None: the study's)."""

    def __post_init__(self) -> None:
        if self.lr_arg is not None and not str(self.lr_arg).startswith("model."):
            raise ValueError(
                f"sweep.lr_arg={self.lr_arg!r} must name an init argument of the model: "
                "model.<name> (model.lr, model.optim.peak_lr)"
            )
        factors = list(self.factors)
        if len(factors) < 2 or len(set(factors)) != len(factors) or min(factors) <= 0:
            raise ValueError(f"sweep.factors={factors} must be two or more distinct factors > 0")
        object.__setattr__(self, "factors", sorted(factors))
        if self.peak_lrs is not None:
            lrs = list(self.peak_lrs)
            if len(lrs) < 2 or len(set(lrs)) != len(lrs) or min(lrs) <= 0:
                raise ValueError(f"sweep.peak_lrs={lrs} must be two or more distinct LRs > 0")
            object.__setattr__(self, "peak_lrs", sorted(lrs))
        if self.seeds < 1:
            raise ValueError(f"sweep.seeds={self.seeds} must be >= 1")
        if self.steps is not None and self.steps < 2:
            raise ValueError(f"sweep.steps={self.steps} must be >= 2 or None")

    @property
    def arms(self) -> tuple[bool, ...]:
        """Without the variant, and with it where there is one."""
        return (False, True) if self.variant is not None else (False,)


def point_name(lr: float, variant: bool, seed: int) -> str:
    return f"sweep/lr{lr:.3g}-{'variant' if variant else 'plain'}-seed{seed:02d}"


def initial_and_final(
    records: Sequence[Mapping[str, Any]], metric: str | None, sign: float
) -> tuple[float, float, str]:
    """A run's loss at initialization and at its end, and what they are: ``metric`` (a
    validation metric, times ``sign``: -1 for one where higher is better) validated
    before the first step and after the last, where the run has both; else the training
    loss of its first step (before any update) and the mean of its last ``LAST`` steps'
    (NaN where one was not finite)."""
    validated = [r for r in records if "val_step" in r and metric in (r.get("val") or {})]
    if metric is not None and len(validated) >= 2 and validated[0]["val_step"] == 0:
        first, last = validated[0]["val"][metric], validated[-1]["val"][metric]
        return sign * float(first), sign * float(last), metric
    steps = [r for r in records if "step" in r]
    return float(steps[0]["loss"]), final_loss(steps), f"train loss (last {LAST} steps)"


def final_loss(steps: Sequence[Mapping[str, Any]]) -> float:
    """The mean training loss of a run's last ``LAST`` steps (``steps``: its step records)."""
    tail = [float(r["loss"]) for r in steps[-LAST:]]
    return sum(tail) / len(tail)


def metric_of(records: Sequence[Mapping[str, Any]], preferred: str | None) -> str | None:
    """The validation metric a sweep run is measured by: ``preferred`` (the module's
    ``ToolFacts.val_metric``), else recover's choice (``val_loss`` or ``val/loss``), else
    the first logged."""
    names = sorted({n for r in records if "val_step" in r for n in (r.get("val") or {})})
    choices = [n for n in (preferred, *PREFERRED) if n in names]
    return (choices or names or [None])[0]


def points(
    results: Sequence[Mapping[str, Any]], preferred: str | None = None, sign: float = 1.0
) -> list[dict[str, Any]]:
    """Each (peak LR, variant) point: the seeds' mean initial and final loss
    (``initial_and_final``), what they measure, and how many of its runs flagged a
    spike."""
    grouped: dict[tuple[float, bool], list[Mapping[str, Any]]] = {}
    for result in results:
        params = result["params"]
        grouped.setdefault((params["peak_lr"], params["variant"]), []).append(result)
    out = []
    for (lr, variant), runs in sorted(grouped.items()):
        losses = [
            initial_and_final(r["records"], metric_of(r["records"], preferred), sign) for r in runs
        ]
        out.append(
            {
                "peak_lr": lr,
                "variant": variant,
                "seeds": len(runs),
                "initial_loss": statistics.fmean(first for first, _, _ in losses),
                "final_loss": statistics.fmean(final for _, final, _ in losses),
                "measure": losses[0][2],
                "spiked": sum(bool(r["onsets"]) for r in runs),
            }
        )
    return out


def lr_sensitivity(arm: Sequence[Mapping[str, Any]]) -> float:
    """Wortsman et al.'s LR sensitivity of one arm's points: the mean over the swept LRs
    of ``min(final loss, initial loss) - best final loss``; a run that diverged (a final
    loss not finite) counts at the initial loss, and where no LR ends below the initial
    loss, the best is the initial loss (a recipe that learns nothing scores 0, not below)."""
    initial = statistics.fmean(p["initial_loss"] for p in arm)
    finals = [p["final_loss"] if math.isfinite(p["final_loss"]) else initial for p in arm]
    best = min([*finals, initial])
    return statistics.fmean(min(final, initial) - best for final in finals)


def summary(found: Sequence[Mapping[str, Any]], variant: str | None) -> list[str]:
    """The sweep's findings in words: each arm's LR sensitivity over the range swept."""
    if not found:
        return []
    lrs = sorted({p["peak_lr"] for p in found})
    decades = math.log10(lrs[-1] / lrs[0])
    lines = []
    for with_variant in sorted({p["variant"] for p in found}):
        arm = [p for p in found if p["variant"] == with_variant]
        name = f"with {variant}" if with_variant else "plain"
        finite = [p for p in arm if math.isfinite(p["final_loss"])] or arm
        best = min(finite, key=lambda p: p["final_loss"])
        lines.append(
            f"LR sensitivity {name}: {lr_sensitivity(arm):.4f} over peak LRs "
            f"{lrs[0]:.3g}-{lrs[-1]:.3g} ({len(arm)} points, {decades:.1f} decades); best "
            f"final loss {best['final_loss']:.4f} at {best['peak_lr']:.3g}"
        )
    return lines
