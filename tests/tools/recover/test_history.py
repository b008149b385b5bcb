"""A branch's per-step records under DDP: the global values of the step, as the detector
judges them (the mean loss) and as the comparison reads the module's columns (the largest
of the ranks'), for any module's columns, not one key of the demo's."""

from __future__ import annotations

import math

from lit_spikes.tools.recover.history import global_record


def test_the_loss_is_the_ranks_mean_and_each_column_their_largest() -> None:
    record = {"step": 7, "loss": 1.0, "lr": 0.1, "grad_peak": 3.0, "position": 7}
    ranks = [[1.0, 3.0, 0.5], [2.0, 5.0, math.nan]]  # [loss, grad_peak, acc]
    merged = global_record(record, ranks, ("grad_peak", "acc"))
    assert merged["loss"] == 1.5 and merged["rank_loss"] == [1.0, 2.0]
    assert merged["grad_peak"] == 5.0  # rank 1's, larger than this rank's own 3.0
    assert math.isnan(merged["acc"])  # one rank logged none this step: not a largest
    assert list(merged)[:5] == ["step", "loss", "lr", "grad_peak", "position"]  # in place
    assert record["loss"] == 1.0  # this rank's record left as it was


def test_a_column_no_rank_logged_stays_out_of_the_record() -> None:
    merged = global_record({"step": 3, "loss": 2.0}, [[2.0, math.nan], [4.0, math.nan]], ("x",))
    assert merged == {"step": 3, "loss": 3.0, "rank_loss": [2.0, 4.0]}
