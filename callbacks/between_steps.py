"""Whether anything between two training steps can draw into the run: what decides if
``ExactResume`` keys that stretch of its own (docs/how-it-works.md, "Randomness").

Between the end of step k and the start of step k+1 run the callbacks' and the module's
``on_train_batch_end``, at an epoch's last batch their ``on_train_epoch_end``, a
validation (keyed and isolated on its own), the saves, and the next batch's fetch. A
``StepLoader`` keys its fetch itself; Lightning's and lit-spikes' own callbacks draw
nothing. So where nothing else runs there, a seed of its own would set three generators
(~25 us a step in a tiny step) that nothing reads before the next step sets them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_spikes.callbacks.common import trainer_callbacks
from lit_spikes.loader import StepLoader

HOOKS = ("on_train_batch_end", "on_train_epoch_end")
"""The hooks of a module or callback that run between two steps (a validation's are
keyed by the step on their own)."""
QUIET_PACKAGES = ("lightning.", "lit_spikes.")
"""Callbacks from these draw nothing between steps (they save, log, count and judge)."""


def draws_between_steps(
    trainer: pl.Trainer, module: pl.LightningModule, loaders: Sequence[Any]
) -> bool:
    """Whether user code may draw between two steps: a train loader other than a
    ``StepLoader`` (its next batch is read there), or a module or callback of the user's
    with one of ``HOOKS`` of its own."""
    if any(not isinstance(loader, StepLoader) for loader in loaders):
        return True
    if any(is_overridden(hook, module) for hook in HOOKS):
        return True
    for callback in trainer_callbacks(trainer):
        if type(callback).__module__.startswith(QUIET_PACKAGES):
            continue
        if any(is_overridden(hook, callback, parent=Callback) for hook in HOOKS):
            return True
    return False
