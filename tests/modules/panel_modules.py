"""A second kind of module for the diagnose panel (tests/modules/panel.py): a 1-D conv
regressor as a user writes one (AdamW, a linear warm-up then a cosine over the run's
``max_steps``, ``train_loss`` logged), on ``StepRegressionData``'s rows read as a
sequence. Two bugs can be planted in it, each state-caused by construction (any data
meets them): an LR jump for a few steps, and a loss-scale bug (the loss multiplied for a
few steps, as a forgotten AMP unscale or a wrong reduction would)."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from tests.modules.spiky_modules import FEATURES


class ConvRegressor(pl.LightningModule):
    """Conv1d(1, channels, 3) -> GELU -> mean over positions -> Linear, with AdamW.

    Args:
        channels: the conv's channels.
        lr: the peak LR.
        warmup: steps of the linear warm-up.
        jump_step: first step whose LR is ``jump`` times the schedule's (None: never).
        jump: the LR's factor there.
        scale_step: first step whose loss is ``scale`` times what it is (None: never).
        scale: the loss's factor there.
        bug_length: steps each bug lasts.
        seed: the weights' seed.
    """

    def __init__(
        self,
        channels: int = 16,
        lr: float = 0.01,
        warmup: int = 5,
        jump_step: int | None = None,
        jump: float = 30.0,
        scale_step: int | None = None,
        scale: float = 8.0,
        bug_length: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.conv = nn.Conv1d(1, channels, 3, padding=1)
        self.head = nn.Linear(channels, 1)
        torch.random.set_rng_state(state)  # the weights' seed is not the run's

    def _bug(self, start: int | None, factor: float) -> float:
        length = self.hparams["bug_length"]
        step = self.global_step
        return factor if start is not None and start <= step < start + length else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.gelu(self.conv(x.view(-1, 1, FEATURES)))  # (B, C, FEATURES)
        return self.head(hidden.mean(dim=2))  # (B, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        loss = loss * self._bug(self.hparams["scale_step"], self.hparams["scale"])
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def schedule(self, step: int) -> float:
        """The LR's factor at ``step``: linear warm-up, then a cosine to the run's end."""
        warmup, total = self.hparams["warmup"], max(1, self.trainer.max_steps)
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        factor = self._bug(self.hparams["jump_step"], self.hparams["jump"])
        groups = self.trainer.optimizers[0].param_groups
        for group in groups:
            group["lr"] *= factor
        super().optimizer_step(*args, **kwargs)
        for group in groups:
            group["lr"] /= factor

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
