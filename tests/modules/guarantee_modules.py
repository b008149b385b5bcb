"""Plain LightningModules written for the library tests (tests/library/), not the project's:
each has its own optimizer (AdamW or SGD with momentum) and records what each global step
trained on, so a test can compare runs step by step. Module-level, so a resume in another
process imports them by name."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lit_spikes import StepLoader

FEATURES, ROWS, BATCH = 8, 96, 8  # 12 batches a data epoch


def rows(seed: int = 0) -> TensorDataset:
    """A fixed regression data set, from its own generator."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 1, generator=generator)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(ROWS, 1, generator=generator))


def step_loader(**kwargs: Any) -> StepLoader:
    return StepLoader(rows(), BATCH, seed=5, **kwargs)


def seed_all(seed: int) -> None:
    """Python's, NumPy's and torch's global RNGs, as a user's script seeds them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _Regressor(pl.LightningModule):
    """An MLP whose weights come from its own generator (not the run's RNG). ``spike``
    multiplies the loss of the steps it names by ``spike_factor`` (a planted outlier);
    ``schedule``: a StepLR stepped every step. Records each step's inputs and LR."""

    def __init__(
        self, spike: Sequence[int] = (), spike_factor: float = 1000.0, schedule: bool = False
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
        self.spike, self.spike_factor, self.schedule = set(spike), spike_factor, schedule
        self.inputs: dict[int, torch.Tensor] = {}
        self.lrs: dict[int, float] = {}

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.inputs[self.global_step] = x.clone()
        self.lrs[self.global_step] = float(self.trainer.optimizers[0].param_groups[0]["lr"])
        loss = self.forward_loss(x, y)
        if self.global_step in self.spike:
            loss = loss * self.spike_factor
        return loss

    def make_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def configure_optimizers(self) -> Any:
        optimizer = self.make_optimizer()
        if not self.schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class AdamWRegressor(_Regressor):
    """AdamW with weight decay: a step that zeroed its gradients would still move it."""

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


class MomentumRegressor(_Regressor):
    """SGD with momentum and weight decay."""

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9, weight_decay=0.01)


class DrawingRegressor(AdamWRegressor):
    """Draws from Python's ``random``, NumPy's global RNG and torch's in every step (input
    jitter, a random scale, noise), as augmentation code does; records the draws."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.draws: dict[int, tuple[float, float, float]] = {}

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        jitter = random.gauss(0.0, 0.05)
        scale = float(np.random.uniform(0.9, 1.1))
        noise = 0.05 * torch.randn_like(x)
        self.draws[self.global_step] = (jitter, scale, float(noise.sum()))
        return nn.functional.mse_loss(self.net(x * scale + noise + jitter), y)


class PlantedMetric(MomentumRegressor):
    """Logs ``score``: ``values[global_step]`` (a negative-valued metric, as a log-likelihood
    or a reward is), to test a detector's rule on exactly known values."""

    def __init__(self, values: Sequence[float]) -> None:
        super().__init__()
        self.values = list(values)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("score", torch.tensor(self.values[self.global_step]), on_step=True)
        return loss
