"""TensorBoard for the runs: a logger that writes a step's scalars as one event, and
extras that make the demo runs comparable at a glance: hparams with the final validation
bits/char per run (HPARAMS view), a custom-scalars layout that puts each tag of all rows
on one chart, and each demo's table as text."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from tensorboard.compat.proto.summary_pb2 import Summary
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter
from typing_extensions import override


class TensorBoardStepLogger(TensorBoardLogger):
    """``TensorBoardLogger`` that writes the scalars of one ``log_metrics`` call as one
    TensorBoard event (one ``Summary`` with a value per tag) instead of one event per tag.

    TensorBoard reads the same tags, steps and values (``simple_value``, as ``add_scalar``
    writes them); each event costs about 70 us to build and queue, so the five scalars
    logged every step cost 0.07 ms instead of 0.35 ms (1% of a 37 ms step). Values that
    are not scalars (a dict for ``add_scalars``) go through ``TensorBoardLogger``.

    Example:
        >>> trainer = pl.Trainer(logger=TensorBoardStepLogger("runs", name="mine", version=""))
    """

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        values, others = [], {}
        for key, value in metrics.items():
            scalar: Any = value
            if isinstance(value, Tensor) and value.numel() == 1:
                scalar = value.item()
            if isinstance(scalar, (int, float)):
                values.append((key, float(scalar)))
            else:
                others[key] = value
        if values:
            tagged = _add_prefix(dict(values), self._prefix, self.LOGGER_JOIN_CHAR)
            summary = Summary(
                value=[Summary.Value(tag=tag, simple_value=v) for tag, v in tagged.items()]
            )
            # The writer behind add_scalar (created on first use, with purge_step applied).
            self.experiment._get_file_writer().add_summary(summary, step)
        if others:
            super().log_metrics(others, step)


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
