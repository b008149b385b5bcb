"""The demo's config and setup checks (lit_spikes/demo/setup_checks.py): non-finite numbers,
a seed numpy cannot take, a text too short, a setup that would fail at its first step, each
refused before a step."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lit_spikes.demo.module import TinyGPTModule
from tests.conftest import (
    TINY_DATA,
    TINY_GPT,
    TINY_OPTIM,
    fit,
)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: replace(TINY_OPTIM, peak_lr=math.inf), "peak_lr=inf must be finite and positive"),
        (lambda: replace(TINY_OPTIM, lr_scale=math.nan), "scale=nan must be finite and positive"),
        (lambda: replace(TINY_OPTIM, weight_decay=math.inf), "weight_decay=inf must be finite"),
        (lambda: replace(TINY_GPT, init_std=math.nan), "init_std=nan must be finite and positive"),
    ],
)
def test_configs_refuse_non_finite_numbers(build: Any, message: str) -> None:
    """An inf or NaN passes a "> 0" check, and then every step of the run is NaN."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


@pytest.mark.parametrize("seed", [-1, 2**31])
def test_a_train_seed_numpy_cannot_take_is_refused_when_built(seed: int) -> None:
    """Not a NumPy error at the first step (rank r seeds with train_seed + r)."""

    with pytest.raises(ValueError, match=re.escape(f"train_seed={seed} must be in [0, 2**31)")):
        TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM, train_seed=seed)


def test_a_text_too_short_for_a_row_is_refused_before_any_step(tmp_path: Path) -> None:
    """Not a torch.randint error inside the first step; nor a validation that logs nothing."""
    short = replace(TINY_DATA, world=replace(TINY_DATA.world, num_chars=1000), block_size=256)
    with pytest.raises(ValueError, match=r"the validation text has \d+ characters, fewer than"):
        fit(tmp_path, "short", 3, gpt=replace(TINY_GPT, block_size=256), data=short)


def test_a_setup_that_would_fail_at_its_first_step_is_refused_in_setup(tmp_path: Path) -> None:
    """From Python too: named, before any step, not an IndexError inside the embedding."""
    with pytest.raises(ValueError, match=r"block_size=16 exceeds .*block_size=8.*vocab_size=10"):
        fit(tmp_path, "both", 5, gpt=replace(TINY_GPT, block_size=8, vocab_size=10))
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=3"):
        fit(tmp_path, "accumulate", 5, accumulate_grad_batches=3)
    # Lightning's overfitting mode would train on fresh batches: no batch comes again
    with pytest.raises(ValueError, match=r"overfit_batches=0.5.*no batch comes again"):
        fit(tmp_path, "overfit", 5, overfit_batches=0.5)
