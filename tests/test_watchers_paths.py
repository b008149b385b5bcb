"""SpikeDetector and SkipStep judge what happened (issue 32 items 1-4), on modules written
for the test: a NaN step's update is dropped at any step; a logged key is judged only at
the steps that logged it; an accumulated step is judged from all its micro-batches; two
optimizers under manual optimization are refused by SkipStep."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_spikes.callbacks import SkipStep, SpikeDetector

FEATURES = 8


def _data(rows: int = 512, seed: int = 0) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator)
    y = x @ torch.randn(FEATURES, 1, generator=generator) + 0.1 * torch.randn(
        rows, 1, generator=generator
    )
    return DataLoader(TensorDataset(x, y), batch_size=8)


class Regressor(pl.LightningModule):
    """A small MLP; ``poison`` multiplies the loss of a batch (by its index) by a factor;
    ``sparse_every`` logs ``sparse`` every so many steps; validation logs ``val_loss``."""

    def __init__(
        self,
        optimizer: str = "adamw",
        poison: dict[int, float] | None = None,
        sparse_every: int = 0,
        sparse_poison: dict[int, float] | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer, self.poison = optimizer, poison or {}
        self.sparse_every, self.sparse_poison = sparse_every, sparse_poison or {}
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y) * self.poison.get(batch_idx, 1.0)
        self.losses.append(float(loss.detach()))
        step = self.trainer.global_step
        if self.sparse_every and step % self.sparse_every == 0:
            self.log("sparse", loss.detach() * self.sparse_poison.get(step, 1.0))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, dampening=0.5)
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _clone_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    optimizer = trainer.optimizers[0]
    return {
        "weights": [p.detach().clone() for p in module.parameters()],
        "state": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in optimizer.state_dict()["state"].items()
        },
    }


class StepStates(Callback):
    """The weights and optimizer state before each optimizer step (at its first batch)
    and after it (at the batch that ended it)."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, Any]] = {}
        self.after: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        self.before.setdefault(trainer.global_step, _clone_state(trainer, module))

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if trainer.global_step - 1 in self.before and trainer.global_step - 1 not in self.after:
            self.after[trainer.global_step - 1] = _clone_state(trainer, module)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    weights = all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    if not weights or a["state"].keys() != b["state"].keys():
        return False
    for index, entry in a["state"].items():
        if entry.keys() != b["state"][index].keys():
            return False
        for key, value in entry.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][key])):
                return False
    return True


def _fit(
    module: pl.LightningModule, callbacks: list[Callback], steps: int, **trainer: Any
) -> pl.Trainer:
    states = StepStates()
    run = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, states],
        limit_val_batches=trainer.pop("limit_val_batches", 0),
        num_sanity_val_steps=0,
        **trainer,
    )
    run.fit(module, train_dataloaders=_data(), val_dataloaders=_data(32, seed=1))
    run.states = states  # type: ignore[attr-defined]
    return run


def _dropped(trainer: pl.Trainer, step: int) -> bool:
    states: StepStates = trainer.states  # type: ignore[attr-defined]
    return _equal(states.before[step], states.after[step])


def _finite(module: pl.LightningModule) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


# Item 1: a NaN or inf step's update is always dropped.


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize(
    ("kwargs", "step"),
    [({}, 3), ({"window": 8, "warmup": 4}, 0), ({"window": 8, "warmup": 4, "start_step": 10}, 5)],
    ids=["defaults-in-warmup", "first-step", "before-start-step"],
)
def test_a_nan_step_is_dropped_at_any_step(
    optimizer: str, kwargs: dict[str, Any], step: int
) -> None:
    module = Regressor(optimizer, poison={step: math.nan})
    skip = SkipStep(**kwargs)
    trainer = _fit(module, [skip], step + 4)
    assert list(skip.skipped_steps) == [step]
    assert _dropped(trainer, step), "the NaN step's update reached the weights or state"
    assert not _dropped(trainer, step + 1)  # the next step trains
    assert _finite(module)
    if step == 0:  # no state before the first step, none after its dropped update
        assert trainer.states.after[0]["state"] == {}  # type: ignore[attr-defined]


def test_an_inf_loss_is_dropped_too() -> None:
    module = Regressor("adamw", poison={2: math.inf})
    skip = SkipStep(window=8, warmup=4)
    trainer = _fit(module, [skip], 5)
    assert list(skip.skipped_steps) == [2] and _dropped(trainer, 2) and _finite(module)


# Item 2: a logged key is judged only at the steps that logged it.


@pytest.mark.parametrize("watcher", ["detector", "skip"])
def test_strict_refuses_a_key_not_logged_this_step_naming_it_and_the_step(
    watcher: str,
) -> None:
    callback: Callback = (
        SpikeDetector(monitor="sparse", window=3, warmup=2, ratio=1.4)
        if watcher == "detector"
        else SkipStep(monitor="sparse", window=4, warmup=2)
    )
    with pytest.raises(RuntimeError, match=r"\['sparse'\] not logged in training step 1"):
        _fit(Regressor(sparse_every=5), [callback], 12)


