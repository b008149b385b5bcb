"""``BatchSkipper``: a run that skips batches resumes bit-exactly from its checkpoints."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lit_spikes.callbacks import (
    BatchSkipper,
)
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import assert_states_equal, fit, load_ckpt, tb_scalars
from tests.modules.guarantee_modules import (
    MomentumRegressor,
    step_loader,
)
from tests.modules.guarantee_runs import GUARANTEE_STEPS, guarantee_differences, train_guarded

NO_EXACT_RESUME = "ignore:Be aware that when using `ckpt_path`.*'ExactResume\\{}':UserWarning"


@pytest.mark.filterwarnings(NO_EXACT_RESUME)
def test_a_batch_skipper_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    def run(name: str, steps: int, ckpt: Path | None = None) -> pl.Trainer:
        return train_guarded(
            tmp_path / name, MomentumRegressor(), steps, [BatchSkipper(ranges=[(5, 9)])], ckpt
        )

    whole, _ = run("a", GUARANTEE_STEPS), run("b", 7)
    resumed = run("c", GUARANTEE_STEPS, tmp_path / "b" / "step=7.ckpt")
    loader = step_loader(skip=range(5, 9))
    for step in range(7, GUARANTEE_STEPS):  # step 7 trains position 11
        assert torch.equal(resumed.lightning_module.inputs[step], loader.batch_of_step(step)[0])
    assert guarantee_differences(whole, resumed) == []


N, K, EVERY = 20, 10, 5


def test_batch_skipper_run_resumes_bit_exactly(tmp_path: Path) -> None:
    reference = fit(
        tmp_path, "ref", N, checkpoint_every=EVERY, callbacks=[BatchSkipper(ranges=[(12, 16)])]
    )
    positions = [r["position"] for r in reference.module.history]
    assert positions == [*range(12), *range(16, 24)]
    # data/skipped counts the positions skipped up to each step's own batch, logged at
    # that step (it once logged the next step's count)
    skipped = tb_scalars(reference.spec.run_dir)["data/skipped"]
    assert skipped == [(step, 0.0 if step < 12 else 4.0) for step in range(N)]
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
        callbacks=[BatchSkipper(ranges=[(12, 16)])],
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )
    # Skipping is restored from the checkpoint even without the callback.
    bare = fit(
        tmp_path,
        "bare",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
    )
    assert [r["position"] for r in bare.module.history] == positions[K:]
