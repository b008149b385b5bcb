"""PaLM's remedy: never train on some data positions; the step counter goes on."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks.common import make_state_key
from lit_spikes.loader import PositionedData, normalize_skip, positioned


class BatchSkipper(Callback):
    """Skips the given data positions (PaLM skipped 200-500 batches around each spike).

    Feeds the skip set of the fit's step-indexed data (a ``StepLoader``, or a DataModule
    that is ``PositionedData``, as the demo's ``StepDataModule``) before its first batch:
    from then on the data pointer jumps past those positions while the global step, and
    with it the LR schedule, goes on. The skip set is part of the checkpoint (the data's
    state and this callback's), so a resumed run keeps skipping the same data. Logs
    ``data/skipped``, the number of positions skipped so far.

    Args:
        positions: single data positions to skip.
        ranges: half-open ``(start, end)`` ranges of data positions to skip.

    Raises:
        ValueError: a negative position, a range whose end is not after its start, or
            nothing to skip at all.
        TypeError: at the fit's start, if its data cannot be positioned by step (a plain
            ``DataLoader``, which Lightning restarts at its first batch): use ``StepLoader``.

    Example:
        >>> trainer = pl.Trainer(callbacks=[BatchSkipper(ranges=[(110, 140)])])
        >>> trainer.fit(module, datamodule=dm, ckpt_path="runs/x/checkpoints/step=100.ckpt")
    """

    def __init__(
        self, positions: Iterable[int] = (), ranges: Iterable[tuple[int, int]] = ()
    ) -> None:
        super().__init__()
        expanded: list[int] = list(positions)
        for pair in ranges:
            start, end = pair
            if start < 0 or end <= start:
                raise ValueError(
                    f"ranges entry {pair!r} must be (start, end) with 0 <= start < end"
                )
            expanded.extend(range(start, end))
        self.skip = normalize_skip(expanded)
        if not self.skip:
            raise ValueError("BatchSkipper needs at least one position or range to skip")
        # Named by the set it was given, all of it: load_state_dict may add a resumed
        # run's positions to self.skip, and two skippers may share a first and a count.
        configured = self.skip
        digest = zlib.crc32(",".join(map(str, configured)).encode())
        self._key = make_state_key(
            self, first=configured[0], count=len(configured), positions=f"{digest:08x}"
        )
        self._fed: PositionedData | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._key

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fed = None
        datamodule = getattr(trainer, "datamodule", None)  # set on it, untyped
        if isinstance(datamodule, PositionedData):  # before a resume restores its state
            datamodule.add_skip(self.skip)
            self._fed = datamodule

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fed is None:  # a loader given to fit: it exists only now
            self._fed = positioned(trainer)
            if self._fed is None:
                raise TypeError(
                    "BatchSkipper skips data positions, but this fit's train data cannot be "
                    "positioned by step (a plain DataLoader restarts at its first batch after "
                    "a resume, and would train other batches than it reports): give it a "
                    "lit_spikes.StepLoader"
                )
            self._fed.add_skip(self.skip)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        assert self._fed is not None
        step = trainer.global_step - 1  # the step just trained: the optimizer counted it
        position = self._fed.position_of_step(step)
        for logger in trainer.loggers:
            logger.log_metrics({"data/skipped": float(position - step)}, step=step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skip": list(self.skip)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skip = normalize_skip((*self.skip, *state_dict["skip"]))
