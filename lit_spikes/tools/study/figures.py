"""The figures of a study of any module: each remedy against doing nothing per seed, the
early-warning signals' precision against chance at each lead, and the LR sweep."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_spikes.tools.study.cells import REFERENCE
from lit_spikes.tools.study.early_warning import LeadCount

OUTCOMES = "study_outcomes.png"
WARNINGS = "study_warnings.png"
SWEEP = "study_sweep.png"


def write_figures(
    report: Any,
    rungs: Sequence[str],
    higher_better: bool,
    variant: str,
    directories: Sequence[Path],
) -> list[Path]:
    """The figures of ``report`` (a ``StudyReport``) into each of ``directories``;
    returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [(_outcomes(plt, report, rungs, higher_better), OUTCOMES)]
    if report.warnings:
        figures.append((_warnings(plt, report.warnings), WARNINGS))
    if report.sweep:
        figures.append((_sweep(plt, report.sweep, variant), SWEEP))
    written = []
    for directory in directories:
        directory.mkdir(parents=True, exist_ok=True)
        for figure, name in figures:
            figure.savefig(directory / name, dpi=110)
            written.append(directory / name)
    for figure, _ in figures:
        plt.close(figure)
    return written


def _outcomes(plt: Any, report: Any, rungs: Sequence[str], higher_better: bool) -> Any:
    """Each rung's measure minus doing nothing's, a point per seed (red: it spiked)."""
    figure, axis = plt.subplots(figsize=(max(5.0, 1.6 * len(rungs) + 2), 4))
    for x, rung in enumerate(rungs):
        deltas, colours = [], []
        for seed, measure in zip(report.seeds, report.measures, strict=True):
            values = measure["values"]
            if values.get(rung) is None or values.get(REFERENCE) is None:
                continue
            deltas.append(values[rung] - values[REFERENCE])
            colours.append("tab:red" if seed[REFERENCE]["onset"] is not None else "tab:blue")
        jitter = [x + 0.25 * ((i % 7) / 6 - 0.5) for i in range(len(deltas))]
        axis.scatter(jitter, deltas, c=colours, s=18, alpha=0.8)
        better = sum((d > 0) if higher_better else (d < 0) for d in deltas)
        axis.annotate(
            f"{better}/{len(deltas)} better",
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axis.axhline(0.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(rungs)), rungs, rotation=20)
    measured = report.measures[0]["name"].split(" (")[0] if report.measures else "the measure"
    axis.set_ylabel(f"{measured}\nminus doing nothing", fontsize=8)
    side = "above" if higher_better else "below"
    axis.set_title(
        f"Each remedy, each seed (red: the seed spiked; {side} 0: better)", fontsize=9, pad=16
    )
    figure.tight_layout()
    return figure


def _warnings(plt: Any, table: Mapping[str, Sequence[LeadCount]]) -> Any:
    """Each signal's precision at each lead, and chance's."""
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    chance: list[tuple[int, float]] = []
    for name, counts in table.items():
        judged = [c for c in counts if c.alarms]
        axis.plot([c.lead for c in judged], [c.precision for c in judged], marker="o", label=name)
        chance = chance or [(c.lead, c.chance) for c in counts]
    axis.plot(*zip(*chance, strict=True), color="black", linestyle="--", label="chance")
    axis.set_xscale("log")
    axis.set_xlabel("lead (steps)")
    axis.set_ylabel("precision of a crossing")
    axis.set_ylim(-0.02, 1.02)
    axis.set_title("Early warning: precision against chance", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def _sweep(plt: Any, found: Sequence[Mapping[str, Any]], variant: str) -> Any:
    """Final loss against peak LR, each arm with its initial loss dotted; a run that
    diverged (a loss not finite, or above 10x its initial one) drawn as an x at the top."""
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    top = 1.5 * max(p["initial_loss"] for p in found)
    for with_variant, colour, offset in ((False, "tab:red", 1.0), (True, "tab:green", 0.96)):
        arm = [p for p in found if p["variant"] == with_variant]
        if not arm:
            continue
        initial = arm[0]["initial_loss"]
        kept = [p for p in arm if math.isfinite(p["final_loss"]) and p["final_loss"] < 10 * initial]
        gone = [p for p in arm if p not in kept]
        label = f"with {variant}" if with_variant else "plain"
        xs, ys = [p["peak_lr"] for p in kept], [p["final_loss"] for p in kept]
        axis.plot(xs, ys, marker="o", color=colour, label=label)
        axis.scatter(
            [p["peak_lr"] for p in gone], [top * offset] * len(gone), marker="x", color=colour
        )
        axis.axhline(initial, color=colour, linewidth=0.8, linestyle=":")
    axis.set_xscale("log")
    axis.set_xlabel("peak LR")
    axis.set_ylabel(found[0]["measure"])
    axis.set_title("LR sweep (dotted: the loss at initialization; x: diverged)", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    return figure
