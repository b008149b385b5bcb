"""Modules and data with a planted loss spike, none of them the project's: ``recover`` and
``diagnose`` are tested on these. Module-level, so another process (a resume, a
class path on a command line) imports them by name.

- ``JumpRegressor``: its own LR schedule jumps at a step (a state-caused spike: any data
  spikes there).
- ``StepRegressionData(poison=...)``: the targets of the rows of some data positions are
  scaled (a data-caused spike: skipping those positions removes it).
- ``FactRegressor``: states every ``ToolFacts`` the tools read (none the default).
- ``FaultyRegressor``: a one-off fault (a weight corrupted once, as a flipped bit would) at
  a step, which a replay does not meet again (not reproducible).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lit_spikes import StepLoader
from lit_spikes.tool_facts import Column, ToolFacts, Variant

FEATURES = 8


class RegressionRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``rows`` noisy samples of a fixed linear map (built from ``seed``); the targets of
    ``poisoned`` rows are multiplied by ``factor``; ``augment`` adds noise of that scale to
    a row's inputs at each read (drawn from the global torch RNG, as augmentation is)."""

    def __init__(
        self,
        rows: int,
        seed: int = 0,
        poisoned: Sequence[int] = (),
        factor: float = 30.0,
        augment: float = 0.0,
    ) -> None:
        self.augment = augment
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(rows, FEATURES, generator=generator)
        w = torch.randn(FEATURES, 1, generator=generator)
        self.y = self.x @ w + 0.1 * torch.randn(rows, 1, generator=generator)
        if poisoned:
            self.y[list(poisoned)] *= factor

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.augment:
            return self.x[index] + self.augment * torch.randn(FEATURES), self.y[index]
        return self.x[index], self.y[index]


class StepRegressionData(pl.LightningDataModule):
    """Regression rows served by a ``StepLoader``; ``poison`` names data positions whose
    batches get scaled targets. One data epoch covers ``rows // batch_size`` positions, so
    a run shorter than that meets each poisoned batch once.

    Args:
        rows: dataset rows (enough for the run's steps times ``batch_size``).
        batch_size: rows per step.
        seed: the data's and the order's seed.
        poison: data positions whose rows are poisoned.
        factor: what their targets are multiplied by.
        augment: the scale of the noise added to a row's inputs at each read.
    """

    def __init__(
        self,
        rows: int = 16384,
        batch_size: int = 32,
        seed: int = 0,
        poison: Sequence[int] = (),
        factor: float = 30.0,
        augment: float = 0.0,
    ) -> None:
        super().__init__()
        order = StepLoader(RegressionRows(rows, seed), batch_size, seed=seed)
        poisoned = [r for p in poison for r in order.rows_of_step(p)]
        self.loader = StepLoader(
            RegressionRows(rows, seed, poisoned, factor, augment), batch_size, seed=seed
        )

    def train_dataloader(self) -> StepLoader:
        return self.loader


