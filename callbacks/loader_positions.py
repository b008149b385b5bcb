"""Which train loaders a resume positions: ExactResume seeks every ``StepLoader``; any
other loader it can only warn about, before the first step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lit_spikes.loader import StepLoader
from lit_spikes.randomness import derive


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


def steps_per_epoch(trainer: pl.Trainer) -> int:
    """Optimizer steps an epoch of the train loaders takes (0: no length, no epochs)."""
    batches = trainer.num_training_batches
    return 0 if math.isinf(batches) else math.ceil(batches / trainer.accumulate_grad_batches)


def rebuilt_at_resume(loaders: list[Any]) -> bool:
    """Whether building the iterators anew is what the run did: some loader draws as its
    iterator is built (not a ``StepLoader``, whose reads are keyed by the step), and none
    holds a position Lightning restored into it (a second iterator would lose it)."""
    plain = [loader for loader in loaders if not isinstance(loader, StepLoader)]
    return bool(plain) and not any(positionable(loader) for loader in plain)


def position_warnings(trainer: pl.Trainer) -> list[str]:
    """One warning per train loader a resume at ``trainer.global_step`` cannot position:
    mid-epoch, a loader that neither ExactResume nor Lightning can seek restarts its epoch.
    At an epoch's start a plain loader's iterator is built anew after the epoch's keying
    (``resumed_epoch``), as the uninterrupted run built it: its order and its workers'
    seeds are the run's. What that cannot give back is named: workers kept across epochs
    (``persistent_workers``), whose random streams went on from the epochs before, and a
    plain loader beside one whose position Lightning restored (not built anew)."""
    per_epoch = steps_per_epoch(trainer)
    step = trainer.global_step
    mid_epoch = per_epoch == 0 or step % per_epoch != 0
    loaders = train_loaders(trainer)
    texts = []
    rebuilt = not mid_epoch and rebuilt_at_resume(loaders)
    for loader in loaders:
        if positionable(loader):
            continue
        if rebuilt:  # its order and workers' seeds are the run's; their streams may not be
            texts += [_persistent_text(loader, step)] if persistent(loader) else []
            continue
        if mid_epoch:
            where = (
                f"at step {step} (without a length: no epoch's start to resume at)"
                if per_epoch == 0
                else f"mid-epoch (step {step}, {per_epoch} steps an epoch)"
            )
        else:
            where = (
                f"at an epoch's start (step {step}) beside a loader whose position Lightning "
                "restored, so its iterator is not built anew where the run built it"
            )
        texts.append(
            f"ExactResume: the train loader ({type(loader).__name__}) is resumed {where} and "
            "cannot be positioned: it is no StepLoader and has no state_dict/load_state_dict, "
            "so the resumed run trains on other batches than the uninterrupted run; fix: "
            "StepLoader (from lit_spikes import StepLoader) or torchdata's "
            "StatefulDataLoader, whose position the checkpoint holds"
        )
    return texts


def persistent(loader: Any) -> bool:
    """Whether ``loader`` keeps worker processes from one epoch to the next."""
    workers = getattr(loader, "num_workers", 0)
    return bool(getattr(loader, "persistent_workers", False)) and workers > 0


def _persistent_text(loader: Any, step: int) -> str:
    return (
        f"ExactResume: the train loader ({type(loader).__name__}) keeps its "
        f"{loader.num_workers} workers across epochs (persistent_workers=True): resumed at "
        f"an epoch's start (step {step}) they start anew, so what its dataset draws in them "
        "(augmentation in __getitem__) is not what the uninterrupted run's workers drew, "
        "whose random streams went on from the epochs before; fix: persistent_workers=False "
        "(each epoch's workers are then seeded where the run seeded them), or StepLoader "
        "(from lit_spikes import StepLoader), which keys each row's draws by the step"
    )


def loader_generators(loaders: list[Any]) -> list[torch.Generator]:
    """The ``torch.Generator``s the plain train loaders draw from as an epoch's iterator
    is built (the workers' base seed) and in its sampler (a shuffle's order), each once."""
    found: list[torch.Generator] = []
    for loader in loaders:
        if isinstance(loader, StepLoader):
            continue
        sampler = _sampler_of(loader)
        for owner in (loader, sampler, getattr(loader, "sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
                found.append(generator)
    return found


class LoaderGenerators:
    """The plain train loaders' own generators, each keyed from the seed it had when
    first seen in the fit (as a module's are: the user's seed still decides them)."""

    def __init__(self) -> None:
        self._seeds: dict[int, tuple[torch.Generator, int]] = {}  # by id, kept alive

    def seed(self, loaders: list[Any], *key: int) -> None:
        """Set each from ``derive(its seed, *key)``."""
        for generator in loader_generators(loaders):
            _, seed = self._seeds.setdefault(id(generator), (generator, generator.initial_seed()))
            generator.manual_seed(derive(seed, *key))
