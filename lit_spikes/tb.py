"""TensorBoard for the runs: a logger that writes a step's scalars as one event, and
extras that make the demo runs comparable at a glance: hparams with the final validation
bits/char per run (HPARAMS view), a custom-scalars layout that puts each tag of all rows
on one chart, and each demo's table as text."""

from __future__ import annotations

import math
import numbers
import queue
import threading
import time
import warnings
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
    TensorBoard event, built and written off the training loop's thread.

    TensorBoard reads the same tags, steps, values (``simple_value``, as ``add_scalar``
    writes them) and wall times. What changes is the cost to the loop, which pays only for
    keeping a step's numbers: one event per step, not one per tag, and the events are
    built, serialized and checksummed (in pure Python, by TensorBoard) in a helper thread.
    The loop hands them over in ``hand_over``, which ``TinyGPTModule`` calls right
    before the backward pass, every ``hand_over_every`` steps. That is no free
    parallelism: the helper holds the GIL, which backward takes to free tensors, so
    backward waits about as long as the helper works, 0.07 ms per step's event (measured
    on the default model: +0.7 ms at a hand-over of 10 steps, +3.3 ms at one of 50). What
    the hand-over saves is waking a thread every step.
    ``max_pending`` waiting steps, a step logged ``max_wait_s`` after the oldest waiting one
    (so a module that never calls ``hand_over`` still shows as it trains, and a killed run
    loses seconds of scalars at most) and ``finalize`` hand them over too; ``save`` and
    ``finalize`` wait until what was handed over is written (``save`` leaves waiting steps
    for the next hand-over). Values that are not scalars (a
    dict for ``add_scalars``) go through ``TensorBoardLogger`` at once, after the scalars
    logged before them.

    Args:
        *args: ``TensorBoardLogger``'s (``save_dir``, ``name``, ...).
        max_pending: hand the waiting steps over once this many wait.
        max_wait_s: hand the waiting steps over when a step is logged this many seconds
            after the oldest of them.
        hand_over_every: ``hand_over`` hands the waiting steps over once this many wait
            (waking the helper costs 0.02-0.05 ms on a VM: not every step).
        **kwargs: ``TensorBoardLogger``'s.

    Raises:
        ValueError: ``max_pending`` or ``hand_over_every`` below 1, or ``max_wait_s`` not
            a positive number.

    Example:
        >>> trainer = pl.Trainer(logger=TensorBoardStepLogger("runs", name="mine", version=""))
    """

    def __init__(
        self,
        *args: Any,
        max_pending: int = 100,
        hand_over_every: int = 10,
        max_wait_s: float = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        if hand_over_every < 1:
            raise ValueError(f"hand_over_every={hand_over_every} must be >= 1")
        if not (isinstance(max_wait_s, int | float) and 0 < max_wait_s < math.inf):
            raise ValueError(f"max_wait_s={max_wait_s!r} must be a positive number of seconds")
        self.max_pending = max_pending
        self.hand_over_every = hand_over_every
        self.max_wait_s = max_wait_s
        self._pending: list[_Scalars] = []
        self._helper: _EventWriter | None = None

    @override
    def __getstate__(self) -> dict[str, Any]:
        """The logger without its helper thread (a copy starts its own)."""
        state = super().__getstate__()
        state["_helper"] = None  # a thread does not travel; the copy starts its own
        return state

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        values, others = {}, {}
        for key, value in metrics.items():
            scalar: Any = value
            if isinstance(value, Tensor) and value.numel() == 1:
                scalar = value.item()
            if isinstance(scalar, numbers.Real):  # bool, int, float, numpy scalars
                values[key] = float(scalar)
            else:
                others[key] = value
        if values:
            now = time.time()
            self._pending.append((values, step, now))
            pending = self._pending
            if len(pending) >= self.max_pending or now - pending[0][2] >= self.max_wait_s:
                self.write_pending()
        if others:
            self._wait_written()  # keep the file in step order
            super().log_metrics(others, step)

    def hand_over(self) -> None:
        """Hand the waiting steps to the helper thread if ``hand_over_every`` wait: for a
        module to call right before its backward pass."""
        self.write_pending(min_steps=self.hand_over_every)

    @rank_zero_only
    def write_pending(self, min_steps: int = 1) -> None:
        """Hand the waiting steps to the helper thread, which writes them as events, if at
        least ``min_steps`` wait (waking the helper costs 0.02-0.05 ms on a VM: a loop can
        hand over every few steps)."""
        if not self._pending or len(self._pending) < min_steps:
            return
        if self._helper is None:
            # The writer behind add_scalar (created on first use, with purge_step applied),
            # taken here: the experiment is made lazily, in the loop's thread.
            writer = self.experiment._get_file_writer()
            self._helper = _EventWriter(writer, self._prefix, self.LOGGER_JOIN_CHAR)
        self._helper.put(self._pending)
        self._pending = []

    def _wait_written(self) -> None:
        self.write_pending()
        if self._helper is not None:
            self._helper.wait()

    @override
    @rank_zero_only
    def save(self) -> None:
        # Lightning calls save() after each of its own log_metrics (every step where
        # self.log feeds a progress bar): steps still waiting stay for the next backward;
        # what the helper has is written (by then, usually, it is) and flushed.
        if self._helper is not None:
            self._helper.wait()
        super().save()

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        # Always stop the helper and close the file; a write error does not replace the
        # error that failed a run (Lightning finalizes with "failed" while handling it).
        try:
            self._wait_written()
        except RuntimeError as error:
            if status != "failed":
                raise
            warnings.warn(f"TensorBoard step events were lost: {error.__cause__!r}", stacklevel=2)
        finally:
            helper, self._helper = self._helper, None
            try:
                if helper is not None:
                    helper.close()
            finally:
                super().finalize(status)


_Scalars = tuple[dict[str, float], "int | None", float]
"""One ``log_metrics`` call's scalars, step and wall time."""


