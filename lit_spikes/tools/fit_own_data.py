"""What ``lit-spikes fit`` checks once the classes are built, that would otherwise fail
after the run's files were written: the module's and the data's own checks
(``ChecksItsRun``), and gradient accumulation on a ``StepLoader``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from lit_spikes.callbacks.exact_resume import one_batch_per_step_problem
from lit_spikes.tool_facts import ChecksItsRun


def check_run_of(
    stage: str, model: Any, datamodule: Any, trainer: Any, checkpoint: dict[str, Any] | None
) -> None:
    """The module's and the data module's own checks (``lit_spikes.ChecksItsRun``), in
    that order, where they have them: their ``ValueError`` refuses the run."""
    for owner in (model, datamodule):
        if isinstance(owner, ChecksItsRun):
            owner.check_run(
                stage, trainer, model=model, datamodule=datamodule, checkpoint=checkpoint
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
