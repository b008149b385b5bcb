"""PreemptionCheckpoint beside a user's own ModelCheckpoints: a signal leaves the files
the run would have written at that step anyway, and one more only where none of them
holds the step (a step off their interval); never a second copy of one step
(``step=<k>-v1.ckpt``). Resuming from ``saved_path`` continues bit-exactly. On plain
modules written for the tests (tests/guarantee_modules.py) in a plain Trainer."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lit_spikes.callbacks import PreemptionCheckpoint
from lit_spikes.callbacks.common import trainer_callbacks, validates_at_this_step_anyway
from lit_spikes.callbacks.preemption import _requeue_signal
from tests.conftest import load_ckpt
from tests.modules.guarantee_modules import BATCH, PlantedMetric, rows, step_loader

STEPS, EVERY = 12, 5
ON, OFF = 10, 7  # a signal at a step of the ModelCheckpoints' interval, and off it
SCORES = [float(s) for s in range(STEPS + 1)]  # logged as "score": each step the best


class SignalAt(Callback):
    """Sets the preemption flag in step ``step``'s end, as its signal handler does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            callbacks = trainer_callbacks(trainer)
            (preemption,) = [c for c in callbacks if isinstance(c, PreemptionCheckpoint)]
            preemption.received = signal.SIGTERM


def _every(dirpath: Path, **kwargs: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath, every_n_train_steps=EVERY, **kwargs)


# Each: the user's ModelCheckpoints (given the preemption's directory and another), and
# the names in the preemption's directory that hold step 10 (a step of their interval).
SETUPS: dict[str, tuple[Callable[[Path, Path], list[ModelCheckpoint]], set[str]]] = {
    "step names, as lit-spikes' own": (
        lambda d, _: [_every(d, filename="{step}", save_top_k=-1)],
        {"step=10.ckpt"},
    ),
    "a monitor, Lightning's default names": (
        lambda d, _: [_every(d, monitor="score", mode="max", save_top_k=2)],
        {"epoch=0-step=10.ckpt"},
    ),
    "a monitor's best kept under one name": (
        lambda d, _: [_every(d, monitor="score", mode="max", filename="best")],
        {"best.ckpt"},
    ),
    "save_last": (
        lambda d, _: [_every(d, filename="{step}", save_last=True)],
        {"step=10.ckpt", "last.ckpt"},
    ),
    "two of one directory": (
        lambda d, _: [
            _every(d, filename="{step}", save_top_k=-1),
            _every(d, monitor="score", mode="max", filename="best-{step}"),
        ],
        {"step=10.ckpt", "best-step=10.ckpt"},
    ),
    "one of another directory": (
        lambda _, other: [_every(other, filename="{step}", save_top_k=-1)],
        set(),
    ),
    "Lightning's default, at each epoch's end": (
        lambda d, _: [ModelCheckpoint(d)],  # the stop ends the epoch: it would save there
        set(),
    ),
    "weights only": (
        lambda d, _: [_every(d, filename="weights-{step}", save_weights_only=True)],
        {"weights-step=10.ckpt"},
    ),
}


def train(
    root: Path,
    setup: str,
    steps: int,
    signal_at: int | None = None,
    ckpt: Path | None = None,
) -> tuple[pl.Trainer, PreemptionCheckpoint, list[ModelCheckpoint]]:
    preemption = PreemptionCheckpoint(root / "ckpt")
    savers = SETUPS[setup][0](root / "ckpt", root / "other")
    extra: Sequence[Callback] = [] if signal_at is None else [SignalAt(signal_at)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[preemption, *extra, *savers],
    )
    trainer.fit(PlantedMetric(SCORES), train_dataloaders=step_loader(), ckpt_path=ckpt)
    return trainer, preemption, savers


def holding(directory: Path, step: int) -> set[str]:
    """The names of the files in ``directory`` that hold global step ``step``."""
    return {p.name for p in directory.glob("*.ckpt") if load_ckpt(p)["global_step"] == step}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's weights and optimizer state (the setups do not change them)."""
    trainer, _, _ = train(tmp_path_factory.mktemp("straight"), "save_last", STEPS)
    return _state(trainer)


def _state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    state = dict(trainer.lightning_module.state_dict())
    for i, values in enumerate(trainer.optimizers[0].state.values()):
        state |= {f"optimizer.{i}.{name}": value for name, value in values.items()}
    return state


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("at", [ON, OFF])
def test_a_signal_leaves_one_file_of_its_step_and_its_resume_is_exact(
    tmp_path: Path, setup: str, at: int, straight: dict[str, torch.Tensor]
) -> None:
    trainer, preemption, savers = train(tmp_path, setup, STEPS, signal_at=at)
    assert trainer.global_step == at
    theirs = SETUPS[setup][1] if at == ON else set()
    weights_only = {n for n in theirs if n.startswith("weights")}
    full = theirs - weights_only - {"last.ckpt"}
    # The preemption's own file only where no full file of the user's holds the step.
    ours = {f"step={at}.ckpt"} if not full else set()
    assert holding(tmp_path / "ckpt", at) == theirs | ours
    assert preemption.saved_path is not None
    assert preemption.saved_path.parent == tmp_path / "ckpt"
    assert preemption.saved_path.name in (ours or full)
    # The settings the stop changed are back, for a later fit with these callbacks.
    again = SETUPS[setup][0](tmp_path, tmp_path)
    assert [(s.save_top_k, s.save_last) for s in savers] == [
        (s.save_top_k, s.save_last) for s in again
    ]
    resumed, _, _ = train(tmp_path / "resumed", setup, STEPS, ckpt=preemption.saved_path)
    state = _state(resumed)
    assert state.keys() == straight.keys()
    assert [k for k, v in straight.items() if not torch.equal(v, state[k])] == []


def test_a_time_based_validation_schedule_keeps_lightnings_validation_at_the_stop(
    tmp_path: Path,
) -> None:
    """Whether a time-based ``val_check_interval`` validates at a step cannot be told
    ahead: the stop keeps Lightning's validation (it skips it where it knows the step
    does not validate)."""
    seen: dict[str, Any] = {}

    class Validated(PlantedMetric):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.forward_loss(*batch)

    class Validations(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            seen.setdefault("anyway", validates_at_this_step_anyway(trainer))

        def on_validation_start(self, trainer: pl.Trainer, *args: Any) -> None:
            seen.setdefault("validated", []).append(trainer.global_step)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        val_check_interval="00:01:00:00",  # an hour: never due in this run
        limit_val_batches=1,
        callbacks=[Validations(), SignalAt(3), PreemptionCheckpoint(tmp_path)],
    )
    trainer.fit(Validated(SCORES), step_loader(), DataLoader(rows(), batch_size=BATCH))
    assert seen == {"anyway": True, "validated": [3]}


@pytest.mark.parametrize(
    ("plugins", "held"),
    [
        ([], None),
        ([SLURMEnvironment()], signal.SIGUSR1),
        ([SLURMEnvironment(auto_requeue=False)], None),
        ([SLURMEnvironment(requeue_signal=signal.SIGHUP)], signal.SIGHUP),
    ],
)
def test_the_requeue_signal_held_is_the_one_of_the_trainers_cluster_environment(
    plugins: list[Any], held: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one device too, where the strategy has no ``cluster_environment`` to ask (the
    reason PreemptionCheckpoint reads the accelerator connector's)."""
    for name in [n for n in os.environ if n.startswith("SLURM_")] + ["TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(name, raising=False)  # a suite run under SLURM: not detected
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, plugins=plugins or None)
    assert not hasattr(trainer.strategy, "cluster_environment")
    assert _requeue_signal(trainer) == held
