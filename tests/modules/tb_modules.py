"""Modules written for the TensorBoard tests (issue 65): a conv regressor that logs its
loss as a user chooses to, and validates, so the spike marks must find the user's chart
whatever the module logs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.modules.panel_modules import ConvRegressor


class ChartedConv(ConvRegressor):
    """``ConvRegressor`` logging its training loss as ``log_as`` (None: not at all, the
    loss only returned), on step and epoch where ``on_epoch`` (Lightning then logs
    ``<log_as>_step``), and ``val_loss`` in validation.

    Args:
        log_as: the name of the logged training loss (None: not logged).
        on_epoch: also log its epoch mean.
        **kwargs: ``ConvRegressor``'s.
    """

    def __init__(self, log_as: str | None = "train_loss", on_epoch: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.log_as, self.on_epoch = log_as, on_epoch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.log_as is not None:
            self.log(self.log_as, loss, on_step=True, on_epoch=self.on_epoch)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))
