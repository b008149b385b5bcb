"""``Watcher`` (callbacks/watch.py): callbacks that judge or skip differently share one
Trainer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lit_spikes.callbacks import (
    BatchSkipper,
    SkipStep,
    SpikeDetector,
)
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import fit, load_ckpt


def test_callbacks_that_judge_or_skip_differently_can_share_a_trainer(tmp_path: Path) -> None:
    """Each instance's state has its own key: two that differ in any setting that changes
    what they judge or skip (here: only in window, start step, or the positions beyond the
    first and the count) were once refused by Lightning as duplicates. Two detectors of
    one rule differing only in what they do with a flag judge alike: one key, which a
    resume with another action finds (docs/detector.md), and Lightning refuses the pair."""
    same_rule = (SpikeDetector(action="log"), SpikeDetector(action="stop", verbose=True))
    assert same_rule[0].state_key == same_rule[1].state_key
    with pytest.raises(RuntimeError, match=r"more than one stateful callback of type `Spike"):
        fit(tmp_path, "same", 2, callbacks=list(same_rule))
    pairs = [
        (SpikeDetector(window=20, action="log"), SpikeDetector(window=30, action="stop")),
        (SpikeDetector(mode="any", z_score=3.0), SpikeDetector(mode="all", z_score=3.0)),
        (SkipStep(start_step=0), SkipStep(start_step=50)),
        (BatchSkipper(positions=[10, 11, 12]), BatchSkipper(positions=[10, 20, 30])),
    ]
    for first, second in pairs:
        assert first.state_key != second.state_key
        run = fit(tmp_path, "pair", 2, checkpoint_every=2, callbacks=[first, second])
        states = load_ckpt(checkpoint_path(run.spec.run_dir, 2))["callbacks"]
        assert states[first.state_key] == first.state_dict()
        assert states[second.state_key] == second.state_dict()
        shutil.rmtree(run.spec.run_dir)
