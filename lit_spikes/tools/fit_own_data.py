"""What ``lit-spikes fit`` checks of the data once the classes are built, that would
otherwise fail after the run's files were written, and ``--trainer.max_epochs`` on the
project's endless step stream (``StepDataModule``)."""

from __future__ import annotations

import math
import random
import sys
import warnings
from typing import Any

import numpy as np
import torch

from lit_spikes.callbacks.batch_skipper import BatchSkipper
from lit_spikes.callbacks.exact_resume import one_batch_per_step_problem
from lit_spikes.tools.cli_parsing import launched_rank
from lit_spikes.tools.demo_seam import StepDataModule


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


def check_accumulation(model: Any, datamodule: Any, accumulate: int) -> None:
    """``accumulate_grad_batches`` other than 1 with a ``StepLoader`` (refused by
    ``ExactResume`` at the first step, after config.yaml, the events and hparams.yaml were
    written): the same check now, on the train loader built ahead (``ValueError``). Only
    then is it built, with every RNG put back after: building it may draw (a split)."""
    if accumulate == 1:
        return
    owner = datamodule if datamodule is not None else model
    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            loaders = owner.train_dataloader()
        except Exception:  # it needs its setup first: ExactResume checks at the first step
            return
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])
    flat = list(loaders.values()) if isinstance(loaders, dict) else loaders
    problem = one_batch_per_step_problem(accumulate, flat if isinstance(flat, list) else [flat])
    if problem is not None:
        raise ValueError(problem)
