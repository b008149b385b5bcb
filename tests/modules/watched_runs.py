"""A small regressor with per-step state snapshots, for the SpikeDetector and SkipStep path
tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WATCHED_FEATURES = 8


def regressor_data(rows: int = 512, seed: int = 0) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WATCHED_FEATURES, generator=generator)
    y = x @ torch.randn(WATCHED_FEATURES, 1, generator=generator) + 0.1 * torch.randn(
        rows, 1, generator=generator
    )
    return DataLoader(TensorDataset(x, y), batch_size=8)


class WatchedRegressor(pl.LightningModule):
    """A small MLP; ``poison`` multiplies the loss of a batch (by its index) by a factor;
    ``sparse_every`` logs ``sparse`` every so many steps; validation logs ``val_loss``."""

    def __init__(
        self,
        optimizer: str = "adamw",
        poison: dict[int, float] | None = None,
        sparse_every: int = 0,
        sparse_poison: dict[int, float] | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WATCHED_FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer, self.poison = optimizer, poison or {}
        self.sparse_every, self.sparse_poison = sparse_every, sparse_poison or {}
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y) * self.poison.get(batch_idx, 1.0)
        self.losses.append(float(loss.detach()))
        step = self.trainer.global_step
        if self.sparse_every and step % self.sparse_every == 0:
            self.log("sparse", loss.detach() * self.sparse_poison.get(step, 1.0))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, dampening=0.5)
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def clone_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    optimizer = trainer.optimizers[0]
    return {
        "weights": [p.detach().clone() for p in module.parameters()],
        "state": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in optimizer.state_dict()["state"].items()
        },
    }


class StepStates(Callback):
    """The weights and optimizer state before each optimizer step (at its first batch)
    and after it (at the batch that ended it)."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, Any]] = {}
        self.after: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        self.before.setdefault(trainer.global_step, clone_state(trainer, module))

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if trainer.global_step - 1 in self.before and trainer.global_step - 1 not in self.after:
            self.after[trainer.global_step - 1] = clone_state(trainer, module)


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    weights = all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    if not weights or a["state"].keys() != b["state"].keys():
        return False
    for index, entry in a["state"].items():
        if entry.keys() != b["state"][index].keys():
            return False
        for key, value in entry.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][key])):
                return False
    return True


def fit_watched(
    module: pl.LightningModule, callbacks: list[Callback], steps: int, **trainer: Any
) -> pl.Trainer:
    states = StepStates()
    run = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, states],
        limit_val_batches=trainer.pop("limit_val_batches", 0),
        num_sanity_val_steps=0,
        **trainer,
    )
    run.fit(module, train_dataloaders=regressor_data(), val_dataloaders=regressor_data(32, seed=1))
    run.states = states  # type: ignore[attr-defined]
    return run


def dropped(trainer: pl.Trainer, step: int) -> bool:
    states: StepStates = trainer.states  # type: ignore[attr-defined]
    return same_state(states.before[step], states.after[step])
