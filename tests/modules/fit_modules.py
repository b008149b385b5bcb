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
