"""Roll back to a real Lightning checkpoint before a spike and train on from there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks.common import check_integer, make_state_key
from lit_spikes.checkpoints import newest_valid_checkpoint
from lit_spikes.loader import positioned


class RollbackRestore(Callback):
    """Picks the newest valid checkpoint at least ``distance`` steps before ``spike_step``
    and resumes training from it, with whatever remedy callbacks the caller adds.

    Files are tried newest first; one that does not load (empty, truncated, not a
    checkpoint, weights only), holds another step than its name says, or was written
    after a step skipped for a non-finite loss or gradient is refused with a warning that
    names it and why, and the previous one is tried. Attached to the
    Trainer, it checks at the start of training that the run
    really started from the chosen file, and records the rollback in its state
    (``spike_step``, ``distance``, ``ckpt_step``) so it is in every later checkpoint.
    Resumed from such a checkpoint (the branch was stopped and goes on), it restores that
    state instead: the rollback happened when the branch began, and is not chosen again.

    Args:
        dirpath: directory of ``step=<k>.ckpt`` files written by ``ModelCheckpoint``.
        spike_step: global step of the spike's onset.
        distance: how many steps before the spike the checkpoint must be, at least
            (PaLM rolled back about 100 steps).

    Raises:
        ValueError: a negative ``spike_step`` or ``distance``, or ``distance`` beyond
            ``spike_step``; in ``on_train_start``, a Trainer that resumed from another file.
        TypeError: in ``on_train_start``, train data that cannot be positioned by step (a
            plain ``DataLoader``): use ``StepLoader``.
        FileNotFoundError: on first use of ``ckpt_path``/``ckpt_step`` (or ``fit``),
            ``dirpath`` does not exist or holds no valid checkpoint at or before step
            ``spike_step - distance``.

    Example:
        >>> rollback = RollbackRestore("runs/x/checkpoints", spike_step=122, distance=20)
        >>> trainer = pl.Trainer(callbacks=[rollback, LRScaler(0.5, start_step=rollback.ckpt_step)])
        >>> rollback.fit(trainer, module, datamodule)
    """

    def __init__(self, dirpath: str | Path, spike_step: int, distance: int = 0) -> None:
        super().__init__()
        spike_step = check_integer("spike_step", spike_step, 0)
        distance = check_integer("distance", distance, 0)
        if distance > spike_step:
            raise ValueError(
                f"distance={distance} reaches back past step 0 from spike_step={spike_step}: "
                "the run has no history that long"
            )
        self.dirpath, self.spike_step, self.distance = Path(dirpath), spike_step, distance
        self.refused: list[str] = []
        self._chosen: tuple[int, Path] | None = None
        self._continued_from: int | None = None
        """``ckpt_step`` of the rollback a checkpoint of this branch recorded."""

    def _choose(self) -> tuple[int, Path]:
        if self._chosen is None:
            latest = self.spike_step - self.distance
            try:
                step, path, self.refused = newest_valid_checkpoint(self.dirpath, latest)
            except FileNotFoundError as error:
                raise FileNotFoundError(
                    f"RollbackRestore(spike_step={self.spike_step}, distance={self.distance}): "
                    f"{error}"
                ) from None
            self._chosen = (step, path)
        return self._chosen

    @property
    def ckpt_path(self) -> Path:
        """The checkpoint to resume from (chosen and validated on first use)."""
        return self._choose()[1]

    @property
    def ckpt_step(self) -> int:
        """The global step of that checkpoint: the first step the branch trains."""
        if self._continued_from is not None:
            return self._continued_from
        return self._choose()[0]

    def fit(
        self,
        trainer: pl.Trainer,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule | None = None,
        *,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
    ) -> None:
        """``trainer.fit`` from the chosen checkpoint, with data as ``Trainer.fit`` takes it."""
        trainer.fit(
            model,
            train_dataloaders=train_dataloaders,
            val_dataloaders=val_dataloaders,
            datamodule=datamodule,
            ckpt_path=self.ckpt_path,
        )

    @property
    @override
    def state_key(self) -> str:
        return make_state_key(self, spike_step=self.spike_step, distance=self.distance)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if positioned(trainer) is None:
            raise TypeError(
                "RollbackRestore resumes at an earlier step, but this fit's train data cannot "
                "be positioned by step (a plain DataLoader restarts at its first batch, so "
                "every step after the rollback would train the wrong batch): give it a "
                "lit_spikes.StepLoader"
            )
        if self._continued_from is not None:
            return  # a checkpoint of this branch: it rolled back when it began
        # The Trainer knows its ckpt_path only once it restored it, after `setup`.
        started = trainer.ckpt_path
        if started is None or Path(started).resolve() != self.ckpt_path.resolve():
            raise ValueError(
                f"RollbackRestore chose {self.ckpt_path}, but the Trainer resumes from "
                f"{started}: start it with RollbackRestore.fit(...) or "
                f"trainer.fit(..., ckpt_path=rollback.ckpt_path)"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "spike_step": self.spike_step,
            "distance": self.distance,
            "ckpt_step": self.ckpt_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Called only for a checkpoint holding this very rollback (same spike and distance).
        self._continued_from = int(state_dict["ckpt_step"])
