"""One measure for every row of recover's comparison, taken where the rows are comparable.

A recovered run that skipped N batches trains data position ``p`` at step ``p - N``: its
last steps' losses are of other batches than the do-nothing run's (0.421 against 0.475,
while over the same batches the two were 0.454 and 0.451). The rows are compared by the
module's validation metric at a step every row validated, where it logs one; else by the
training loss averaged over one window of data positions that every row trained after
its last skip, so that all rows are measured on the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

WINDOW = 50
"""Data positions averaged at most (the last ones every row trained after its skips)."""
PREFERRED = ("val_loss", "val/loss")
"""Validation metrics chosen, in order, where every row logs them and the module names
none (``ToolFacts.val_metric``); else the first, by name, that every row logs."""


@dataclass(frozen=True)
class Measure:
    """What the comparison's rows are measured by, and each row's value (None: none)."""

    name: str
    """What it is and where, for the report: the metric, its step or its window."""
    values: dict[str, float | None]


def validations(records: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, float]]:
    """Each validation's metrics by step (a history of version 2 records ``val/bpc``)."""
    found: dict[int, dict[str, float]] = {}
    for record in records:
        if "val_step" not in record:
            continue
        metrics = dict(record.get("val") or {})
        if "val_bpc" in record:
            metrics.setdefault("val/bpc", float(record["val_bpc"]))
        found.setdefault(int(record["val_step"]), {}).update(metrics)
    return found


def _by_validation(
    rows: Mapping[str, Sequence[Mapping[str, Any]]], preferred: str | None
) -> Measure | None:
    validated = {run: validations(records) for run, records in rows.items()}
    common: set[str] | None = None
    for by_step in validated.values():
        names = {name for metrics in by_step.values() for name in metrics}
        common = names if common is None else common & names
    if not common:
        return None
    choices = (preferred, *PREFERRED) if preferred is not None else PREFERRED
    name = next((n for n in choices if n in common), None) or sorted(common)[0]
    steps = None
    for by_step in validated.values():
        have = {step for step, metrics in by_step.items() if name in metrics}
        steps = have if steps is None else steps & have
    if not steps:
        return None
    step = max(steps)
    values = {run: float(by_step[step][name]) for run, by_step in validated.items()}
    return Measure(f"{name} at step {step} (the last validation of every run)", dict(values))


def _after_last_skip(records: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Loss by data position over the row's last unbroken stretch of positions."""
    trained = sorted(
        (int(r["position"]), float(r["loss"])) for r in records if "step" in r and "position" in r
    )
    stretch: dict[int, float] = {}
    last = None
    for position, loss in trained:
        if last is not None and position != last + 1:
            stretch = {}  # a skip window (or a gap): the window lies after it
        stretch[position], last = loss, position
    return stretch


def _by_training_loss(rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> Measure:
    stretches = {run: _after_last_skip(records) for run, records in rows.items()}
    if not stretches or not all(stretches.values()):
        return Measure("train loss (a row trained no step)", dict.fromkeys(rows))
    end = min(max(s) for s in stretches.values()) + 1
    start = max(end - WINDOW, *(min(s) for s in stretches.values()))
    if start >= end:
        name = "train loss (no data position every run trained after its skips)"
        return Measure(name, dict.fromkeys(rows))
    values: dict[str, float | None] = {}
    for run, stretch in stretches.items():
        losses = [stretch[p] for p in range(start, end)]
        mean = sum(losses) / len(losses)
        values[run] = None if math.isnan(mean) else mean
    name = (
        f"train loss, mean over data positions {start}-{end - 1} (the same {end - start} "
        "batches in every run, after every run's skipped ones)"
    )
    return Measure(name, values)


def common_measure(
    rows: Mapping[str, Sequence[Mapping[str, Any]]], preferred: str | None = None
) -> Measure:
    """The measure of ``rows`` (each row's step and validation records, by name):
    ``preferred`` (the module's ``ToolFacts.val_metric``) first where every row logs it."""
    return _by_validation(rows, preferred) or _by_training_loss(rows)
