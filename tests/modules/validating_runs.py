"""Runs whose validation steers training, for issue 54 (every file resumes exactly, a
validating step's too): ``DrawingNet`` (dropout, augmentation, a validation that draws)
under EarlyStopping and, optionally, ReduceLROnPlateau on the validation loss, with the
files a user keeps (every k steps, the best val_loss, the final one) and a SIGTERM at a
step of the test's choosing."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume
from lit_spikes.callbacks.final_checkpoint import FinalCheckpoint
from lit_spikes.callbacks.preemption import PreemptionCheckpoint
from tests.modules.drawing_runs import DrawingNet, Ended, NoisyRows, SignalAt


class PlateauDrawingNet(DrawingNet):
    """``DrawingNet`` whose LR a ReduceLROnPlateau on val_loss lowers: checked at each
    validating step (every 3: the step interval at a frequency of 3), or at each epoch's
    end (6 batches)."""

    def __init__(self, interval: str = "step") -> None:
        super().__init__()
        self.interval = interval

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        scheduler = {"scheduler": plateau, "interval": self.interval,
                     "frequency": 3 if self.interval == "step" else 1,
                     "monitor": "val_loss"}  # fmt: skip
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


@dataclass(frozen=True)
class Steer:
    """What a run keeps and what steers it."""

    val_every: int = 3
    """A validation every so many steps."""
    every: int | None = None
    """A ModelCheckpoint every so many steps (its files in ``every/``)."""
    save_last: bool = False
    """That ModelCheckpoint keeps ``last.ckpt`` too (Lightning rewrites it after the
    validation of a step it saved)."""
    monitor: bool = False
    """A ModelCheckpoint of the best val_loss (``best/``)."""
    final: bool = False
    """A FinalCheckpoint (``final/``)."""
    patience: int | None = 2
    """EarlyStopping's patience on val_loss (None: none)."""
    good_enough: float | None = None
    """EarlyStopping's ``stopping_threshold``: it stops once val_loss is below, at a step
    whose validation is the best (the monitor checkpoint writes then)."""
    plateau: bool | str = False
    """ReduceLROnPlateau on val_loss, at each validating step (True or "step") or at
    each epoch's end ("epoch")."""
    sigterm_at: int | None = None
    """A SIGTERM in this step; PreemptionCheckpoint writes ``preempted/``."""
    sigint: bool = False
    """SIGINT (Ctrl-C) instead."""


@dataclass
class Steered:
    ended: Ended
    step: int
    """The global step the fit ended at."""
    early_stopping: dict[str, Any] | None
    lrs: list[float]
    """The LR of each step this fit trained."""
    best: tuple[str, float] | None = None
    """The monitor ModelCheckpoint's best file (its name) and score."""


class LRs(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit_steered(root: Path, steer: Steer, steps: int = 30, ckpt: Path | None = None) -> Steered:
    pl.seed_everything(0, verbose=False)
    lrs = LRs()
    callbacks: list[Callback] = [ExactResume(), lrs]
    stopper = None
    if steer.patience is not None:
        stopper = EarlyStopping("val_loss", patience=steer.patience, min_delta=1e-3,
                                stopping_threshold=steer.good_enough)  # fmt: skip
        callbacks.append(stopper)
    if steer.every:
        every = ModelCheckpoint(root / "every", "{step}", every_n_train_steps=steer.every,
                                save_top_k=-1, save_last=steer.save_last or None)  # fmt: skip
        callbacks.append(every)
    monitor = ModelCheckpoint(root / "best", "best-{step}", monitor="val_loss")
    if steer.monitor:
        callbacks.append(monitor)
    if steer.final:
        callbacks.append(FinalCheckpoint(root / "final", every_n_steps=steer.every or 10**9))
    if steer.sigterm_at is not None:
        signum = signal.SIGINT if steer.sigint else signal.SIGTERM
        callbacks += [SignalAt(steer.sigterm_at, signum), PreemptionCheckpoint(root / "preempted")]
    trainer = pl.Trainer(
        max_steps=steps,
        val_check_interval=steer.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=0.5,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    interval = steer.plateau if isinstance(steer.plateau, str) else "step"
    model = PlateauDrawingNet(interval) if steer.plateau else DrawingNet()
    train = StepLoader(NoisyRows(), 8, seed=5)
    val = DataLoader(NoisyRows(16, seed=2), batch_size=8)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt)
    optimizer = trainer.optimizers[0].state_dict()["state"]
    tensors = [t.clone() for s in optimizer.values() for t in s.values()
               if isinstance(t, torch.Tensor)]  # fmt: skip
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ended = Ended(weights, tensors, model.losses, model.validations)
    state = stopper.state_dict() if stopper is not None else None
    score = monitor.best_model_score
    best = (Path(monitor.best_model_path).name, float(score)) if score is not None else None
    return Steered(ended, trainer.global_step, state, lrs.lrs, best if steer.monitor else None)
