"""SpikeDetector's default rule (a robust z-score over 100 steps) as a pure function on
loss sequences; the measurement on real runs is scripts/detector_defaults.py
(docs/detector.md)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from lit_spikes.callbacks import SpikeDetector
from lit_spikes.callbacks.spike_detector import robust_limit


def flags(detector: SpikeDetector, values: list[float]) -> list[int]:
    return [s["step"] for i, v in enumerate(values) for s in detector.check(i, {"loss": v})]


def near_zero_loss(steps: int = 600, level: float = 0.05) -> list[float]:
    """A healthy loss near zero: each batch's loss is the level times a log-normal noise
    (a batch's loss is a mean of positive terms: skewed up, a tail of 2-3x the level)."""
    noise = torch.randn(steps, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (level * torch.exp(0.3 * noise)).tolist()


def test_the_default_flags_no_step_of_a_healthy_loss_near_zero() -> None:
    """The old default (1.4x the mean of 20 steps) flagged a healthy run near 0.05 by the
    dozen; the default judges by the window's own spread."""
    values = near_zero_loss()
    assert flags(SpikeDetector(), values) == []
    assert len(flags(SpikeDetector(ratio=1.4), values)) > 20  # the demo's rule would


def test_the_default_catches_a_10x_loss_whatever_the_scale_and_offset() -> None:
    values = near_zero_loss()
    for step in (150, 300, 599):  # each alone, 10x the level it rises from
        planted = list(values)
        planted[step] = 10 * statistics.median(values[step - 100 : step])
        for scale, offset in ((1.0, 0.0), (1000.0, 0.0), (1.0, 3.0), (0.001, -2.0)):
            moved = [scale * v + offset for v in planted]
            assert flags(SpikeDetector(), moved) == [step], (step, scale, offset)


def test_a_window_without_spread_makes_no_finite_value_a_spike() -> None:
    """As SkipStep: no spread, no scale to call a value an outlier by (a MAD of 0 with
    some spread falls back to the mean absolute deviation); NaN is always a spike."""
    assert robust_limit([2.0] * 10, 8.0) == math.inf
    # 7 of 10 equal: a MAD of 0, the mean deviation still gives a scale
    assert robust_limit([1.0] * 7 + [2.0] * 3, 8.0) == pytest.approx(1.0 + 8 * 1.2533 * 0.3)
    detector = SpikeDetector(window=10, warmup=10)
    assert flags(detector, [2.0] * 10 + [2.5]) == []
    assert [s["step"] for s in detector.check(11, {"loss": math.nan})] == [11]
    z = SpikeDetector(window=10, warmup=10, z_score=3.0)  # the z rule, likewise
    assert flags(z, [2.0] * 10 + [2.5]) == []


def test_a_threshold_given_keeps_its_rule_window_and_checkpoint_name() -> None:
    """ratio or z_score alone: no robust rule added, the window of 20 as before, and the
    same state key as a detector written before robust_z existed (a resume finds it)."""
    detector = SpikeDetector(ratio=1.4)
    assert (detector.robust_z, detector.window, detector.warmup) == (None, 20, 20)
    old_key = detector._generate_state_key(
        monitor=("loss",),
        window=20,
        ratio=1.4,
        z_score=None,
        mode="any",
        warmup=20,
        action="log",
    )
    assert detector.state_key == old_key
    default = SpikeDetector()
    assert (default.robust_z, default.window, default.warmup) == (8.0, 100, 100)
    assert "robust_z" in default.state_key


def test_recover_and_diagnose_judge_a_users_module_by_the_scale_free_default() -> None:
    """``--detector.*`` left unset: the built-in model keeps its demo's rule, a user's
    module gets the detector's own (the demo's 1.4x flagged the loss near zero above by
    the dozen); a rule given is used as given, for either."""
    from lit_spikes.tools.detector_config import DetectorConfig

    builtin, users = DetectorConfig().build(0), DetectorConfig().build(0, builtin=False)
    assert (builtin.ratio, builtin.robust_z, builtin.window, builtin.warmup) == (1.4, None, 20, 20)
    assert (users.ratio, users.robust_z, users.window) == (None, SpikeDetector().robust_z, 100)
    assert flags(users, near_zero_loss()) == []
    given = DetectorConfig(ratio=3.0).build(0, builtin=False)
    assert (given.ratio, given.robust_z, given.window) == (3.0, None, 20)
