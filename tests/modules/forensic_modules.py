"""Modules with a fault planted in one named layer at a chosen step, and data with a
poisoned batch, for the forensics replay (none of them the project's). A fault is a
function of the step, so a replay meets it again, as it meets a real run's cause.

- ``PlantedMLP``: an MLP (``net.0``, ``net.2``, ``net.4``) trained with AdamW.
- ``PlantedTower``: an input projection, four residual blocks and a head, trained with
  SGD and momentum.
- ``fault``: ``weights`` (the layer's weight scaled as the step begins), ``grad`` (its
  gradient scaled after the backward pass), ``lr`` (the LR scaled from the step on).
- ``InputData(poison=[p])``: the inputs of data position ``p`` scaled (the targets not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset

from lit_spikes import StepLoader

FEATURES = 8


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples of a fixed linear map; ``poisoned`` rows' inputs scaled by ``factor`` after
    their targets were computed."""

    def __init__(self, rows: int, seed: int, poisoned: Sequence[int], factor: float) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(rows, FEATURES, generator=generator)
        w = torch.randn(FEATURES, 1, generator=generator)
        self.y = self.x @ w + 0.1 * torch.randn(rows, 1, generator=generator)
        if poisoned:
            self.x[list(poisoned)] *= factor

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class InputData(pl.LightningDataModule):
    """Regression rows served by a ``StepLoader``; ``poison``: data positions whose
    inputs are scaled by ``factor``."""

    def __init__(
        self, rows: int = 4096, batch_size: int = 16, seed: int = 0,
        poison: Sequence[int] = (), factor: float = 30.0,
    ) -> None:  # fmt: skip
        super().__init__()
        order = StepLoader(Rows(rows, seed, (), factor), batch_size, seed=seed)
        poisoned = [r for p in poison for r in order.rows_of_step(p)]
        self.loader = StepLoader(Rows(rows, seed, poisoned, factor), batch_size, seed=seed)

    def train_dataloader(self) -> StepLoader:
        return self.loader


class Planted(pl.LightningModule):
    """The fault's planting, common to both modules (``network`` builds the layers)."""

    def __init__(
        self,
        fault: str | None = None,
        fault_layer: str = "",
        fault_step: int = 40,
        fault_factor: float = 10.0,
        lr: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if fault not in (None, "weights", "grad", "lr"):
            raise ValueError(f"fault={fault!r} must be None, 'weights', 'grad' or 'lr'")
        self.save_hyperparameters()
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.network()
        torch.random.set_rng_state(state)  # the weights' seed is not the run's

    def network(self) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _planted(self, kind: str) -> nn.Module | None:
        hp = self.hparams
        if hp["fault"] == kind and self.global_step == hp["fault_step"]:
            return self.get_submodule(hp["fault_layer"])
        return None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        layer = self._planted("weights")
        if layer is not None:
            with torch.no_grad():
                layer.weight.mul_(self.hparams["fault_factor"])

    def on_after_backward(self) -> None:
        layer = self._planted("grad")
        if layer is not None and layer.weight.grad is not None:
            layer.weight.grad.mul_(self.hparams["fault_factor"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def lr_factor(self, step: int) -> float:
        hp = self.hparams
        jumped = hp["fault"] == "lr" and step >= hp["fault_step"]
        return float(hp["fault_factor"]) if jumped else 1.0

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class PlantedMLP(Planted):
    """Three linear layers with tanh between them, AdamW."""

    def network(self) -> None:
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class PlantedTower(Planted):
    """An input projection, four residual blocks and a head, SGD with momentum."""

    def network(self) -> None:
        self.embed = nn.Linear(FEATURES, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)
