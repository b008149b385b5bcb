"""``lit-spikes recover`` on the tiny model with planted bad batches, and what the recover
tests on other modules share."""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lit_spikes.demo.data import DataConfig
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import OptimConfig
from lit_spikes.tools.recover import RecoverConfig, RecoverResult
from tests.conftest import TINY_DATA, TINY_GPT, TINY_OPTIM, assert_states_equal, load_ckpt

N = 60


POISON = (28, 47)
"""Two planted bad batches (random characters): the first spikes at step 28; after the
first accepted skip window (6 positions) the second is trained at step 41."""


RUNGS = {
    "skip_data": "lit_spikes.callbacks.BatchSkipper",
    "scale_lr": "lit_spikes.callbacks.LRScaler",
    "skip_step": "lit_spikes.callbacks.SkipStep",
    "clip": "lit_spikes.callbacks.ClipGradients",
}
"""The built-in rungs by the names of their branches (``spike<n>/<name>``)."""


SKIP_LENGTH = 6


def ladder(
    *names: str,
    skip_before: int = 2,
    skip_length: int = SKIP_LENGTH,
    lr_factor: float = 0.5,
    skip_step_window: int = 50,
) -> tuple[dict[str, Any], ...]:
    """The rungs ``names`` with these tests' options."""
    options: dict[str, dict[str, Any]] = {
        "skip_data": {"before": skip_before, "length": skip_length},
        "scale_lr": {"factor": lr_factor},
        "skip_step": {"sigma": 6.0, "window": skip_step_window},
        "clip": {"value": 1.0},
    }
    return tuple({"class_path": RUNGS[name], "init_args": options[name]} for name in names)


def tiny_config(
    log_root: Path,
    optim: OptimConfig | None = None,
    data: DataConfig | None = None,
    gpt: GPTConfig = TINY_GPT,
    names: tuple[str, ...] = ("scale_lr", "skip_data", "skip_step", "clip"),  # scale_lr fails
    rung_options: dict[str, Any] | None = None,
    **changes: Any,
) -> RecoverConfig:
    """The tiny model on planted bad batches; ``names`` and ``rung_options``: its ladder."""
    optim = optim or replace(TINY_OPTIM, max_steps=N, warmup_steps=4)
    data = data or replace(TINY_DATA, poison=POISON)
    model = {
        "class_path": "lit_spikes.demo.module.TinyGPTModule",
        "init_args": {"gpt": asdict(gpt), "optim": asdict(optim), "model_seed": 0},
    }
    values: dict[str, Any] = {
        "log_root": log_root,
        "model": model,
        "data": {
            "class_path": "lit_spikes.demo.data.StepDataModule",
            "init_args": {"config": data},
        },
        "checkpoint_every": 10,
        "val_every": 20,
        "rollback_distance": 5,
        "ladder": ladder(*names, **(rung_options or {})),
        "accept_margin": 5,
    }
    return RecoverConfig(**{**values, **changes})


def scale_lr(factor: float) -> dict[str, Any]:
    return {"class_path": "lit_spikes.callbacks.LRScaler", "init_args": {"factor": factor}}


def weights(path: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True)[
        "state_dict"
    ]
    return state


class Crash(Callback):
    """Raises at the start of global step ``step``: a crash in the middle of a branch."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected crash at step {self.step}")


def steps_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "step" in r]


def assert_same_outcome(result: RecoverResult, reference: RecoverResult) -> None:
    """Same decisions, same counts, same lineage losses, bit-equal final state."""
    for got, want in zip(result.ledger.interventions, reference.ledger.interventions, strict=True):
        assert (got.spike["step"], got.ckpt_step, got.tried, got.accepted, got.outcomes) == (
            want.spike["step"],
            want.ckpt_step,
            want.tried,
            want.accepted,
            want.outcomes,
        )
    got_totals, want_totals = result.ledger.totals, reference.ledger.totals
    assert got_totals is not None and want_totals is not None
    for name in ("lineage", "steps_trained", "steps_recomputed", "batches_skipped", "val"):
        assert getattr(got_totals, name) == getattr(want_totals, name), name
    assert [(r["step"], r["loss"]) for r in steps_of(result.lineage)] == [
        (r["step"], r["loss"]) for r in steps_of(reference.lineage)
    ]
    assert_states_equal(load_ckpt(result.final_ckpt), load_ckpt(reference.final_ckpt))


class SignalSelf(Callback):
    """Sends its own process ``signum`` at the start of global step ``step``."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)
