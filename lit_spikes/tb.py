"""TensorBoard extras that make the demo runs comparable at a glance: hparams with the
final validation bits/char per run (HPARAMS view), a custom-scalars layout that puts each
tag of all rows on one chart, and each demo's table as text."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

LAYOUT = {
    "lit-spikes: all rows on one chart": {
        "training loss": ["Multiline", [r"^train/loss$"]],
        "largest attention logit": ["Multiline", [r"^train/max_logit$"]],
        "learning rate": ["Multiline", [r"^lr$"]],
        "gradient norm (before clipping)": ["Multiline", [r"^grad_norm$"]],
        "validation bits/char": ["Multiline", [r"^val/bpc$"]],
        "data position": ["Multiline", [r"^data/position$"]],
    }
}
"""Custom-scalars layout: one Multiline chart per tag, matching that tag in every run."""

HPARAM_METRIC = "hp/val_bpc"


def write_hparams(
    run_dir: Path, params: Mapping[str, float | int | str | bool], val_bpc: float, step: int
) -> None:
    """Record a finished run's settings with its final validation bits/char, so the
    HPARAMS view lists the rows of a comparison side by side."""
    with SummaryWriter(log_dir=str(run_dir)) as writer:
        writer.add_hparams(dict(params), {HPARAM_METRIC: val_bpc}, run_name=".", global_step=step)


def write_summary(demo_dir: Path, tables: Mapping[str, str]) -> Path:
    """Write the custom-scalars layout and the demo's tables (markdown) as text into
    ``<demo_dir>/summary``; returns that directory."""
    summary = demo_dir / "summary"
    with SummaryWriter(log_dir=str(summary)) as writer:
        writer.add_custom_scalars(LAYOUT)
        for tag, markdown in tables.items():
            writer.add_text(tag, markdown, global_step=0)
    return summary
