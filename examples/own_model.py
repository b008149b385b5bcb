"""lit-spikes on a LightningModule of your own: step-indexed data, exact resume, a spike
detector and a rollback that skips the bad data (PaLM's remedy), all on plain Lightning.

    python examples/own_model.py [--root runs/example]

It trains a small classifier with dropout and a warm-up schedule on a dataset it builds,
with one batch planted bad; checks that a run resumed from a ``.ckpt`` in a new Trainer is
bit-for-bit the uninterrupted one; then lets the detector stop at the planted spike, rolls
back to the checkpoint before it and skips the bad data. It exits non-zero if anything is
not as claimed.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from lit_spikes import StepLoader
from lit_spikes.callbacks import BatchSkipper, ExactResume, RollbackRestore, SpikeDetector

BATCH, SEED, BAD_STEP = 16, 0, 30


class Classifier(pl.LightningModule):
    """Written as Lightning users write them: nothing here knows lit-spikes."""

    def __init__(self, features: int = 20, classes: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(features, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, classes)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def dataset(bad_rows: list[int]) -> TensorDataset:
    """Points of 4 Gaussian clusters; ``bad_rows`` mislabelled and blown up (a bad batch)."""
    generator = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (1024,), generator=generator)
    x = torch.randn(4, 20, generator=generator)[y] + torch.randn(1024, 20, generator=generator)
    x[bad_rows] *= 20.0
    y[bad_rows] = (y[bad_rows] + 1) % 4
    return TensorDataset(x, y)


def loader(**kwargs: Any) -> StepLoader:
    clean = StepLoader(dataset([]), BATCH, seed=SEED)
    return StepLoader(dataset(clean.rows_of_step(BAD_STEP)), BATCH, seed=SEED, **kwargs)


def fit(root: Path, steps: int, callbacks: list[Any], ckpt: Path | None = None) -> pl.Trainer:
    saver = ModelCheckpoint(
        root / "checkpoints", filename="{step}", every_n_train_steps=10, save_top_k=-1
    )
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        callbacks=[saver, ExactResume(), *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    pl.seed_everything(0, verbose=False)  # dropout's stream of a fresh run
    trainer.fit(Classifier(), train_dataloaders=loader(), ckpt_path=ckpt)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/example"))
    root = parser.parse_args().root
    shutil.rmtree(root, ignore_errors=True)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    # 1. Interrupted at step 20 and resumed in a new Trainer: the uninterrupted run's bits.
    whole = fit(root / "whole", 25, [])
    fit(root / "run", 20, [])
    resumed = fit(root / "run", 25, [], ckpt=root / "run" / "checkpoints" / "step=20.ckpt")
    pairs = zip(
        whole.lightning_module.parameters(), resumed.lightning_module.parameters(), strict=True
    )
    assert all(torch.equal(a, b) for a, b in pairs), "the resumed run differs"
    print("resume: the run resumed at step 20 equals the uninterrupted one, bit for bit")

    # 2. The planted batch spikes the loss: the detector stops the run at that step.
    detector = SpikeDetector(monitor="train_loss", ratio=3.0, action="stop", verbose=True)
    fit(root / "spiky", 60, [detector])
    spike = detector.onsets[0]
    assert spike == BAD_STEP, f"expected the spike at step {BAD_STEP}, got {spike}"
    print(f"spike: flagged at step {spike} ({detector.spikes[0]['value']:.1f})")

    # 3. Roll back to the checkpoint before it and skip the data around the spike.
    rollback = RollbackRestore(root / "spiky" / "checkpoints", spike_step=spike, distance=5)
    skip = BatchSkipper(ranges=[(spike - 2, spike + 3)])
    after = SpikeDetector(monitor="train_loss", ratio=3.0, action="stop")
    run = fit(root / "remedy", 60, [rollback, skip, after], ckpt=rollback.ckpt_path)
    assert not after.spikes and run.global_step == 60, "the remedy did not hold"
    loss = float(run.callback_metrics["train_loss"])
    print(
        f"remedy: rolled back to step {rollback.ckpt_step}, skipped data positions "
        f"{spike - 2}-{spike + 2}, trained to step 60 without a spike (loss {loss:.3f})"
    )


if __name__ == "__main__":
    main()
