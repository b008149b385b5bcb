"""A user's own classes for ``lit-spikes fit`` by class path (tests/tools/test_fit_own_module.py
and the docs' command lines): a small net with dropout and its own AdamW whose weights
come from the global RNG (so a seed decides them), and a DataModule yielding a
``StepLoader``. Module-level, so the CLI imports them by name."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume
from tests.modules.guarantee_modules import FEATURES, rows


class DropoutNet(pl.LightningModule):
    """An MLP with dropout and AdamW: nothing in it for resuming or seeding."""

    def __init__(self, hidden: int = 16, lr: float = 0.01, dropout: float = 0.3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.1)


class OwnExactNet(DropoutNet):
    """The same, attaching its own ExactResume the Lightning way."""

    def configure_callbacks(self) -> list[Callback]:
        return [ExactResume()]


class StepData(pl.LightningDataModule):
    """``StepLoader`` batches of a fixed regression set (12 steps a data epoch)."""

    def __init__(self, batch_size: int = 8, seed: int = 5) -> None:
        super().__init__()
        self.batch_size, self.seed = batch_size, seed

    def train_dataloader(self) -> StepLoader:
        return StepLoader(rows(), self.batch_size, seed=self.seed)


class SelfFedNet(DropoutNet):
    """The same net bringing its own ``train_dataloader`` (no DataModule needed)."""

    def train_dataloader(self) -> StepLoader:
        return StepLoader(rows(), 8, seed=5)


CHECKED: list[tuple[str, str, int | None]] = []
"""Each ``check_run`` call of the two classes below: (class, stage, the checkpoint's step)."""


class CheckedNet(DropoutNet):
    """The net with checks of its own (``lit_spikes.ChecksItsRun``): a width the data
    module's ``max_hidden`` does not allow is refused before the run writes a file."""

    def check_run(
        self, stage: str, trainer: Any, *, model: Any, datamodule: Any, checkpoint: Any
    ) -> None:
        CHECKED.append(("net", stage, None if checkpoint is None else checkpoint["global_step"]))
        limit = getattr(datamodule, "max_hidden", None)
        if limit is not None and self.hparams["hidden"] > limit:
            raise ValueError(f"CheckedNet.hidden={self.hparams['hidden']} exceeds {limit}")


class CheckedData(StepData):
    """``StepData`` that checks the run too, and sees the resumed checkpoint."""

    def __init__(self, batch_size: int = 8, seed: int = 5, max_hidden: int = 32) -> None:
        super().__init__(batch_size, seed)
        self.max_hidden = max_hidden

    def check_run(
        self, stage: str, trainer: Any, *, model: Any, datamodule: Any, checkpoint: Any
    ) -> None:
        assert datamodule is self and model is not None
        CHECKED.append(("data", stage, None if checkpoint is None else checkpoint["global_step"]))
        if trainer.max_steps > 10 * self.batch_size:
            raise ValueError(f"CheckedData: max_steps={trainer.max_steps} is too long")
