"""The values the lit-spikes callbacks watch, measured once a step for all of them.

A name is ``"loss"`` (what ``training_step`` returns), ``"grad_norm"`` (the total L2 norm
of the gradients before any clipping, measured here) or a key of
``trainer.callback_metrics`` (what the module logs with ``self.log``, as ``EarlyStopping``
reads it). Under several processes the values of every watched name of every watching
callback are gathered from all ranks in one ``all_gather`` per step.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

LOSS, GRAD_NORM = "loss", "grad_norm"


def monitor_names(monitor: str | Sequence[str], owner: str) -> tuple[str, ...]:
    """``monitor`` as a tuple of non-empty names, or a ValueError naming ``owner``."""
    names = (monitor,) if isinstance(monitor, str) else tuple(monitor)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"{owner}(monitor={monitor!r}): give a name or a list of names: 'loss', "
            "'grad_norm' or a key the module logs with self.log"
        )
    return names


class Watcher(Callback):
    """A callback that judges steps by watched values (``monitors``)."""

    monitors: tuple[str, ...] = ()


@dataclass
class _Step:
    step: int
    loss: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    gathered: dict[str, list[float | None]] = field(default_factory=dict)
    """Each rank's value of each name gathered so far (None where a rank had none)."""
    missing: set[str] = field(default_factory=set)
    """Names no rank had when they were gathered."""


_STEPS: weakref.WeakKeyDictionary[pl.Trainer, _Step] = weakref.WeakKeyDictionary()


def _record(trainer: pl.Trainer, step: int) -> _Step:
    record = _STEPS.get(trainer)
    if record is None or record.step != step:
        record = _STEPS[trainer] = _Step(step)
    return record


def note_loss(trainer: pl.Trainer, loss: torch.Tensor) -> None:
    """Keep the loss of the step being trained (``on_before_backward``)."""
    _record(trainer, trainer.global_step).loss = loss.detach()


def note_grad_norm(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Measure the gradient norm of the step being trained once, before any clipping or
    skip drops it (``on_before_optimizer_step``)."""
    record = _record(trainer, trainer.global_step)
    if record.grad_norm is None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            record.grad_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def _local(record: _Step, trainer: pl.Trainer, name: str, outputs: Any) -> float | None:
    value: Any
    if name == LOSS:
        value = record.loss
        if value is None and isinstance(outputs, dict):
            value = outputs.get("loss")
    elif name == GRAD_NORM:
        value = record.grad_norm
    else:
        value = trainer.callback_metrics.get(name)
    if isinstance(value, torch.Tensor):
        return float(value.detach().float()) if value.numel() == 1 else None
    return float(value) if isinstance(value, int | float) else None


def _all_monitors(trainer: pl.Trainer) -> list[str]:
    names: list[str] = []
    callbacks: list[Callback] = getattr(trainer, "callbacks", [])  # set on it, untyped
    for callback in callbacks:
        if isinstance(callback, Watcher):
            names += [n for n in callback.monitors if n not in names]
    return names


def rank_values(
    trainer: pl.Trainer, step: int, names: Sequence[str], outputs: Any = None
) -> dict[str, list[float | None]]:
    """Each rank's value of each of ``names`` at ``step`` (None for a rank that had none),
    in rank order; a name no rank had is left out. Gathered once a step for the names of
    every watching callback of the Trainer, the same on every rank."""
    record = _record(trainer, step)
    # Every watcher's names at once (one gather a step), but none found missing already,
    # unless asked for again (a metric logged after the first gather of the step).
    wanted = [n for n in _all_monitors(trainer) if n not in record.missing]
    wanted = [n for n in dict.fromkeys([*wanted, *names]) if n not in record.gathered]
    if wanted:
        local = [_local(record, trainer, n, outputs) for n in wanted]
        row = [[math.nan if v is None else v for v in local], [float(v is not None) for v in local]]
        if trainer.world_size == 1:
            ranks = [row]
        else:
            # On the strategy's device: NCCL gathers only tensors on the GPU.
            mine = torch.tensor(row, dtype=torch.float64, device=trainer.strategy.root_device)
            gathered = trainer.strategy.all_gather(mine).reshape(trainer.world_size, 2, -1)
            ranks = gathered.tolist()
        for index, name in enumerate(wanted):
            if any(rank[1][index] for rank in ranks):
                record.gathered[name] = [r[0][index] if r[1][index] else None for r in ranks]
                record.missing.discard(name)
            else:
                record.missing.add(name)
    return {n: record.gathered[n] for n in names if n in record.gathered}


def reduce_ranks(values: list[float | None], how: str) -> float:
    """One value from the ranks' that have one (``how``: ``"mean"`` of equal shards, or
    ``"max"``), in rank order, so every rank computes the same float; NaN anywhere makes
    it NaN."""
    present = [v for v in values if v is not None]
    if any(math.isnan(v) for v in present):
        return math.nan
    return max(present) if how == "max" else sum(present) / len(present)
