"""Runs of the guarantee modules (tests/modules/guarantee_modules.py) through real ``.ckpt``
files, and the comparisons of two runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from tests.modules.guarantee_modules import (
    step_loader,
)

GUARANTEE_STEPS = 16


def train_guarded(
    root: Path,
    module: pl.LightningModule,
    steps: int,
    callbacks: Sequence[Callback] = (),
    ckpt: Path | None = None,
    loader: Any = None,
    **kwargs: Any,
) -> pl.Trainer:
    """A plain Trainer as a user builds one, writing ``step=<k>.ckpt`` every step."""
    saver = ModelCheckpoint(root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    kwargs.setdefault("accelerator", "cpu")
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver, *callbacks],
        **kwargs,
    )
    data = {"train_dataloaders": step_loader() if loader is None else loader}
    if isinstance(loader, pl.LightningDataModule):
        data = {"datamodule": loader}
    trainer.fit(module, ckpt_path=ckpt, **data)
    return trainer


def guarantee_differences(a: pl.Trainer, b: pl.Trainer) -> list[str]:
    """The parameters and optimizer state tensors that are not ``torch.equal``."""
    differ = [
        name
        for (name, x), (_, y) in zip(
            a.lightning_module.state_dict().items(),
            b.lightning_module.state_dict().items(),
            strict=True,
        )
        if not torch.equal(x, y)
    ]
    for sa, sb in zip(a.optimizers[0].state.values(), b.optimizers[0].state.values(), strict=True):
        differ += [f"optimizer.{n}" for n in sa if not torch.equal(sa[n], sb[n])]
    return differ


def same_inputs(a: pl.LightningModule, b: pl.LightningModule, steps: range) -> bool:
    return all(torch.equal(a.inputs[s], b.inputs[s]) for s in steps)  # type: ignore[index]
