"""What the callbacks share (callbacks/common.py): argument checks, state keys from their
settings, their states through real checkpoints."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import (
    BatchSkipper,
    CheckpointRetention,
    FinalCheckpoint,
    LRScaler,
    RollbackRestore,
    SkipStep,
    SpikeDetector,
)
from lit_spikes.callbacks.common import make_state_key
from lit_spikes.shared.training import checkpoint_path
from lit_spikes.tools.resume_callbacks import keys_of
from tests.conftest import fit, load_ckpt

N, K, EVERY = 20, 10, 5


def test_remedy_callbacks_reject_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"ranges entry \(30, 20\)"):
        BatchSkipper(ranges=[(30, 20)])
    with pytest.raises(ValueError, match=r"skip position -1"):
        BatchSkipper(positions=[-1])
    with pytest.raises(ValueError, match=r"at least one position"):
        BatchSkipper()
    with pytest.raises(ValueError, match=r"factor=0 must be a finite number > 0"):
        LRScaler(factor=0)
    with pytest.raises(ValueError, match=r"factor=inf must be a finite number > 0"):
        LRScaler(factor=float("inf"))  # an infinite LR: NaN at the next step
    with pytest.raises(ValueError, match=r"factor=True must be a finite number > 0"):
        LRScaler(factor=True)
    with pytest.raises(ValueError, match=r"start_step=2.5 must be an integer >= 0"):
        LRScaler(factor=0.5, start_step=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"end_step=5 must be > start_step=5"):
        LRScaler(factor=0.5, start_step=5, end_step=5)
    with pytest.raises(ValueError, match=r"distance=-1"):
        RollbackRestore(tmp_path, spike_step=10, distance=-1)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        _ = RollbackRestore(tmp_path / "nowhere", spike_step=10).ckpt_path


def test_remedy_states_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    skipper, scaler = BatchSkipper(ranges=[(12, 15)]), LRScaler(0.5, start_step=3)
    reference = fit(tmp_path, "ref", K, checkpoint_every=EVERY, callbacks=[skipper, scaler])
    ckpt = load_ckpt(checkpoint_path(reference.spec.run_dir, K))
    assert ckpt["callbacks"][skipper.state_key] == {"skip": [12, 13, 14]}
    assert ckpt["callbacks"][scaler.state_key] == {"factor": 0.5, "start_step": 3, "end_step": None}
    assert ckpt["StepDataModule"]["skip"] == [12, 13, 14]


def test_a_setting_written_as_an_integer_names_the_same_callback_state() -> None:
    """ratio: 2 in a YAML config and --ratio 2.0 on a command line are one detector: a
    resume must find its checkpointed window under either."""
    assert SpikeDetector(ratio=2).state_key == SpikeDetector(ratio=2.0).state_key
    assert SpikeDetector(monitor="loss").state_key == SpikeDetector(monitor=["loss"]).state_key
    assert SpikeDetector(z_score=3).state_key == SpikeDetector(z_score=3.0).state_key
    assert LRScaler(1, start_step=4).state_key == LRScaler(1.0, start_step=4).state_key


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CheckpointRetention("d", keep_last=2.5), "keep_last=2.5 must be an integer >= 1"),
        (lambda: CheckpointRetention("d", keep_last=True), "keep_last=True must be an integer"),
        (
            lambda: CheckpointRetention("d", rollback_distance=math.nan),
            "rollback_distance=nan must be an integer >= 0",
        ),
        (lambda: RollbackRestore("d", spike_step=122.5), "spike_step=122.5 must be an integer"),
        (lambda: RollbackRestore("d", spike_step="122"), "spike_step='122' must be an integer"),
        (lambda: FinalCheckpoint("d", every_n_steps=2.5), "every_n_steps=2.5 must be an integer"),
    ],
)
def test_checkpoint_callbacks_refuse_non_integer_steps_naming_them(
    build: Any, message: str
) -> None:
    """Each failed mid-training (a slice of 2.5) or silently deleted every rollback
    target (a NaN horizon): refused when built instead."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_numpy_integers_are_taken_as_ints() -> None:
    """A step from an array (np.int64) is an integer: taken, and kept as an int so that
    a state key shows 10, not np.int64(10)."""
    import numpy as np

    rollback = RollbackRestore("d", spike_step=np.int64(122), distance=np.int32(20))
    assert (rollback.spike_step, rollback.distance) == (122, 20)
    assert type(rollback.spike_step) is int
    assert SpikeDetector(window=np.int64(10)).state_key == SpikeDetector(window=10).state_key
    assert CheckpointRetention("d", keep_last=np.int64(2)).keep_last == 2


# Checkpoints written before make_state_key replaced Lightning's private helper must still
# hand each callback its state: the key keeps that helper's form and strings.
@pytest.mark.parametrize(
    ("build", "settings"),
    [
        (
            lambda _: LRScaler(0.5, start_step=10, end_step=20),
            {"factor": 0.5, "start_step": 10, "end_step": 20},
        ),
        (
            lambda d: RollbackRestore(d, spike_step=30, distance=10),
            {"spike_step": 30, "distance": 10},
        ),
    ],
)
def test_the_key_is_lightnings_form_of_the_same_settings(
    tmp_path: Path, build: Any, settings: dict[str, Any]
) -> None:
    callback = build(tmp_path)
    lightnings = Callback._generate_state_key(callback, **settings)  # its form, checked here
    assert callback.state_key == make_state_key(callback, **settings) == lightnings


@pytest.mark.parametrize(
    ("callback", "key"),
    [  # printed by the code at 2860189, which called Lightning's helper
        (
            SpikeDetector(ratio=1.4),
            "SpikeDetector{'monitor': ('loss',), 'window': 20, 'ratio': 1.4, 'z_score': None, "
            "'mode': 'any', 'warmup': 20, 'action': 'log'}",
        ),
        (
            SpikeDetector(),
            "SpikeDetector{'monitor': ('loss',), 'window': 100, 'ratio': None, 'z_score': None, "
            "'mode': 'any', 'warmup': 100, 'action': 'log', 'robust_z': 8.0}",
        ),
        (BatchSkipper([5, 6]), "BatchSkipper{'first': 5, 'count': 2, 'positions': '2b6a005e'}"),
        (
            SkipStep(),
            "SkipStep{'monitor': 'loss', 'window': 128, 'sigma': 6.0, 'warmup': 64, "
            "'start_step': 0}",
        ),
    ],
)
def test_keys_of_older_checkpoints_are_unchanged(callback: Callback, key: str) -> None:
    """Each key is the callback's own, or (a detector's, from before the key left out
    ``action``) one it adopts at a resume."""
    assert key in keys_of(callback)
