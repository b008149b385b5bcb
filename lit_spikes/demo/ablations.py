"""Callbacks that remove one part of a checkpoint on resume, to show what it is for.

They exist for demo 1 and the negative-control tests: a resume that forgets the
optimizer state, or the RNG state, is no longer the run it claims to continue.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks.exact_resume import STATE_KEY
from lit_spikes.randomness import derive


class ForgetOptimizerState(Callback):
    """Resume with a fresh AdamW: the checkpoint's moments and step counts are dropped.

    The learning rate still follows the restored schedule; only Adam's ``exp_avg``,
    ``exp_avg_sq`` and ``step`` start from zero, as if the checkpoint held parameters only.
    """

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Runs before Lightning restores the optimizers from this same dict.
        for optimizer_state in checkpoint["optimizer_states"]:
            optimizer_state["state"] = {}


class ForgetRNGState(Callback):
    """Resume without the checkpoint's seed: every step from the resume on draws from
    another seed's per-step streams, as a resume that kept no RNG state draws from
    whatever the process holds."""

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Runs before any callback's load_state_dict reads this same dict.
        state = checkpoint.get("callbacks", {}).get(STATE_KEY)
        if state is not None:
            state["seed_by_rank"] = [derive(seed, 1) for seed in state["seed_by_rank"]]