class JumpRegressor(pl.LightningModule):
    """An MLP trained with SGD on regression rows; its LR schedule multiplies the LR by
    ``jump`` for ``jump_length`` steps from ``jump_step`` on (None: never). Logs ``loss``.

    Args:
        hidden: width of the hidden layer.
        lr: the LR outside the jump.
        jump_step: first global step of the jump (None: no jump).
        jump: the LR's factor during the jump.
        jump_length: steps the jump lasts.
        seed: the weights' seed.
    """

    def __init__(
        self,
        hidden: int = 32,
        lr: float = 0.1,
        jump_step: int | None = None,
        jump: float = 20.0,
        jump_length: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        torch.random.set_rng_state(generator_state)  # the weights' seed is not the run's

    def factor(self, step: int) -> float:
        """The LR schedule's factor at global step ``step``."""
        jump_step = self.hparams["jump_step"]
        if jump_step is not None and jump_step <= step < jump_step + self.hparams["jump_length"]:
            return float(self.hparams["jump"])
        return 1.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class CosineRegressor(JumpRegressor):
    """``JumpRegressor`` whose LR follows a cosine over the run's ``trainer.max_steps``, the
    common idiom: a replay of another length trains another schedule."""

    def factor(self, step: int) -> float:
        total = max(1, self.trainer.max_steps)
        return 0.5 * (1 + math.cos(math.pi * min(step, total) / total)) * super().factor(step)


class StepJumpCosineRegressor(CosineRegressor):
    """``CosineRegressor`` whose LR jumps by ``jump`` for ``jump_length`` steps from
    ``jump_step`` on, planted in ``optimizer_step`` (not in its schedule): state-caused."""

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        optimizer = self.trainer.optimizers[0]
        factor = super().factor(self.global_step)  # JumpRegressor's: the jump alone
        for group in optimizer.param_groups:
            group["lr"] *= factor
        super().optimizer_step(*args, **kwargs)
        for group in optimizer.param_groups:
            group["lr"] /= factor

    def factor(self, step: int) -> float:  # the schedule: the cosine alone
        total = max(1, self.trainer.max_steps)
        return 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


class ValidatedRegressionData(StepRegressionData):
    """``StepRegressionData`` with a validation loader (256 rows of the same problem)."""

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(RegressionRows(256, seed=0), batch_size=64)


class ValidatedRegressor(JumpRegressor):
    """``JumpRegressor`` that logs a validation loss, ``val_loss`` (recover compares its
    rows by it)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))


class PlateauRegressor(JumpRegressor):
    """``JumpRegressor`` validated (``val_loss``), whose LR a ReduceLROnPlateau on val_loss
    halves, checked every ``every`` steps (the validation interval): a replay that does not
    validate as the run did trains another LR."""

    def __init__(self, every: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.every = every

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        scheduler = {"scheduler": plateau, "interval": "step", "frequency": self.every,
                     "monitor": "val_loss"}  # fmt: skip
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class TrainLossRegressor(JumpRegressor):
    """``JumpRegressor`` that logs its loss as ``train_loss``, the common name."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss


class FaultyRegressor(JumpRegressor):
    """``JumpRegressor`` without a jump, whose first weight matrix is corrupted (scaled by
    ``fault_scale``) at the start of step ``fault_step``, once: the marker file
    ``fault_marker`` is written when it happens, and while it exists no fault happens
    again (a replay in this or another process meets none).

    Args:
        fault_step: the global step of the fault.
        fault_marker: the marker file's path.
        fault_scale: what the weights are multiplied by.
        **kwargs: ``JumpRegressor``'s arguments.
    """

    def __init__(
        self, fault_step: int, fault_marker: str, fault_scale: float = 25.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.fault_step, self.fault_marker = fault_step, Path(fault_marker)
        self.fault_scale = fault_scale

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.fault_step and not self.fault_marker.exists():
            self.fault_marker.write_text(f"fault at step {self.fault_step}\n")
            with torch.no_grad():
                self.net[0].weight.mul_(self.fault_scale)


class FactRegressor(JumpRegressor):
    """``JumpRegressor`` that states its ``ToolFacts``, none of them the defaults: its loss
    under its own tag, its own spike rule and warm-up, the run's end, a validation score
    where higher is better, and two extra columns: the largest LR after the spike (a key
    of the tools' own step records) and the largest weight norm, which it logs itself
    (``self.log``); and the fix aimed at its spike's cause as a comparison variant (no LR
    jump)."""

    def __init__(self, run_steps: int = 60, warmup_steps: int = 12, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_steps, self.warmup_steps = run_steps, warmup_steps

    @property
    def tool_facts(self) -> ToolFacts:
        return ToolFacts(
            curves={"loss": "fit/loss"},
            detector={"ratio": 4.0},
            val_metric="val_score",
            val_label="val score",
            val_mode="max",
            run_steps=self.run_steps,
            warmup_steps=self.warmup_steps,
            columns=(
                Column("lr", "largest LR", digits=2),
                Column("weight_norm", "largest weight norm", digits=2),
            ),
            variants=(Variant("no_jump", "no LR jump (from scratch)", {"jump": 1.0}),),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        norm = torch.linalg.vector_norm(self.net[0].weight.detach())
        self.log("weight_norm", norm, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_score", -nn.functional.mse_loss(self.net(x), y))
