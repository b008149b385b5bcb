"""Helpers the callbacks share."""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lit_spikes.data import StepDataModule


def step_record(pl_module: pl.LightningModule) -> dict[str, float]:
    """The current step's record (loss, max_logit, grad_norm, ...) from the module's history."""
    history: list[dict[str, float]] | None = getattr(pl_module, "history", None)
    if not history:
        raise RuntimeError(f"{type(pl_module).__name__} recorded no step yet")
    return history[-1]


def step_datamodule(trainer: pl.Trainer, owner: str) -> StepDataModule:
    """The Trainer's StepDataModule, or a clear error naming the callback that needs it."""
    datamodule = getattr(trainer, "datamodule", None)
    if not isinstance(datamodule, StepDataModule):
        raise TypeError(
            f"{owner} needs the Trainer to run with a StepDataModule (trainer.fit(..., "
            f"datamodule=StepDataModule(...))); got {type(datamodule).__name__}"
        )
    return datamodule


def module_history(pl_module: pl.LightningModule) -> list[dict[str, float]]:
    """The module's per-step records (``TinyGPTModule.history``); empty if it keeps none."""
    history: list[dict[str, float]] = getattr(pl_module, "history", [])
    return history


def trainer_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The Trainer's callbacks (typed: Lightning sets the attribute dynamically)."""
    callbacks: list[Callback] = getattr(trainer, "callbacks", [])
    return callbacks


def check_integer(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int if it is an integer (a NumPy one too; a bool is none) of at
    least ``minimum``; else a ValueError naming it. The int keeps state keys as they were
    (a NumPy integer would show as ``np.int64(10)``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def spelled_as_before_floats(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` as a callback's state key showed them before its number settings were
    kept as floats: a whole number given as an int (``ratio=2``) showed as ``2``."""
    whole = {k: int(v) for k, v in settings.items() if isinstance(v, float) and v.is_integer()}
    return settings | whole


def state_under_any(checkpoint: dict[str, Any], keys: list[str]) -> dict[str, Any] | None:
    """The first of ``keys`` that ``checkpoint`` holds a callback state under, or None."""
    states: dict[str, Any] = checkpoint.get("callbacks", {})
    return next((states[key] for key in keys if key in states), None)


def adopt_older_key(checkpoint: dict[str, Any], state_key: str, keys: list[str]) -> None:
    """For a callback's ``on_load_checkpoint``: Lightning looks for its state right after,
    under ``state_key`` and ``_legacy_state_key`` only; a state found under one of the
    older ``keys`` is put under ``state_key``."""
    state = state_under_any(checkpoint, [state_key, *keys])
    if state is not None:
        checkpoint.setdefault("callbacks", {})[state_key] = state


def check_finite_above(name: str, value: Any, bound: float, why: str = "") -> float:
    """``value`` as a float if it is a finite number above ``bound``; else a ValueError
    naming it (``why`` appended)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > bound):
        raise ValueError(f"{name}={value!r} must be a finite number > {bound:g}{why}")
    return float(value)


def unused_checkpoint_path(dirpath: Path, step: int) -> Path:
    """``<dirpath>/step=<step>.ckpt``, or ``step=<step>-v<n>.ckpt`` beside a file of that
    name from another run into this directory, as ModelCheckpoint names it."""
    path, version = dirpath / f"step={step}.ckpt", 0
    while path.exists():
        version += 1
        path = dirpath / f"step={step}-v{version}.ckpt"
    return path


def validates_at_this_step_anyway(trainer: pl.Trainer) -> bool:
    """Whether Lightning's schedule validates after this step, stop or no stop (its own
    rule, ``_TrainingEpochLoop._should_check_val_fx`` less the stop): a schedule in steps,
    per epoch or in total, and an epoch's last batch. A time-based one cannot be told
    ahead: True (nothing is skipped)."""
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return True
    epoch_loop = trainer.fit_loop.epoch_loop
    every_epochs, every = trainer.check_val_every_n_epoch, trainer.val_check_batch
    if every_epochs is not None and (trainer.current_epoch + 1) % every_epochs:
        return False  # not an epoch that validates
    if epoch_loop.batch_progress.is_last_batch:
        return True
    if not isinstance(every, int):  # inf: only at an epoch's end
        return False
    done = epoch_loop.total_batch_idx if every_epochs is None else epoch_loop.batch_idx
    return (done + 1) % every == 0
