"""Each callback's ``state_key`` keeps the form Lightning's own helper gives (class name,
then the settings' repr): checkpoints written before ``make_state_key`` replaced that
private helper still hand each callback its state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import BatchSkipper, LRScaler, RollbackRestore, SkipStep, SpikeDetector
from lit_spikes.callbacks.common import make_state_key


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
    assert callback.state_key == key
