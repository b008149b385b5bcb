"""What a finished loop adds up to: the totals of its accepted lineage, the rows that
compare it with doing nothing and with the module's variants (the demo's QK-norm), and
the lineage stitched into one TensorBoard run."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_spikes.callbacks.spike import Spike, group_episodes
from lit_spikes.callbacks.spike_detector import DEFAULT_SETTLE
from lit_spikes.callbacks.spike_marks import write_mark
from lit_spikes.tool_facts import ToolFacts
from lit_spikes.tools.recover.history import lineage_records
from lit_spikes.tools.recover.ledger import Ledger, Totals
from lit_spikes.tools.recover.measure import Measure, common_measure, validations

ACCEPTED_RUN = "accepted"
"""TensorBoard run of the stitched accepted lineage, ``<log_root>/accepted``."""
DO_NOTHING_ROW = ("compare/do_nothing", "do nothing (continue through the spike)")
"""The do-nothing row's branch and label; a variant's are ``compare/<name>`` and its own."""


def comparison_branches(facts: ToolFacts) -> list[tuple[str, str]]:
    """``(branch, label)`` of each comparison row the module may have, in the report's
    order: doing nothing, then its variants (``ToolFacts.variants``)."""
    return [DO_NOTHING_ROW, *((f"compare/{v.name}", v.label) for v in facts.variants)]


def last_validation(records: Sequence[dict[str, Any]], facts: ToolFacts) -> float | None:
    """The last value of the module's validation metric (``facts.val_metric``) in
    ``records`` (None: it names none, or none was logged)."""
    name = facts.val_metric
    by_step = validations(records)
    found = [by_step[s][name] for s in sorted(by_step) if name in by_step[s]]
    return found[-1] if found else None


def validated(records: Sequence[dict[str, Any]], facts: ToolFacts) -> dict[str, Any]:
    """``{metric: last value}`` of the module's validation metric, for an event (empty
    where the module names none)."""
    metric = facts.val_metric
    return {} if metric is None else {metric: last_validation(records, facts)}


def totals(
    ledger: Ledger, records: Sequence[dict[str, Any]], final_ckpt: Path, facts: ToolFacts
) -> Totals:
    """The loop's cost and its final run's counts, from the branches' own records and
    ``records``, the final lineage's; the validation metric ``facts`` names."""
    head = ledger.main_branches()[-1]
    steps = [r for r in records if "step" in r]
    main = ledger.main_branches()
    last = steps[-1]
    return Totals(
        lineage=[b.name for b, _, _ in ledger.lineage(head.name)],
        steps_final=len(steps),
        steps_trained=sum(b.steps_trained for b in main),
        steps_recomputed=sum(b.steps_trained for b in main) - len(steps),
        steps_repeated=sum(b.steps_repeated for b in ledger.branches),
        batches_skipped=int(last["position"] - last["step"]),
        skip_stepped=sorted(int(r["step"]) for r in steps if r.get("skipped")),
        unrecovered=ledger.lineage_spikes(head.name),
        final_ckpt=str(final_ckpt),
        val=None if facts.val_name is None else [facts.val_name, last_validation(records, facts)],
    )


def _largest_after(records: Sequence[dict[str, Any]], key: str, first: int) -> float | None:
    steps = (r for r in records if "step" in r and r["step"] >= first and key in r)
    return max((float(r[key]) for r in steps), default=None)


def _cells(
    records: Sequence[dict[str, Any]], spikes: int, first: int, facts: ToolFacts
) -> list[list[Any]]:
    """A row's cells, ``[header, value, digits]`` (digits None: a count): the module's
    validation metric where it names one, the spikes, its extra columns (``ToolFacts``)."""
    cells: list[list[Any]] = []
    if facts.val_name is not None:
        cells.append([facts.val_name, last_validation(records, facts), 3])
    cells.append(["spikes flagged", spikes, None])
    for column in facts.columns:
        header = f"{column.header} after 1st spike"
        cells.append([header, _largest_after(records, column.key, first), column.digits])
    return cells


def comparison_rows(
    ledger: Ledger, root: Path, records: Sequence[dict[str, Any]], facts: ToolFacts
) -> list[dict[str, Any]]:
    """Rows of the report: the recovered run (``records``: its lineage's), and with
    ``compare`` doing nothing and the module's variants. ``spikes`` counts flagged steps
    (the recovered run: those on its lineage that no remedy removed; a rejected branch's
    spike is not on it). ``measure`` is one measure of every row, named in
    ``measured_by`` (``measure``); ``cells``, the table's columns that the module provides
    (``ToolFacts``)."""
    assert ledger.totals is not None
    first = ledger.interventions[0].spike.step if ledger.interventions else 0
    recovered = "recovered (accepted lineage)"
    rows: list[dict[str, Any]] = [
        {
            "run": recovered,
            "spikes": len(ledger.totals.unrecovered),
            "cells": _cells(records, len(ledger.totals.unrecovered), first, facts),
        }
    ]
    measured: dict[str, Sequence[dict[str, Any]]] = {recovered: records}
    names = {b.name for b in ledger.branches}
    for name, label in comparison_branches(facts):
        if name not in names:
            continue
        row_records = lineage_records(ledger, root, name)
        spikes = len(ledger.lineage_spikes(name))
        rows.append(
            {
                "run": label,
                "spikes": spikes,
                "cells": _cells(row_records, spikes, first, facts),
            }
        )
        measured[label] = row_records
    measure = common_measure(measured, facts.val_metric)
    if facts.val_mode == "max" and measure.name.startswith(f"{facts.val_metric} at step"):
        measure = Measure(f"{measure.name}; higher is better", measure.values)
    for row in rows:
        row["measure"], row["measured_by"] = measure.values[row["run"]], measure.name
    return rows


STITCHED_TAGS = {
    "loss": "loss", "position": "data/position", "lr": "lr", "grad_norm": "grad_norm"
}  # fmt: skip
"""The tag of each per-step record key the stitched run logs for any module (``loss``:
where no branch's detector found the module's own chart of it, as the detector logs it)."""


def stitched_tags(facts: ToolFacts, charts: Mapping[str, str] | None = None) -> dict[str, str]:
    """Record key -> tag of the stitched run: ``STITCHED_TAGS``, the module's extra
    columns' keys, the module's own tags over them (``ToolFacts.curves``), and the charts
    the branches' detectors marked (``BranchRecord.charts``): the branches' tags."""
    columns = {c.key: c.key for c in facts.columns}
    return {**STITCHED_TAGS, **columns, **facts.curves, **(charts or {})}


def write_stitched_run(
    run_dir: Path,
    records: Sequence[dict[str, Any]],
    spikes: Sequence[Spike] = (),
    facts: ToolFacts | None = None,
    charts: Mapping[str, str] | None = None,
) -> None:
    """Write the accepted lineage as one TensorBoard run, each step once: the branches'
    tags (``stitched_tags``), validation at the index of its last step (as Lightning
    logs it), ``spike/<metric>`` at each of ``spikes`` and each episode's mark (a
    one-point run at the spike's reference, as ``SpikeDetector`` draws it)."""
    tags = stitched_tags(facts or ToolFacts(), charts)
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(run_dir, ignore_errors=True)
    steps = [int(r["step"]) for r in records if "step" in r]
    if len(steps) != len(set(steps)):
        raise RuntimeError(f"the stitched lineage holds a step twice: {sorted(steps)}")
    writer = SummaryWriter(log_dir=str(run_dir))
    try:
        for record in records:
            if "step" in record:
                for key, tag in tags.items():
                    if key in record:
                        writer.add_scalar(tag, float(record[key]), int(record["step"]))
                if record.get("skipped"):
                    writer.add_scalar("skip_step/skipped", 1.0, int(record["step"]))
            else:
                for name, value in validations([record]).get(int(record["val_step"]), {}).items():
                    writer.add_scalar(name, value, int(record["val_step"]) - 1)
        for spike in spikes:
            writer.add_scalar(f"spike/{spike.metric}", spike.value, spike.step)
    finally:
        writer.close()
    for episode in group_episodes(spikes, DEFAULT_SETTLE):
        onset = episode.onset
        write_mark(run_dir, tags.get(onset.metric, onset.metric), onset.step, onset.reference)


def conclude(
    ledger: Ledger, root: Path, records: Sequence[dict[str, Any]], final: Path, facts: ToolFacts
) -> None:
    """A finished loop's totals and comparison rows into ``ledger``, and its accepted
    lineage (``records``) as the stitched TensorBoard run ``<root>/accepted``."""
    ledger.totals = totals(ledger, records, final, facts)
    ledger.comparison = comparison_rows(ledger, root, records, facts)
    charts = next((b.charts for b in ledger.branches if b.charts), {})  # the base run's
    write_stitched_run(root / ACCEPTED_RUN, records, ledger.totals.unrecovered, facts, charts)
