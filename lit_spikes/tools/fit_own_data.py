"""What ``lit-spikes fit`` does for the project's own data (``StepDataModule``) once the
classes are built: checks that would otherwise come after files were written, and
``--trainer.max_epochs`` on its endless step stream. Applies to no other data module."""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

from lit_spikes.callbacks.batch_skipper import BatchSkipper
from lit_spikes.tools.cli_parsing import launched_rank
from lit_spikes.tools.defaults import StepDataModule


def check_skip_at_resume(checkpoint: dict[str, Any] | None, datamodule: Any, trainer: Any) -> None:
    """A skip position the checkpoint's run already passed is refused by the data
    module's ``load_state_dict``, but only once the fit restores it, after config.yaml
    and the events were written: the same check now (``ValueError``)."""
    state = None if checkpoint is None else checkpoint.get(StepDataModule.__qualname__)
    if not state or not isinstance(datamodule, StepDataModule):
        return
    probe = StepDataModule(datamodule.config)
    for callback in getattr(trainer, "callbacks", []):  # a BatchSkipper adds its in setup
        if isinstance(callback, BatchSkipper):
            probe.add_skip(callback.skip)
    with warnings.catch_warnings():  # its seed and config warnings come at the real load
        warnings.simplefilter("ignore")
        probe.load_state_dict(state)


def epochs_of_the_stream(config: Any, datamodule: Any, trainer: Any) -> None:
    """``--trainer.max_epochs`` honoured as Lightning does (the run ends at the first of
    max_steps and max_epochs): the step stream is endless, so an epoch here is as many
    steps as it takes to draw the training text's number of tokens, unless an int
    ``--trainer.limit_train_batches`` sets its length."""
    if not isinstance(datamodule, StepDataModule):
        return
    epochs = config["trainer"].get("max_epochs")
    if epochs is None or epochs < 1 or isinstance(trainer.limit_train_batches, int):
        return
    data = datamodule.config
    tokens = int(datamodule.train_tokens.numel())
    steps = max(1, math.ceil(tokens / (data.batch_size * data.block_size)))
    trainer.limit_train_batches = steps  # a Trainer attribute its fit loop reads
    if launched_rank() == 0:
        print(
            f"lit-spikes: --trainer.max_epochs {epochs}: an epoch here is {steps} steps "
            f"(the training text's {tokens} tokens / batch {data.batch_size} x "
            f"{data.block_size}); the run ends at step "
            f"{min(trainer.max_steps, epochs * steps)}, the first of max_steps and max_epochs",
            file=sys.stderr,
        )
