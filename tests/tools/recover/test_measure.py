"""recover's one measure of every comparison row (issue 55): the validation metric every
row logs, at the last step every row validated; else the train loss over the same data
positions, after every row's skipped ones."""

from __future__ import annotations

from typing import Any

from lit_spikes.tools.recover.measure import WINDOW, common_measure


def steps(positions: list[int], loss: Any = float) -> list[dict[str, Any]]:
    """Step records training ``positions`` in order, each position's loss the position."""
    return [{"step": s, "position": p, "loss": loss(p)} for s, p in enumerate(positions)]


def test_the_train_loss_is_averaged_over_the_same_positions_after_every_skip() -> None:
    plain = steps(list(range(100)))
    skipped = steps([*range(40), *range(46, 106)])  # positions 40-45 skipped at step 40
    measure = common_measure({"recovered": skipped, "nothing": plain})
    # The last steps (90-99) were positions 96-105 in one run and 90-99 in the other
    window = range(max(46, 100 - WINDOW), 100)
    assert measure.name.startswith(f"train loss, mean over data positions {window[0]}-99 ")
    assert measure.values == dict.fromkeys(["recovered", "nothing"], sum(window) / len(window))


def test_the_window_starts_after_the_latest_skip_of_any_row() -> None:
    late = steps([*range(90), *range(95, 105)])
    measure = common_measure({"late": late, "plain": steps(list(range(100)))})
    assert measure.name.startswith("train loss, mean over data positions 95-99 (the same 5 ")


def test_no_position_every_row_trained_after_its_skips_is_said() -> None:
    measure = common_measure({"a": steps([0, 1, 5, 6]), "b": steps([0, 1, 2, 3])})
    assert measure.name == "train loss (no data position every run trained after its skips)"
    assert measure.values == {"a": None, "b": None}


def test_a_validation_metric_every_row_logs_is_compared_at_their_last_common_step() -> None:
    def validated(steps_values: dict[int, float], **more: float) -> list[dict[str, Any]]:
        return [{"val_step": s, "val": {"val_loss": v, **more}} for s, v in steps_values.items()]

    rows = {
        "recovered": steps(list(range(30))) + validated({10: 1.0, 20: 0.5, 30: 0.25}, val_acc=1),
        "nothing": steps(list(range(20))) + validated({10: 2.0, 20: 0.75}),
    }
    measure = common_measure(rows)
    assert measure.name == "val_loss at step 20 (the last validation of every run)"
    assert measure.values == {"recovered": 0.5, "nothing": 0.75}


def test_val_bpc_comes_first_and_histories_of_version_2_count() -> None:
    old = [{"val_step": 10, "val_bpc": 1.5}]  # a version-2 history: val/bpc only
    new = [{"val_step": 10, "val_bpc": 1.25, "val": {"val/bpc": 1.25, "val_loss": 3.0}}]
    measure = common_measure({"old": old, "new": new})
    assert measure.name.startswith("val/bpc at step 10")
    assert measure.values == {"old": 1.5, "new": 1.25}
