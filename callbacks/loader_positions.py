"""Which train loaders a resume positions: ExactResume seeks every ``StepLoader``; any
other loader it can only warn about, before the first step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from lit_spikes.loader import StepLoader


def train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The Trainer's train loaders, flattened from what ``trainer.train_dataloader`` holds."""
    loaders: Any = trainer.train_dataloader
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, Sequence) else [loaders]


def _sampler_of(loader: Any) -> Any:
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)


def positionable(loader: Any) -> bool:
    """Whether a resume can put ``loader`` where the checkpoint's run was: a StepLoader
    (ExactResume seeks it), or a loader whose position Lightning saves and restores
    (``state_dict``/``load_state_dict``: torchdata's StatefulDataLoader)."""
    stateful = callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )
    return isinstance(loader, StepLoader) or stateful


def position_warnings(trainer: pl.Trainer) -> list[str]:
    """One warning per train loader a resume at ``trainer.global_step`` cannot position:
    mid-epoch, a loader that neither ExactResume nor Lightning can seek restarts its epoch;
    at an epoch's start, a random sampler draws the epoch's order from a generator (its own,
    or the global RNG when Lightning makes the iterator, before the checkpoint's RNG states
    are restored) that is not where the uninterrupted run's was."""
    batches = trainer.num_training_batches
    per_epoch = 0 if math.isinf(batches) else math.ceil(batches / trainer.accumulate_grad_batches)
    mid_epoch = per_epoch == 0 or trainer.global_step % per_epoch != 0
    texts = []
    for loader in train_loaders(trainer):
        if positionable(loader):
            continue
        sampler = _sampler_of(loader)
        if not mid_epoch and not _random(sampler):
            continue
        step = trainer.global_step
        if per_epoch == 0:
            where = f"at step {step} (without a length: no epoch's start to resume at)"
        elif mid_epoch:
            where = f"mid-epoch (step {step}, {per_epoch} steps an epoch)"
        else:
            where = (
                f"at an epoch's start (step {step}) with a {type(sampler).__name__}, whose "
                "order of the epoch is drawn anew"
            )
        texts.append(
            f"ExactResume: the train loader ({type(loader).__name__}) is resumed {where} and "
            "cannot be positioned: it is no StepLoader and has no state_dict/load_state_dict, "
            "so the resumed run trains on other batches than the uninterrupted run; fix: "
            "StepLoader (from lit_spikes import StepLoader) or torchdata's "
            "StatefulDataLoader, whose position the checkpoint holds"
        )
    return texts


def _random(sampler: Any) -> bool:
    return isinstance(sampler, RandomSampler | SubsetRandomSampler | WeightedRandomSampler)
