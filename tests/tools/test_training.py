"""``RunSpec`` (lit_spikes/shared/training.py): it refuses callbacks that would replace the
run's own, and a resume into the same run purges the stale steps' curves."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lit_spikes.callbacks import (
    SpikeDetector,
)
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import (
    TINY_DATA,
    fit,
    tb_scalars,
)

N, K, EVERY = 20, 10, 5


def test_runspec_refuses_callbacks_that_would_replace_the_runs_own(tmp_path: Path) -> None:
    from lit_spikes.shared.training import RunSpec

    with pytest.raises(ValueError, match=r"trainer_kwargs\['callbacks'\].*RunSpec\(callbacks="):
        RunSpec(tmp_path, "run", 4, trainer_kwargs={"callbacks": [SpikeDetector(ratio=1.4)]})


def test_resuming_into_the_same_run_purges_stale_steps(tmp_path: Path) -> None:
    first = fit(tmp_path, "run", N, checkpoint_every=EVERY)
    ckpt = checkpoint_path(first.spec.run_dir, K)
    # A crash after step 20 is replayed from step 10 with other data: steps 10-19 of the
    # first attempt are stale and must not show.
    with pytest.warns(UserWarning, match="data seed"):
        again = fit(tmp_path, "run", N, ckpt_path=ckpt, data=replace(TINY_DATA, seed=9))
    losses = tb_scalars(first.spec.run_dir)["train/loss"]
    assert [step for step, _ in losses] == list(range(N))
    logged = dict(losses)
    for step in range(K, N):
        # TensorBoard stores float32; the loss is a float32 value too: equal exactly
        assert logged[step] == again.losses[step]
        assert again.losses[step] != first.losses[step]
