"""A module that draws random numbers everywhere a real one does, for the invariance tests
(issue 53): dropout, noise in the dataset's ``__getitem__`` (torch, NumPy and Python's
``random``), its own ``on_train_batch_end``, a validation with dropout left on and a
sampled metric, clipping and a warm-up LR schedule. ``fit_drawing`` trains it watched in
any of the ways a user watches a run."""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume
from lit_spikes.callbacks.final_checkpoint import FinalCheckpoint
from lit_spikes.callbacks.preemption import PreemptionCheckpoint

FEATURES = 6


SITES = frozenset({"dropout", "augment", "hooks", "validation"})
"""Where the module draws: dropout, the dataset's ``__getitem__``, its own hooks, its
validation (dropout left on, a sampled metric)."""


class NoisyRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A fixed regression problem whose rows are augmented at each read (``augment``)."""

    def __init__(self, rows: int = 48, seed: int = 1, augment: bool = True) -> None:
        self.augment = augment
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(rows, FEATURES, generator=generator)
        self.w = torch.randn(FEATURES, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.augment:
            return self.x[i], self.x[i] @ self.w
        scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        x = self.x[i] * scale + 0.05 * torch.randn(FEATURES)
        return x, x @ self.w


class DrawingNet(pl.LightningModule):
    def __init__(self, sites: frozenset[str] = SITES) -> None:
        super().__init__()
        self.sites = sites
        dropout = 0.3 if "dropout" in sites else 0.0
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1)
        )
        self.register_buffer("hook_draws", torch.zeros(()))
        self.losses: list[torch.Tensor] = []
        self.validations: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if "hooks" in self.sites:
            self.hook_draws += torch.rand(())  # the module's own hooks draw too

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Drawn after the step's files (Lightning calls the callbacks' hook first): what
        # it draws must not reach the next step. (State it changed would be missing from
        # the step's file: issue 54's order, not the randomness.)
        if "hooks" in self.sites:
            torch.rand(3), np.random.rand(2), random.random()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        drawing = "validation" in self.sites
        self.net.train(drawing)  # dropout left on, as many validations have it by accident
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if drawing:
            loss = loss + 1e-3 * torch.rand(())  # a sampled metric
        self.log("val_loss", loss)
        if not self.trainer.sanity_checking:
            self.validations.setdefault(self.global_step, []).append(loss.detach().clone())

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class GeneratorNet(DrawingNet):
    """Draws from a ``torch.Generator`` of its own too (a noise layer's), in training and
    in validation."""

    def __init__(self) -> None:
        super().__init__()
        self.noise = nn.Module()
        self.noise.gen = torch.Generator().manual_seed(11)  # type: ignore[assignment]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x + 0.1 * torch.randn(x.shape, generator=self.noise.gen)  # type: ignore[arg-type]
        return super().training_step((x, y), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        torch.rand(4, generator=self.noise.gen)  # type: ignore[arg-type]
        super().validation_step(batch, batch_idx)


class EndDrawingNet(DrawingNet):
    """Keeps a draw of its own ``on_train_batch_end`` in a buffer: what runs between two
    steps changes its state."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.hook_draws += torch.rand(())


class QuietEndNet(DrawingNet):
    """``DrawingNet`` without an ``on_train_batch_end`` of its own."""

    on_train_batch_end = pl.LightningModule.on_train_batch_end  # type: ignore[assignment]


class DrawingWatcher(Callback):
    """Draws from torch's, NumPy's and Python's RNG after each step (a sampled metric)."""

    def on_train_batch_end(self, *args: Any) -> None:
        torch.rand(5), np.random.rand(2), random.random()


class DrawingData(pl.LightningDataModule):
    """``NoisyRows`` through a ``StepLoader`` for training, and a validation loader: what
    ``lit-spikes fit --data`` takes."""

    def train_dataloader(self) -> StepLoader:
        return StepLoader(NoisyRows(), batch_size=8, seed=5)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(NoisyRows(16, seed=2), batch_size=8)


class DropoutSchedule(Callback):
    """Lowers the module's dropout at each epoch's start (a schedule kept in a callback)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for layer in pl_module.modules():
            if isinstance(layer, nn.Dropout):
                layer.p = 0.3 / (1 + trainer.current_epoch)


class EpochStartNet(DrawingNet):
    """Lowers its dropout in its own ``on_train_epoch_start``."""

    def on_train_epoch_start(self) -> None:
        DropoutSchedule().on_train_epoch_start(self.trainer, self)


class SignalAt(Callback):
    """Sends this process SIGTERM (or ``signum``: SIGINT, a Ctrl-C) at the start of
    ``step`` (global step ``step - 1``), as a scheduler would: PreemptionCheckpoint saves
    at that step's end."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)  # Python runs the handler right here


@dataclass(frozen=True)
class Watch:
    """How a run is watched: none of these may change what it trains."""

    every: int | None = None
    """A ModelCheckpoint every so many steps (its files in ``every/``)."""
    val_every: int | None = None
    """A validation every so many steps (None: none)."""
    monitor: bool = False
    """A ModelCheckpoint keeping the best val_loss (needs ``val_every``)."""
    final: bool = False
    """A FinalCheckpoint."""
    epoch_files: bool = False
    """A ModelCheckpoint at each epoch's end, every one kept (its files in ``every/``): in
    ``on_train_epoch_end``, or at the validation's end where one runs."""
    max_epochs: int | None = None
    """``Trainer(max_epochs=...)`` beside ``max_steps`` (None: Lightning's default)."""
    at_epoch_start: str | None = None
    """A callback that acts at each epoch's start: ``"dropout"`` (``DropoutSchedule``) or
    ``"accumulation"`` (Lightning's ``GradientAccumulationScheduler``, 2 from epoch 1)."""
    workers: int = 0
    """The train loader's workers (the StepLoader's, or a plain augmenting one's)."""
    plain: bool = False
    """A plain ``DataLoader`` of the rows without augmentation instead of the StepLoader:
    the step's draws are then keyed by ExactResume alone."""
    plain_augmented: bool = False
    """A plain ``DataLoader`` of the rows augmented in ``__getitem__`` (torch, NumPy and
    Python's ``random``), read in this process: Lightning fetches a step's batch before
    its ``on_train_batch_start``, from the RNG state the previous step's end left."""
    shuffle: bool = False
    """The plain augmenting loader shuffles (``DataLoader(shuffle=True)``)."""
    persistent: bool = False
    """The plain augmenting loader keeps its workers across epochs."""
    loader_generator: bool = False
    """The plain augmenting loader draws from a ``torch.Generator`` of its own (the
    workers' base seed, a shuffle's order), seeded by the user."""
    drawing_watcher: bool = False
    """A ``DrawingWatcher`` listed before ExactResume."""
    shards: int | None = None
    """The StepLoader's shards (None: its default, one shard at batch 8)."""
    sigterm_at: int | None = None
    """A SIGTERM in this step: the run stops there, PreemptionCheckpoint's file in
    ``preempted/``."""


@dataclass
class Ended:
    """What a run ended with: every parameter and buffer, every optimizer tensor, and the
    training losses of the steps this fit trained."""

    weights: dict[str, torch.Tensor]
    optimizer: list[torch.Tensor]
    losses: list[torch.Tensor]
    validations: dict[int, list[torch.Tensor]]
    """Each validation's batch losses, by the step it validated at."""


def fit_drawing(
    root: Path,
    watch: Watch,
    steps: int = 12,
    ckpt: Path | None = None,
    module: type[DrawingNet] = DrawingNet,
    sites: frozenset[str] = SITES,
) -> Ended:
    pl.seed_everything(0, verbose=False)
    callbacks: list[Callback] = [ExactResume()]
    if watch.drawing_watcher:
        callbacks.insert(0, DrawingWatcher())
    if watch.every:
        callbacks.append(
            ModelCheckpoint(
                root / "every", "{step}", every_n_train_steps=watch.every, save_top_k=-1
            )
        )
    if watch.epoch_files:
        at_end = (
            None if watch.val_every else True
        )  # Lightning's choice under check_val_every_n_epoch=1
        callbacks.append(
            ModelCheckpoint(root / "every", "{step}", save_top_k=-1, save_on_train_epoch_end=at_end)
        )
    if watch.at_epoch_start == "dropout":
        callbacks.append(DropoutSchedule())
    if watch.at_epoch_start == "accumulation":
        callbacks.append(GradientAccumulationScheduler({1: 2}))
    if watch.monitor:
        callbacks.append(ModelCheckpoint(root / "best", "best-{step}", monitor="val_loss"))
    if watch.final:
        callbacks.append(FinalCheckpoint(root / "final", every_n_steps=5))
    if watch.sigterm_at is not None:
        callbacks += [SignalAt(watch.sigterm_at), PreemptionCheckpoint(root / "preempted")]
    trainer = pl.Trainer(
        max_steps=steps,
        max_epochs=watch.max_epochs,
        val_check_interval=watch.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=None if watch.val_every else 0,
        num_sanity_val_steps=2,
        gradient_clip_val=0.5,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    model = module() if sites == SITES else module(sites)
    augment = "augment" in sites
    rows = NoisyRows(augment=augment)
    train: Any = StepLoader(rows, 8, seed=5, num_workers=watch.workers, shards=watch.shards)
    if watch.plain:
        rows = NoisyRows()
        train = DataLoader(TensorDataset(rows.x, rows.x @ rows.w), batch_size=8)
    if watch.plain_augmented:
        train = DataLoader(
            NoisyRows(augment=augment),
            batch_size=8,
            shuffle=watch.shuffle,
            num_workers=watch.workers,
            persistent_workers=watch.persistent,
            generator=torch.Generator().manual_seed(4) if watch.loader_generator else None,
        )
    val = DataLoader(NoisyRows(16, seed=2, augment=augment), batch_size=8)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt)
    optimizer = trainer.optimizers[0].state_dict()["state"]
    tensors = [
        t.clone() for s in optimizer.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    return Ended(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        tensors,
        model.losses,
        model.validations,
    )


def differences(a: Ended, b: Ended) -> list[str]:
    """What differs between two ends (``torch.equal``), by name; losses compared over the
    steps both trained, the last ones (a resume trains only the steps after its file)."""
    found = [k for k in a.weights if not torch.equal(a.weights[k], b.weights[k])]
    found += [
        f"optimizer[{i}]"
        for i, (x, y) in enumerate(zip(a.optimizer, b.optimizer, strict=True))
        if not torch.equal(x, y)
    ]
    shared = min(len(a.losses), len(b.losses))
    pairs = zip(a.losses[len(a.losses) - shared :], b.losses[len(b.losses) - shared :], strict=True)
    found += [f"loss {i}" for i, (x, y) in enumerate(pairs) if not torch.equal(x, y)]
    return found
