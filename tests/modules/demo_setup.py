"""The demos' main job at reduced size, with a planted spike (tests/demo/test_demos.py and
the DDP main job)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lit_spikes.demo.demos import DemoSetup
from tests.conftest import TINY_DATA, TINY_GPT, TINY_OPTIM


def tiny_setup(log_root: Path, workers: int = 2) -> DemoSetup:
    return DemoSetup(
        gpt=TINY_GPT,
        optim=replace(TINY_OPTIM, max_steps=40, warmup_steps=4),
        data=replace(TINY_DATA, poison=(28,)),
        model_seed=0,
        ckpt_step=20,
        checkpoint_every=10,
        val_every=20,
        rollback_distance=5,
        skip_window=6,
        log_root=log_root,
        workers=workers,
    )
