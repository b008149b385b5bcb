"""In-memory snapshots of a model and its optimizer, safe against the seed's pitfall.

``optimizer.state_dict()`` returns references to the live state tensors, and
``optimizer.load_state_dict`` keeps references to the tensors it is given when dtype
and device already match. A snapshot kept without copying is therefore silently
rewritten by the training that follows, and restoring the same snapshot twice gives
two different runs. Both functions here copy, so a snapshot never changes.
A checkpoint read back from disk does not have this problem. A snapshot also keeps the
RNG states (dropout masks): a restore continues them, as a checkpoint's resume does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_spikes.randomness import collect_rng_states, set_rng_states


@dataclass(frozen=True)
class Snapshot:
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    step: int
    rng: dict[str, Any] | None = None
    """The process's RNG states when it was taken (``collect_rng_states``)."""


def take_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Snapshot:
    """A deep copy of the model's and the optimizer's state at ``step``, and the RNGs'."""
    return Snapshot(
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(optimizer.state_dict()),
        step,
        copy.deepcopy(collect_rng_states()),
    )


def restore_snapshot(
    snapshot: Snapshot, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Load ``snapshot`` into ``model``, ``optimizer`` and the RNGs without sharing any
    tensor with it."""
    model.load_state_dict(snapshot.model)  # copies values into the parameters
    optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))  # would alias otherwise
    if snapshot.rng is not None:
        set_rng_states(copy.deepcopy(snapshot.rng))