def test_a_sparse_key_is_judged_only_where_logged() -> None:
    """Logged every 5th step, x100 at step 10: one spike, at 10; 8 values judged."""
    detector = SpikeDetector(monitor="sparse", window=3, warmup=2, ratio=3.0, strict=False)
    skip = SkipStep(monitor="sparse", window=16, warmup=2, strict=False)
    module = Regressor(sparse_every=5, sparse_poison={10: 100.0})
    _fit(module, [detector, skip], 40)
    assert [s["step"] for s in detector.spikes] == [10]
    assert detector._seen == 40  # every step is seen, ...
    assert len(skip.values) == 8  # ... but only the 8 logged values enter a window
    assert list(skip.skipped_steps) == [10]  # not ordinary step 5 on step 0's value again


def test_a_window_without_spread_makes_no_finite_value_an_outlier() -> None:
    skip = SkipStep(window=4, warmup=2, initial=[1.0, 1.0, 1.0])
    assert skip.threshold() == math.inf
    assert not skip.decide(0, 1.0 + 1e-9)
    assert skip.decide(1, math.nan)
    assert list(skip.skipped_steps) == [1]


@pytest.mark.parametrize("watcher", ["detector", "skip"])
def test_a_key_logged_only_in_validation_is_refused_or_never_judged(watcher: str) -> None:
    def make(strict: bool) -> Any:
        if watcher == "detector":
            return SpikeDetector(monitor="val_loss", window=3, warmup=2, ratio=1.4, strict=strict)
        return SkipStep(monitor="val_loss", window=4, warmup=2, strict=strict)

    validating = {"val_check_interval": 10, "limit_val_batches": 2}
    with pytest.raises(RuntimeError, match=r"\['val_loss'\] not logged in training step 0"):
        _fit(Regressor(), [make(strict=True)], 30, **validating)
    callback = make(strict=False)
    _fit(Regressor(), [callback], 30, **validating)
    if watcher == "detector":
        assert list(callback._recent["val_loss"]) == [] and not callback.spikes
    else:
        assert list(callback.values) == [] and list(callback.skipped_steps) == []


# Item 3: an accumulated step is judged from all its micro-batches.


@pytest.mark.parametrize("micro", [0, 1], ids=["first-micro-batch", "second-micro-batch"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_outlier_micro_batch_makes_its_optimizer_step_an_outlier(
    micro: int, optimizer: str
) -> None:
    step = 12
    module = Regressor(optimizer, poison={2 * step + micro: 100.0})
    detector = SpikeDetector(window=8, warmup=8, ratio=3.0)
    skip = SkipStep(window=8, warmup=8)
    trainer = _fit(module, [detector, skip], 16, accumulate_grad_batches=2)
    assert [s["step"] for s in detector.spikes] == [step]
    assert detector._seen == 16  # one judgement per optimizer step
    assert list(skip.skipped_steps) == [step]
    assert _dropped(trainer, step)
    assert not _dropped(trainer, step - 1) and not _dropped(trainer, step + 1)


def test_an_accumulated_steps_loss_is_the_mean_of_its_micro_batches() -> None:
    """Judged: (l0 + l1) / 2 per step, each micro-batch's loss counted once however many
    watchers there are."""
    module = Regressor()
    skip = SkipStep(window=8, warmup=8)
    detector = SpikeDetector(window=8, warmup=8, ratio=1.4)
    _fit(module, [detector, skip], 6, accumulate_grad_batches=2)
    losses = module.losses
    means = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2], strict=True)]
    assert list(skip.values) == pytest.approx(means, rel=1e-6)
    assert list(detector._recent["loss"]) == pytest.approx(means, rel=1e-6)


# Item 4: several optimizers under manual optimization.


class TwoOptimizers(pl.LightningModule):
    """Manual optimization, two optimizers (each its own half of the model)."""

    def __init__(self, poison: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(FEATURES, 1), nn.Linear(FEATURES, 1)
        self.poison = poison

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        factor = 100.0 if batch_idx == self.poison else 1.0
        for layer, optimizer in zip((self.a, self.b), self.optimizers(), strict=True):
            loss = nn.functional.mse_loss(layer(x), y) * factor
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.AdamW(self.a.parameters(), lr=0.01),
            torch.optim.SGD(self.b.parameters(), lr=0.01, momentum=0.9),
        ]


def test_skip_step_refuses_several_optimizers_under_manual_optimization() -> None:
    with pytest.raises(RuntimeError, match=r"SkipStep: .*manual optimization with 2 optimizers"):
        _fit(TwoOptimizers(poison=10), [SkipStep(window=8, warmup=4)], 20)
    detector = SpikeDetector(window=4, warmup=4, ratio=3.0)  # records, drops nothing
    trainer = pl.Trainer(
        max_steps=24,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[detector],
    )
    trainer.fit(TwoOptimizers(poison=10), train_dataloaders=_data())
    assert detector.onsets == [21]  # batch 10's second step (two steps a batch)
