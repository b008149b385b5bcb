"""The one judgement diagnose, recover and study share: a curve's rise over its own recent
median, as a share of the original spike's (lit_spikes.tools.judgement)."""

from __future__ import annotations

import math

import pytest

from lit_spikes.tools.judgement import Judgement, Rise, check_bar, rise_in, rise_ratio

FLAT = {step: 1.0 + 0.01 * (step % 3) for step in range(20)}


def test_a_rise_is_over_the_median_of_the_window_before_each_step() -> None:
    curve = {**FLAT, 10: 3.0, 11: 2.0}
    rise = rise_in(curve, 10, 19, window=5)
    assert rise == Rise(10, 3.0, 1.01)  # the median of steps 5-9: 1.02 1.0 1.01 1.02 1.0
    # Its own spike is in the window of the next step: a median does not follow it
    assert rise_in(curve, 11, 11, window=5) == Rise(11, 2.0, 1.01)
    assert rise_in(curve, 12, 19, window=5) is not None
    assert rise_in(curve, 12, 19, window=5).height < 0.03  # type: ignore[union-attr]


def test_the_values_before_the_curve_measure_its_first_steps() -> None:
    late = {step: value for step, value in FLAT.items() if step >= 15}
    assert rise_in(late, 15, 15, window=4) is None  # nothing before step 15 to measure from
    rise = rise_in(late, 15, 15, window=4, prior=[5.0, 1.0, 1.0, 1.0])
    assert rise == Rise(15, 1.0, 1.0)


def test_a_slow_trend_is_no_rise_where_a_fixed_baseline_would_be_one() -> None:
    """A branch rolled back far trains from a higher loss: each step is measured from its
    own window, not from the spike's."""
    falling = {step: 3.0 - 0.05 * step for step in range(40)}
    rise = rise_in(falling, 10, 39, window=10)
    assert rise is not None and rise.height < 0  # every step is below its recent median


def test_a_non_finite_value_is_the_highest_rise() -> None:
    curve = {**FLAT, 12: math.nan, 13: 50.0}
    rise = rise_in(curve, 10, 19, window=5)
    assert rise is not None and rise.step == 12 and math.isinf(rise.height)
    assert "nan at step 12" in rise.describe()


def test_the_ratio_is_the_share_of_the_spikes_height_as_a_factor_over_its_median() -> None:
    spike = Rise(10, 3.0, 1.0)  # 3x its median
    assert rise_ratio(Rise(30, 2.5, 1.0), spike) == math.log(2.5) / math.log(3.0)
    assert rise_ratio(Rise(30, 25.0, 10.0), spike) == rise_ratio(Rise(30, 2.5, 1.0), spike)
    assert rise_ratio(Rise(30, 0.5, 1.0), spike) == 0.0  # below its median: none
    # A big spike is not dwarfed: 20x against 100x is most of it, not a fifth
    assert 0.6 < rise_ratio(Rise(30, 20.0, 1.0), Rise(10, 100.0, 1.0)) < 0.7
    # A curve that is not positive (a logged score) rises by its difference
    assert rise_ratio(Rise(30, 0.5, -1.0), Rise(10, 1.0, -1.0)) == 0.75
    assert rise_ratio(Rise(30, math.inf, 1.0), spike) == math.inf
    nan_spike = Rise(10, math.nan, 1.0)
    assert rise_ratio(Rise(30, math.nan, 1.0), nan_spike) == 1.0
    assert rise_ratio(Rise(30, 1e9, 1.0), nan_spike) == 0.0  # a NaN spike comes back as one


def test_the_bar_decides_flag_or_no_flag() -> None:
    """The issue's case: the spike crossed the threshold by a hair (0.0191 against
    0.0187), the replay rose to 0.0161 without crossing it (0.77 of the spike's rise as
    a difference, 0.85 as a factor over the median): still the spike."""
    spike = Rise(171, 0.0191, 0.00606)
    replay = Rise(172, 0.0161, 0.00606)
    judgement = Judgement("loss", replay, spike, 0.5)
    assert judgement.still_spikes and round(judgement.ratio, 2) == 0.85
    said = "rises 0.85 of the spike's height (loss 0.0161 at step 172 (2.66x its median 0.00606)"
    assert said in judgement.describe()
    assert "the spike is still there (bar 0.5)" in judgement.describe()
    assert not Judgement("loss", replay, spike, 0.9).still_spikes
    assert Judgement.of(judgement.to_dict()) == judgement


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, math.nan, "half"])
def test_a_bar_outside_zero_to_one_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=r"RecoverConfig.recurrence=.* must be in \(0, 1\]"):
        check_bar(bad, "RecoverConfig.recurrence")  # type: ignore[arg-type]
    assert check_bar(1, "x") == 1.0
