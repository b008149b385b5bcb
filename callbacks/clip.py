"""Gradient clipping as a callback: the ``clip`` rung of ``lit-spikes recover``'s ladder,
named by class path like every other remedy."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks.common import check_finite_above


class ClipGradients(Callback):
    """Clips the gradient norm at ``value``: sets the Trainer's public
    ``gradient_clip_val`` in ``setup``, before the first step, so the run trains as
    ``Trainer(gradient_clip_val=value)`` does (Lightning reads it at every optimizer
    step; the Trainer's algorithm, by default the norm, is left as it is). Stateless: a
    resumed run clips only if it is given the callback again.

    Args:
        value: the largest gradient norm (> 0).
    """

    def __init__(self, value: float = 1.0) -> None:
        super().__init__()
        self.value = check_finite_above("value", value, 0.0)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.gradient_clip_val = self.value
