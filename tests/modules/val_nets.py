"""A small net with a validation loop, written for the ExactResume and check-resume path
tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset


def val_rows(count: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(count, 8, generator=g), torch.randn(count, 1, generator=g))


class ValNet(pl.LightningModule):
    """Dropout, AdamW, validation that logs val_loss; the losses of every step kept."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class PlateauNet(ValNet):
    """AdamW under ReduceLROnPlateau, returned from configure_optimizers."""

    def __init__(self, interval: str = "step", monitor: str = "train_loss") -> None:
        super().__init__()
        self.interval, self.monitor = interval, monitor

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.9)
        scheduler = {"scheduler": plateau, "interval": self.interval, "monitor": self.monitor}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}
