"""Plain Lightning Trainers on the user modules (tests/modules/user_modules.py): a run, a
resume pair and the state differences between two runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume
from tests.modules.user_modules import (
    regression_data,
)

STEPS, RESUME_AT, BATCH = 30, 17, 8  # 12 batches an epoch: the resume is mid-epoch 1


def trainer(
    root: Path, steps: int, callbacks: Sequence[Callback] = (), **kwargs: Any
) -> pl.Trainer:
    """A plain Trainer as a user builds one, writing ``step=<k>.ckpt`` every 1 step."""
    saver = ModelCheckpoint(root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    return pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver, *callbacks],
        **kwargs,
    )


def train(
    root: Path,
    module: pl.LightningModule,
    loader: Any,
    steps: int,
    callbacks: Sequence[Callback] = (),
    ckpt_path: Path | None = None,
    **kwargs: Any,
) -> pl.Trainer:
    run = trainer(root, steps, callbacks, **kwargs)
    run.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return run


def states_equal(a: pl.Trainer, b: pl.Trainer) -> list[str]:
    """Names of the parameters and optimizer tensors that differ (``torch.equal``)."""
    assert a.lightning_module is not None and b.lightning_module is not None
    differ = [
        name
        for (name, x), (_, y) in zip(
            a.lightning_module.state_dict().items(),
            b.lightning_module.state_dict().items(),
            strict=True,
        )
        if not torch.equal(x, y)
    ]
    for index, (oa, ob) in enumerate(zip(a.optimizers, b.optimizers, strict=True)):
        for key, (sa, sb) in enumerate(zip(oa.state.values(), ob.state.values(), strict=True)):
            differ += [f"optimizer{index}.{key}.{n}" for n in sa if not torch.equal(sa[n], sb[n])]
    return differ


def resume_pair(
    tmp_path: Path,
    make_module: Callable[[], pl.LightningModule],
    make_loader: Callable[[], Any],
    callbacks: Callable[[], Sequence[Callback]] = lambda: [ExactResume()],
    resume_at: int = RESUME_AT,
    **kwargs: Any,
) -> tuple[pl.Trainer, pl.Trainer]:
    """The uninterrupted run to STEPS and the one resumed at ``resume_at`` in a new Trainer."""
    whole = train(tmp_path / "a", make_module(), make_loader(), STEPS, callbacks(), **kwargs)
    train(tmp_path / "b", make_module(), make_loader(), resume_at, callbacks(), **kwargs)
    ckpt = tmp_path / "b" / f"step={resume_at}.ckpt"
    resumed = train(
        tmp_path / "c", make_module(), make_loader(), STEPS, callbacks(), ckpt, **kwargs
    )
    return whole, resumed


def loader(**kwargs: Any) -> StepLoader:
    return StepLoader(regression_data(), BATCH, seed=7, **kwargs)
