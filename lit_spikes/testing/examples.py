"""Small modules and data for trying the resume check from the command line (the findings
in docs/check-resume.md come from these):

    python -m lit_spikes.tools.check_resume --model lit_spikes.testing.examples.Regressor \\
        --data lit_spikes.testing.examples.ShuffledData --data.num_workers 2 \\
        --steps 40 --resume_at 17
"""

from __future__ import annotations

import importlib
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_spikes.loader import StepLoader


def rows(count: int = 64, features: int = 8) -> TensorDataset:
    """A fixed regression data set (its own generator: the same rows in every run)."""
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(count, features, generator=g), torch.randn(count, 1, generator=g)
    )


class Regressor(pl.LightningModule):
    """A plain module: two linear layers (dropout optional), AdamW; nothing for resuming."""

    def __init__(self, features: int = 8, hidden: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(hidden, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ShuffledData(pl.LightningDataModule):
    """``DataLoader(shuffle=True)`` as most projects write it; ``stateful=True``: torchdata's
    ``StatefulDataLoader`` instead (``pip install torchdata``), which Lightning saves and
    restores through its state_dict."""

    def __init__(
        self, rows: int = 64, batch_size: int = 8, num_workers: int = 0, stateful: bool = False
    ) -> None:
        super().__init__()
        self.rows, self.batch_size = rows, batch_size
        self.num_workers, self.stateful = num_workers, stateful

    def train_dataloader(self) -> Any:
        loader: Any = DataLoader
        if self.stateful:  # an optional package: the rest of this module works without it
            loader = importlib.import_module("torchdata.stateful_dataloader").StatefulDataLoader
        return loader(
            rows(self.rows),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
        )


class StepData(pl.LightningDataModule):
    """The same rows through ``StepLoader``: the batch of step k is a function of (seed, k)."""

    def __init__(self, rows: int = 64, batch_size: int = 8, num_workers: int = 0) -> None:
        super().__init__()
        self.rows, self.batch_size, self.num_workers = rows, batch_size, num_workers

    def train_dataloader(self) -> StepLoader:
        return StepLoader(
            rows(self.rows), batch_size=self.batch_size, seed=0, num_workers=self.num_workers
        )
