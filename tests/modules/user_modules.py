"""LightningModules and data written the way Lightning users write them, not the project's
own: the library's guarantees are tested on these. Module-level, so a script in another
process (a resume, a DDP rank) imports them by name."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

ROWS, FEATURES = 96, 8


def regression_data(seed: int = 0, rows: int = ROWS) -> TensorDataset:
    """``rows`` noisy samples of a fixed linear map, built from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 1, generator=generator)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(rows, 1, generator=generator))


class PoisonedRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``regression_data`` with the targets of some rows multiplied by ``factor``: a bad
    batch planted where those rows are trained."""

    def __init__(self, rows: set[int], factor: float = 1000.0, seed: int = 0) -> None:
        self.data, self.rows, self.factor = regression_data(seed), rows, factor

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[index]
        return x, y * self.factor if index in self.rows else y


class DropoutRegressor(pl.LightningModule):
    """A small MLP with dropout, AdamW and a step LR schedule: returns its loss only."""

    def __init__(self, hidden: int = 16, lr: float = 0.01, dropout: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class LoggingRegressor(pl.LightningModule):
    """A linear model that logs its loss with ``self.log`` and uses plain SGD."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layer = nn.Linear(FEATURES, 1)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
