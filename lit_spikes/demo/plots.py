"""Comparison plots of training runs: loss and largest attention logit against the step.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global state, no
display needed), at a fixed size so that every figure of a comparison matches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

FIGSIZE = (10.0, 7.0)
"""Figure size in inches."""
DPI = 100
"""Pixels per inch: with FIGSIZE, every PNG is 1000 x 700 pixels."""
REQUIRED_KEYS = ("step", "loss", "max_logit")
"""Keys every per-step record must have (``TinyGPTModule.history`` records have them)."""

Record = Mapping[str, float]
Series = tuple[list[float], list[float], list[float]]
"""Steps, losses and max logits of one row."""


def _series(label: str, records: Sequence[Record]) -> Series:
    """Steps, losses and max logits of one row, sorted by step, checked on the way."""
    if not records:
        raise ValueError(f"row {label!r} has no records: nothing to plot")
    for index, record in enumerate(records):
        missing = [key for key in REQUIRED_KEYS if key not in record]
        if missing:
            raise ValueError(
                f"record {index} of row {label!r} lacks {missing}: every record needs "
                f"the keys {list(REQUIRED_KEYS)}"
            )
    ordered = sorted(records, key=lambda record: record["step"])
    steps = [float(record["step"]) for record in ordered]
    losses = [float(record["loss"]) for record in ordered]
    logits = [float(record["max_logit"]) for record in ordered]
    return steps, losses, logits


def plot_comparison(
    results: Mapping[str, Sequence[Record]],
    path: str | Path,
    title: str,
    ckpt_step: int | None = None,
    spike_window: tuple[int, int] | None = None,
    log_logit: bool = True,
) -> Path:
    """Write a PNG comparing runs: training loss (top) and max attention logit (bottom).

    One line per row in both panels, on a shared step axis, so branches resumed from a
    checkpoint overlay the run they branched from. The first row (the reference) is a
    thick light line under the others; a row equal to it at every step it has (an exact
    resume) is thin and dashed, so that the reference shows through it. The checkpoint
    step is a vertical dashed line and the spike window a shaded band in both panels; the
    legend names the rows and those marks. The figure is always ``FIGSIZE`` at ``DPI``
    (1000 x 700 pixels).

    Args:
        results: row label -> per-step records, each a mapping with at least ``"step"``,
            ``"loss"`` and ``"max_logit"`` (e.g. ``TinyGPTModule.history``). Rows are
            drawn in the mapping's order; records are sorted by step.
        path: where to write the PNG; missing parent directories are created.
        title: the figure's title.
        ckpt_step: global step of the checkpoint the branches resumed from (None: no mark).
        spike_window: ``(start, end)`` steps of the spike to shade (None: no band).
        log_logit: log-scale the max-logit axis (non-positive values are then not drawn).

    Returns:
        The path of the written PNG.

    Raises:
        ValueError: an empty ``results``, a row without records, a record without one of
            the required keys, or a spike window whose end is before its start.

    Example:
        >>> history = {"reference": [{"step": 0, "loss": 3.7, "max_logit": 1.2}, ...]}
        >>> plot_comparison(history, "runs/demo2/remedies.png", "Remedies", ckpt_step=100,
        ...                 spike_window=(140, 160))
        PosixPath('runs/demo2/remedies.png')
    """
    series = _checked_series(results, spike_window)
    figure = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, logit_ax = figure.subplots(2, 1, sharex=True)
    _draw_rows(loss_ax, logit_ax, series)
    for ax in (loss_ax, logit_ax):
        _draw_marks(ax, ckpt_step, spike_window)
    _label(loss_ax, logit_ax, log_logit and _any_positive(series))
    figure.suptitle(title)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=DPI)
    return path


def _checked_series(
    results: Mapping[str, Sequence[Record]], spike_window: tuple[int, int] | None
) -> dict[str, Series]:
    """Each row's series (``_series``), once the arguments are checked: at least one
    row, and a spike window whose end is not before its start."""
    if not results:
        raise ValueError(
            "plot_comparison needs at least one row in `results` (label -> per-step "
            "records); got an empty mapping"
        )
    series = {label: _series(label, records) for label, records in results.items()}
    if spike_window is not None:
        start, end = spike_window
        if end < start:
            raise ValueError(f"spike_window={spike_window!r}: the end must not be before the start")
    return series


def _draw_rows(loss_ax: Axes, logit_ax: Axes, series: Mapping[str, Series]) -> None:
    """One line per row in both panels, in ``line_styles``'s style, the same colour in
    both."""
    styles = line_styles(series)
    for label, (steps, losses, logits) in series.items():
        style: dict[str, Any] = styles[label]
        (line,) = loss_ax.plot(steps, losses, label=label, **style)
        logit_ax.plot(steps, logits, color=line.get_color(), label=label, **style)


def _draw_marks(ax: Axes, ckpt_step: int | None, spike_window: tuple[int, int] | None) -> None:
    """The spike window's band, the checkpoint's dashed line (each where given) and a
    light grid, on one panel."""
    if spike_window is not None:
        ax.axvspan(
            spike_window[0], spike_window[1], color="tab:red", alpha=0.12, label="spike window"
        )
    if ckpt_step is not None:
        ax.axvline(
            ckpt_step,
            color="black",
            linestyle="--",
            linewidth=1.0,
            label=f"checkpoint (step {ckpt_step})",
        )
    ax.grid(True, alpha=0.3)


def _label(loss_ax: Axes, logit_ax: Axes, log_logit: bool) -> None:
    """Axis labels, the max-logit axis's scale (log where ``log_logit``) and the legend."""
    loss_ax.set_ylabel("training loss (nats)")
    logit_ax.set_ylabel("max attention logit")
    logit_ax.set_xlabel("global step")
    if log_logit:
        logit_ax.set_yscale("log")
    loss_ax.legend(loc="upper right", fontsize="small")


def line_styles(series: Mapping[str, Series]) -> dict[str, dict[str, float | str]]:
    """matplotlib line settings per row: the first (the reference) thick and light,
    underneath; the others thin on top, dashed where equal to it at each of their steps
    (``==``: an exact resume), so that "identical" reads as identical."""
    rows = list(series.items())
    if not rows:
        return {}
    (first, reference), others = rows[0], rows[1:]
    by_step = {step: (loss, logit) for step, loss, logit in zip(*reference, strict=True)}
    styles: dict[str, dict[str, float | str]] = {
        first: {"linewidth": 5.0, "alpha": 0.35, "solid_capstyle": "butt", "zorder": 2}
    }
    for label, (steps, losses, logits) in others:
        same = all(
            by_step.get(step) == (loss, logit)
            for step, loss, logit in zip(steps, losses, logits, strict=True)
        )
        styles[label] = {"linewidth": 1.2, "linestyle": "--" if same else "-", "zorder": 3}
    return styles


def _any_positive(series: Mapping[str, Series]) -> bool:
    """Whether any max logit can be drawn on a log scale."""
    return any(v > 0 and math.isfinite(v) for _, _, logits in series.values() for v in logits)
