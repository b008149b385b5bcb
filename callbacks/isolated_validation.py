"""A validation inside a fit leaves the process's host RNGs as it found them (issue 62).

Lightning fetches a step's batch at the start of that step's loop turn, before its
``on_train_batch_start``, from the host RNGs as the turn before left them: a plain
``DataLoader`` read in this process augments its rows with what a validation after the
previous step drew (12 of 16 tensors differed). ``on_validation_start`` is too late to
keep them: the validation loop creates its loader's iterator, which draws its base seed
from torch's RNG, before any hook; and a restart from a file written before its step's
validation builds that iterator too, as the first batch is fetched (Lightning's
``increment_progress_to_evaluation_end``). So the fit's validation loop runs inside
``kept_rng_states``: its ``run`` and that method are wrapped on the loop object for the fit
(``trainer.fit_loop.epoch_loop.val_loop``, public attributes of Lightning's loops; no
public hook surrounds a validation) and unwrapped at teardown. Its own randomness stays
keyed by the step (``ExactResume.on_validation_start``); CUDA's RNGs are left alone (a
batch is read on the host, and each step seeds them at its start).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lit_spikes.randomness import kept_rng_states

WRAPPED = ("run", "increment_progress_to_evaluation_end")
"""The validation loop's methods that draw: a validation, and Lightning's restart
fast-forwarding past one the file's step ran (it builds the loader's iterator too)."""


def isolate_validations(trainer: pl.Trainer) -> Callable[[], None]:
    """Wrap the fit's validation loop's drawing methods in ``kept_rng_states``; returns
    the unwrapping."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    if "run" in vars(loop):
        return lambda: None  # wrapped already (one ExactResume per Trainer)
    for name in WRAPPED:
        setattr(loop, name, _kept(getattr(loop, name)))

    def unwrap() -> None:
        for name in WRAPPED:
            vars(loop).pop(name, None)

    return unwrap


def _kept(method: Callable[[], Any]) -> Callable[[], Any]:
    def kept() -> Any:
        with kept_rng_states():
            return method()

    return kept
