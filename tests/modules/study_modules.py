"""What the study's tests (issue 66) run: modules of the tests' own (an MLP regressor,
a conv regressor, each seeded by its ``seed`` argument and validated by ``val_loss``) on
regression data with one poisoned batch, and a module whose resume is not exact, the
control that the study's exact-resume finding can fail."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.modules.tb_modules import ChartedConv

RUN_ARGS = [
    "--data", "tests.modules.spiky_modules.ValidatedRegressionData",
    "--data.init_args.poison", "[35]",
    "--seed_args", "[model.seed]",
    "--max_steps", "60", "--checkpoint_every", "10", "--val_every", "20",
    "--detector.ratio", "3", "--detector.window", "10", "--rollback_distance", "5",
]  # fmt: skip
"""A study's run: batch 35 poisoned (every seed spikes there, data-caused), 60 steps, the
reference's checkpoints every 10, each seed given to the model's ``seed``."""
STUDY_ARGS = [
    "--model", "tests.modules.spiky_modules.ValidatedRegressor", *RUN_ARGS,
    "--sweep.lr_arg", "model.lr", "--sweep.variant", "{hidden: 128}",
]  # fmt: skip
"""``lit-spikes study`` on ``ValidatedRegressor`` (an MLP trained with SGD, validated by
``val_loss``), its LR swept with and without a 4x wider hidden layer."""


class CountingConv(ChartedConv):
    """``ChartedConv`` scaling its inputs by a count of the steps it trained in this
    process, which no checkpoint holds (a plain attribute): a resume counts from 0 again,
    so it trains on other inputs and is not exact."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trained = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.trained += 1
        x = x * (1 + 1e-3 * self.trained)
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss
