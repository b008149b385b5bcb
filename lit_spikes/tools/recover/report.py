"""The ledger as a person reads it: each spike and the remedies tried, the totals, and
what the loop bought against doing nothing."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lit_spikes.tools.recover.ledger import BranchRecord, Ledger, Totals
from lit_spikes.tools.recover.remedies import describe_remedy


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _interventions_table(ledger: Ledger) -> Table:
    table = Table(title="Spike recovery ledger")
    for column in ("spike", "checkpoint", "remedy", "outcome"):
        table.add_column(column)
    for column in ("steps trained", "batches skipped", "wall time (s)"):
        table.add_column(column, justify="right")

    def add(first: bool, spike: str, ckpt: str, branch: BranchRecord, outcome: str) -> None:
        table.add_row(
            spike if first else "",
            ckpt if first else "",
            describe_remedy(branch.remedies[-1]) if branch.remedy else "none",
            outcome,
            str(branch.steps_trained),
            str(branch.batches_skipped),
            f"{branch.wall_s:.1f}",
        )

    for intervention in ledger.interventions:
        spike = intervention.spike
        value, reference = spike.value, spike.reference
        label = f"#{intervention.index + 1} step {spike.step}: {spike.metric} {value:.3f}"
        if reference > 0:  # False for NaN: a record of before the reference was kept
            label += f" ({value / reference:.2f}x)"
        before = spike.step - intervention.ckpt_step
        ckpt = f"step {intervention.ckpt_step} ({before} before)"
        for i, name in enumerate(intervention.tried):
            branch = ledger.branch(name)
            outcome = intervention.outcomes.get(name) or branch.status
            add(i == 0, label, ckpt, branch, outcome)
    for branch in ledger.branches:
        if branch.kind == "continue":
            add(True, branch.note, f"step {branch.start_step}", branch, "trained on as it was")
    return table


def _totals_lines(ledger: Ledger, totals: Totals) -> list[str]:
    share = totals.steps_recomputed / max(1, totals.steps_final)
    unrecovered = [int(s["step"]) for s in totals.unrecovered]
    return [
        f"Accepted lineage: {' -> '.join(totals.lineage)} ({totals.steps_final} steps)",
        f"Steps trained in all: {totals.steps_trained} = {totals.steps_final} + "
        f"{totals.steps_recomputed} recomputed ({share:.1%})"
        + (
            f", and {totals.steps_repeated} redone after interruptions"
            if totals.steps_repeated
            else ""
        )
        + f"; batches skipped: {totals.batches_skipped}; updates dropped by skip-step: "
        f"{len(totals.skip_stepped)}" + (f" {totals.skip_stepped}" if totals.skip_stepped else ""),
        f"Unrecovered spikes: {unrecovered or 'none'}; {_validation(totals)}wall time "
        f"{ledger.wall_s:.1f} s over {ledger.sessions} session(s)",
        f"Final checkpoint: {totals.final_ckpt}",
    ]


def _validation(totals: Totals) -> str:
    """The final validation for the totals line: the module's metric (``ToolFacts``; a
    version-2 ledger's ``val_bpc`` is read as it)."""
    if totals.val is None:
        return ""
    name, value = totals.val
    return f"{name} {_fmt(value)}; "


def _cells(row: dict[str, Any]) -> list[list[Any]]:
    """The row's ``[header, value, digits]`` cells; a row written before they were
    recorded: the built-in model's columns."""
    if "cells" in row:
        return [list(cell) for cell in row["cells"]]
    return [
        ["val bits/char", row["val_bpc"], 3],
        ["spikes flagged", row["spikes"], None],
        ["max attn logit after 1st spike", row["max_logit_after"], 1],
    ]


def _comparison_table(ledger: Ledger) -> Table:
    measured_by = ledger.comparison[0].get("measured_by") if ledger.comparison else None
    caption = f"compared by {measured_by}" if measured_by else None  # (an older ledger)
    compare = Table(title="What the loop bought", caption=caption)
    compare.add_column("run")
    for header, _, _ in _cells(ledger.comparison[0]):
        compare.add_column(header, justify="right")
    compare.add_column("compared", justify="right")
    for row in ledger.comparison:
        cells = [str(v) if d is None else _fmt(v, d) for _, v, d in _cells(row)]
        compare.add_row(row["run"], *cells, _fmt(row.get("measure"), 4))
    return compare


def print_ledger(ledger: Ledger, console: Console | None = None) -> None:
    """The ledger as tables: each spike and remedy tried, the totals, the comparison."""
    console = console or Console()
    console.print(_interventions_table(ledger))
    if ledger.totals is not None:
        for line in _totals_lines(ledger, ledger.totals):
            console.print(escape(line))
    if len(ledger.comparison) > 1:
        console.print(_comparison_table(ledger))
