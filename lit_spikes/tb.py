"""TensorBoard for the runs: a logger that writes a step's scalars as one event, and
extras that make the demo runs comparable at a glance: hparams with the final validation
bits/char per run (HPARAMS view), a custom-scalars layout that puts each tag of all rows
on one chart, and each demo's table as text."""

from __future__ import annotations

import numbers
import time
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
    TensorBoard event, and hands its events to TensorBoard's writer thread when the
    training loop does not need Python's GIL.

    TensorBoard reads the same tags, steps, values (``simple_value``, as ``add_scalar``
    writes them) and wall times. What changes is the cost. One event per step, not one
    per tag: 0.07 ms instead of 0.35 ms for the five per-step scalars. And TensorBoard's
    writer thread checksums each event in pure Python, holding the GIL: started right
    after a step, it stalled the next step's Python (the batch fetch took 0.4 ms instead
    of 0.2). So events wait here until ``write_pending``, which ``TinyGPTModule`` calls
    right before the backward pass (it runs without the GIL, so the writer works beside
    it), and ``finalize`` or ``max_pending`` waiting events call too.
    Values that are not scalars (a dict for ``add_scalars``) go through
    ``TensorBoardLogger`` at once.

    Args:
        *args: ``TensorBoardLogger``'s (``save_dir``, ``name``, ...).
        max_pending: write the waiting events once this many wait (so that a run of
            another module still shows in TensorBoard as it trains).
        **kwargs: ``TensorBoardLogger``'s.

    Raises:
        ValueError: ``max_pending`` below 1.

    Example:
        >>> trainer = pl.Trainer(logger=TensorBoardStepLogger("runs", name="mine", version=""))
    """

    def __init__(self, *args: Any, max_pending: int = 100, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self.max_pending = max_pending
        self._pending: list[tuple[Summary, int | None, float]] = []

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        values, others = [], {}
        for key, value in metrics.items():
            scalar: Any = value
            if isinstance(value, Tensor) and value.numel() == 1:
                scalar = value.item()
            if isinstance(scalar, numbers.Real):  # bool, int, float, numpy scalars
                values.append((key, float(scalar)))
            else:
                others[key] = value
        if values:
            tagged = _add_prefix(dict(values), self._prefix, self.LOGGER_JOIN_CHAR)
            summary = Summary(
                value=[Summary.Value(tag=tag, simple_value=v) for tag, v in tagged.items()]
            )
            self._pending.append((summary, step, time.time()))
            if len(self._pending) >= self.max_pending:
                self.write_pending()
        if others:
            self.write_pending()  # keep the file in step order
            super().log_metrics(others, step)

    @rank_zero_only
    def write_pending(self) -> None:
        """Hand the waiting events to TensorBoard's writer thread."""
        if not self._pending:
            return
        # The writer behind add_scalar (created on first use, with purge_step applied).
        writer = self.experiment._get_file_writer()
        for summary, step, wall_time in self._pending:
            writer.add_summary(summary, step, wall_time)
        self._pending.clear()

    @override
    @rank_zero_only
    def save(self) -> None:
        # Flushes what the writer thread has; waiting events follow at the next backward
        # or at finalize. Lightning calls save() after each of its own log_metrics (every
        # step where self.log feeds a progress bar): writing them here would stall the
        # next step again.
        super().save()

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.write_pending()
        super().finalize(status)


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
