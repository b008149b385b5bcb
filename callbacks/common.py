"""Helpers the callbacks share."""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


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


def ends_at_this_step(trainer: pl.Trainer) -> bool:
    """Whether the fit ends after this step anyway: ``max_steps`` reached, or the last
    batch of the last epoch (a run of epochs, with an int ``limit_train_batches``)."""
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    loop = trainer.fit_loop
    last_epoch = loop.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= loop.max_epochs
    return last_epoch and loop.epoch_loop.batch_progress.is_last_batch


def validates_at_this_step_anyway(trainer: pl.Trainer) -> bool:
    """Whether Lightning's schedule validates after this step, stop or no stop (the rule
    of Lightning's training epoch loop's validation check, less the stop): a schedule in
    steps, per epoch or in total, and an epoch's last batch. A time-based one cannot be
    told ahead: True (nothing is skipped)."""
    if trainer.val_check_batch is None:  # what Lightning's fit loop sets for a time-based one
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


def step_validates(trainer: pl.Trainer) -> bool:
    """Whether the run's schedule validates after this step: Lightning's rule less a stop
    (``validates_at_this_step_anyway``). A time-based ``val_check_interval`` is no function
    of the step: nothing is said to be due, nothing replayed."""
    timed = trainer.val_check_batch is None  # what Lightning's fit loop sets for one
    # The schedule first: enable_validation looks up validation_step's override (~7 us).
    return not timed and validates_at_this_step_anyway(trainer) and trainer.enable_validation


def make_state_key(callback: object, **settings: Any) -> str:
    """A callback's ``state_key``: its class name, then its settings (``Name{'a': 1}``),
    in the form Lightning's own callbacks give theirs, so that checkpoints written with
    Lightning's helper still load, and ``lit-spikes fit`` rebuilds a callback from it."""
    return f"{type(callback).__qualname__}{settings!r}"
