"""The study's figures: each remedy's outcome per seed against doing nothing, and the LR
sweep (final loss and largest attention logit against the peak LR)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_spikes.demo.study.cells import REMEDIES

OUTCOMES = "study_outcomes.png"
SWEEP = "study_sweep.png"


def write_figures(
    seeds: Sequence[Mapping[str, Mapping[str, Any]]],
    sweep_cells: Sequence[Mapping[str, Any]],
    directories: Sequence[Path],
) -> list[Path]:
    """Both figures into each of ``directories``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outcomes, sweep = _outcomes_figure(plt, seeds), _sweep_figure(plt, sweep_cells)
    figures = [(outcomes, OUTCOMES)] + ([(sweep, SWEEP)] if sweep_cells else [])
    written = []
    for directory in directories:
        directory.mkdir(parents=True, exist_ok=True)
        for figure, name in figures:
            figure.savefig(directory / name, dpi=110)
            written.append(directory / name)
    plt.close(outcomes)
    plt.close(sweep)
    return written


def _outcomes_figure(plt: Any, seeds: Sequence[Mapping[str, Mapping[str, Any]]]) -> Any:
    """Each remedy's val bits/char minus doing nothing, a point per seed."""
    outcomes, axis = plt.subplots(figsize=(9, 4))
    kinds = [k for k in REMEDIES if k != "resume_exact"]
    for x, kind in enumerate(kinds):
        deltas = [
            s[kind]["val_bpc"] - s["reference"]["val_bpc"]
            for s in seeds
            if kind in s and "reference" in s
        ]
        spiked = [
            bool(s["reference"]["onset"] is not None)
            for s in seeds
            if kind in s and "reference" in s
        ]
        jitter = [x + 0.25 * ((i % 7) / 6 - 0.5) for i in range(len(deltas))]
        colours = ["tab:red" if sp else "tab:blue" for sp in spiked]
        axis.scatter(jitter, deltas, c=colours, s=18, alpha=0.8)
        below = sum(d < 0 for d in deltas)
        axis.annotate(
            f"{below}/{len(deltas)} below",
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axis.axhline(0.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(kinds)), kinds, rotation=20)
    axis.set_ylabel("val bits/char minus doing nothing")
    axis.set_title(
        "Each remedy, each seed (red: the seed spiked after warm-up; below 0: better)",
        fontsize=9,
        pad=16,
    )
    outcomes.tight_layout()
    return outcomes


def _sweep_figure(plt: Any, sweep_cells: Sequence[Mapping[str, Any]]) -> Any:
    """Final loss and largest logit against peak LR, with and without QK-norm."""
    sweep, (loss_axis, logit_axis) = plt.subplots(1, 2, figsize=(9, 3.6))
    for qk, colour in ((False, "tab:red"), (True, "tab:green")):
        cells = [c for c in sweep_cells if bool(c["params"]["qk_norm"]) == qk]
        lrs = sorted({float(c["params"]["peak_lr"]) for c in cells})
        label = "QK-norm" if qk else "no QK-norm"
        for key, ax in (("final_loss", loss_axis), ("max_logit", logit_axis)):
            points = [(float(c["params"]["peak_lr"]), c[key]) for c in cells]
            ax.scatter(
                [p[0] for p in points], [p[1] for p in points], color=colour, s=10, alpha=0.5
            )
            means = [
                sum(v for lr2, v in points if lr2 == lr) / sum(lr2 == lr for lr2, _ in points)
                for lr in lrs
            ]
            ax.plot(lrs, means, color=colour, label=label)
    for ax, what in (
        (loss_axis, "final loss (last 10 steps)"),
        (logit_axis, "largest attention logit"),
    ):
        ax.set_xscale("log")
        ax.set_xlabel("peak LR")
        ax.set_ylabel(what)
    if sweep_cells:  # none yet in an interim report
        logit_axis.set_yscale("log")
        loss_axis.legend(fontsize=8)
        sweep.tight_layout()
    return sweep
