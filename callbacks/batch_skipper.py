"""PaLM's remedy: never train on some data positions; the step counter goes on."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks._common import step_datamodule
from lit_spikes.data import normalize_skip


class BatchSkipper(Callback):
    """Skips the given data positions (PaLM skipped 200-500 batches around each spike).

    Feeds the StepDataModule's skip set in ``setup``: from then on the data pointer jumps
    past those positions while the global step, and with it the LR schedule, goes on.
    The skip set is part of the checkpoint (the DataModule's state and this callback's),
    so a resumed run keeps skipping the same data. Logs ``data/skipped``, the number of
    positions skipped so far; the module logs each step's ``data/position``.

    Args:
        positions: single data positions to skip.
        ranges: half-open ``(start, end)`` ranges of data positions to skip.

    Raises:
        ValueError: a negative position, a range whose end is not after its start, or
            nothing to skip at all.
        TypeError: in ``setup``, if the Trainer has no StepDataModule.

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
        self._key = self._generate_state_key(
            first=configured[0], count=len(configured), positions=f"{digest:08x}"
        )
        self._old_key = self._generate_state_key(first=configured[0], count=len(configured))

    @property
    @override
    def state_key(self) -> str:
        return self._key

    @property
    @override
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        return self._old_key  # files from before the digest joined the key

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        step_datamodule(trainer, "BatchSkipper").add_skip(self.skip)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        step = trainer.global_step - 1  # the step just trained: the optimizer counted it
        position = step_datamodule(trainer, "BatchSkipper").position_of_step(step)
        # To the loggers at that step, as the module logs the step's data/position (through
        # self.log, 0.6 ms a step, it was the next step's count).
        for logger in trainer.loggers:
            logger.log_metrics({"data/skipped": float(position - step)}, step=step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skip": list(self.skip)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skip = normalize_skip((*self.skip, *state_dict["skip"]))