class _EventWriter:
    """A daemon thread that turns batches of ``_Scalars`` into one TensorBoard event each
    and adds them to ``writer``, in order; an error it meets is raised by the next call."""

    def __init__(self, writer: Any, prefix: str, join_char: str) -> None:
        self.writer, self.prefix, self.join_char = writer, prefix, join_char
        # SimpleQueue: its put is a C call (a Queue's took 0.06 ms in the training loop).
        self._queue: queue.SimpleQueue[list[_Scalars] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tb-step-events", daemon=True)
        self._thread.start()

    def put(self, batch: list[_Scalars]) -> None:
        self._raise()
        self._queue.put(batch)

    def wait(self) -> None:
        """Block until every batch put so far is written to the writer."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        self._raise()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("writing TensorBoard step events failed") from error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                for values, step, wall_time in item:
                    tagged = _add_prefix(values, self.prefix, self.join_char)
                    summary = Summary(
                        value=[Summary.Value(tag=tag, simple_value=v) for tag, v in tagged.items()]
                    )
                    self.writer.add_summary(summary, step, wall_time)
            except BaseException as error:  # kept for the loop's thread to raise
                if self._error is None:  # the first one is the cause
                    self._error = error


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
    run_dir = Path(run_dir)
    before = set(run_dir.glob("events.out.tfevents.*"))
    with SummaryWriter(log_dir=str(run_dir)) as writer:
        writer.add_hparams(dict(params), {HPARAM_METRIC: val_bpc}, run_name=".", global_step=step)
    # TensorBoard reads a run's event files in name order, and a run resumed into this
    # directory starts its own file with a purge of the later steps it repeats: read
    # after that, the final metric would be dropped. Files written in the same second
    # differ only in a counter, which sorts as text ("...9" after "...10"): the hparams
    # file takes the newest name with a suffix, so that it is read last.
    if before:
        newest = max(path.name for path in before)
        written = sorted(set(run_dir.glob("events.out.tfevents.*")) - before)
        for index, path in enumerate(written):
            if path.name < newest:
                path.rename(run_dir / f"{newest}.hparams{index}")


def write_summary(demo_dir: Path, tables: Mapping[str, str]) -> Path:
    """Write the custom-scalars layout and the demo's tables (markdown) as text into
    ``<demo_dir>/summary``; returns that directory."""
    summary = demo_dir / "summary"
    with SummaryWriter(log_dir=str(summary)) as writer:
        writer.add_custom_scalars(LAYOUT)
        for tag, markdown in tables.items():
            writer.add_text(tag, markdown, global_step=0)
    return summary
