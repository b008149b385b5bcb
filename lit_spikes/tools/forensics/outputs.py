"""The forensics replay's numbers where a person looks: TensorBoard (a run per layer, a
chart per statistic, the verdict as text), a figure, and a JSON file."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_spikes.tools.forensics.verdict import RUN

if TYPE_CHECKING:
    from lit_spikes.tools.forensics.run import Forensics

PANELS = (
    "grad_norm",
    "update_norm",
    "update_ratio",
    "weight_norm",
    "act_absmax",
    "act_kurtosis",
    "state_exp_avg_sq_norm",
    "grad_nonfinite",
)
"""The figure's per-layer panels, those the replay measured, in this order."""


def _run_name(layer: str, layers: list[str]) -> str:
    """A layer's TensorBoard run (a directory), numbered in the forward order so that
    TensorBoard lists the input side first (``00.embed``); ``run`` for the run's own."""
    if layer == RUN:
        return "run"
    return f"{layers.index(layer):02d}." + re.sub(r"[^\w.-]", "_", layer)


def write_tensorboard(result: Forensics, out: Path) -> Path:
    """A TensorBoard run per layer under ``out`` (``out/<nn>.<layer>``), each statistic under
    the tag ``forensics/<stat>``: TensorBoard draws one chart per statistic with a line
    per layer. The run's loss and LR go in ``out/run``, the verdict in ``out/summary``'s
    text. Returns ``out``."""
    from torch.utils.tensorboard import SummaryWriter

    from lit_spikes.shared.tb import write_summary
    from lit_spikes.tools.forensics.report import verdict_lines

    by_layer: dict[str, dict[str, dict[int, float]]] = {}
    for (layer, stat), values in result.series.items():
        by_layer.setdefault(layer, {})[stat] = values
    for layer, stats in by_layer.items():
        with SummaryWriter(log_dir=str(out / _run_name(layer, result.layers))) as writer:
            for stat, values in sorted(stats.items()):
                for step, value in sorted(values.items()):
                    writer.add_scalar(f"forensics/{stat}", value, global_step=step)
    text = "\n\n".join(verdict_lines(result))
    write_summary(out, {"forensics/verdict": text})
    return out


def write_figure(result: Forensics, path: Path) -> Path:
    """One panel per statistic (a line per layer, log scale where positive), then the
    run's LR, the module's columns (the demo's largest attention logit) and the loss;
    the band steps shaded, the onset dashed, the first step a statistic left its band
    dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {stat for layer, stat in result.series if layer != RUN}
    own = sorted(stat for layer, stat in result.series if layer == RUN and stat != "loss")
    panels = [p for p in PANELS if p in measured] + own + ["loss"]  # the run's: its LR, columns
    columns = 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    first = result.reading.first_step
    for axis, stat in zip(axes.flat, panels, strict=False):
        layers = [RUN] if (RUN, stat) in result.series else result.layers
        for layer in layers:
            values = result.series.get((layer, stat), {})
            steps = sorted(s for s in values if math.isfinite(values[s]))
            width = 2.2 if layer == result.reading.origin else 1.0
            axis.plot(steps, [values[s] for s in steps], label=layer, linewidth=width)
        if all(v > 0 for layer in layers for v in result.series.get((layer, stat), {}).values()):
            axis.set_yscale("log")
        band = result.band_steps
        axis.axvspan(band.start, band.stop - 1, color="grey", alpha=0.1, linewidth=0)
        axis.axvline(result.spike_step, color="black", linestyle="--", linewidth=0.8)
        if first is not None:
            axis.axvline(first, color="red", linestyle=":", linewidth=1.0)
        axis.set_title(stat, fontsize=9)
        axis.tick_params(labelsize=7)
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    axes.flat[0].legend(fontsize=6, loc="upper left")
    origin = result.reading.origin or ("every layer at once" if first is not None else "none")
    figure.suptitle(
        f"Forensics of the spike at step {result.spike_step}: first {origin}"
        + (f" at step {first} (dotted)" if first is not None else ""),
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def to_dict(result: Forensics) -> dict[str, Any]:
    """The verdict, every exit and every number the replay measured (``series``: layer ->
    statistic -> step -> value), as plain data (non-finite numbers as strings)."""
    reading = result.reading

    def plain(value: float) -> float | str:
        return value if math.isfinite(value) else str(value)

    return {
        "spike_step": result.spike_step,
        "ckpt_path": str(result.ckpt_path),
        "checked_steps": result.checked,
        "first_step": reading.first_step,
        "origin": reading.origin,
        "kind": reading.kind,
        "series": _series_dict(result, plain),
        "exits": [
            {
                "layer": e.layer,
                "stat": e.stat,
                "step": e.step,
                "value": plain(e.value),
                "center": e.band.center,
                "spread": e.band.spread,
            }
            for e in result.exits
        ],
    }


def _series_dict(result: Forensics, plain: Any) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (layer, stat), values in result.series.items():
        out.setdefault(layer, {})[stat] = {str(k): plain(v) for k, v in sorted(values.items())}
    return out


def write_json(result: Forensics, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(result), indent=1, allow_nan=False) + "\n")
    return path
