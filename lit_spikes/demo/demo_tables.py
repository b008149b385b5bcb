"""The demos' reports and how they are shown: the rows each table holds, the tables
themselves (rich on the console, markdown for TensorBoard's text view) and the printed
observations; and demo 3, PaLM's cost in round numbers. Computing the reports from the
runs is ``lit_spikes.demo.demos``'s (which re-exports everything here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rich.console import Console
from rich.table import Table


class SetupView(Protocol):
    """What the tables read of a demo setup (``demos.DemoSetup``)."""

    @property
    def ckpt_step(self) -> int: ...

    @property
    def steps(self) -> int: ...


class PlanView(Protocol):
    """What the tables read of demo 2's plan (``demos.SpikePlan``)."""

    @property
    def onset(self) -> int: ...

    @property
    def ckpt_step(self) -> int: ...


# ----------------------------------------------------------------------------- rows


@dataclass
class Demo1Row:
    label: str
    max_param_diff: float
    early_max_loss: float
    val_bpc: float


@dataclass
class Demo1Report:
    rows: list[Demo1Row]
    exact_losses_equal: bool
    compared_steps: int
    observations: list[str]


@dataclass
class Demo2Row:
    label: str
    max_loss: float
    max_logit: float
    losses_at: list[float]
    val_bpc: float
    start_step: int


@dataclass
class Demo2Report:
    plan: PlanView
    steps_at: list[int]
    rows: list[Demo2Row]
    observations: list[str]


@dataclass
class LedgerRow:
    remedy: str
    steps_recomputed: int
    batches_skipped: int
    wall_s: float


# ----------------------------------------------------------------------------- tables


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub/TensorBoard markdown table, first column left-aligned, the rest right."""
    # A "|" in a cell (the header's "max |param - reference|") would end it: escaped.
    cells = [header, *rows]
    lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in cells]
    lines.insert(1, "|---" + "|---:" * (len(header) - 1) + "|")
    return "\n".join(lines)


def demo1_columns(setup: SetupView, report: Demo1Report) -> tuple[list[str], list[list[str]]]:
    k = setup.ckpt_step
    header = ["run", "max |param - reference|", f"max loss, steps {k}-{k + 9}", "val bits/char"]
    rows = [
        [r.label, f"{r.max_param_diff:.1e}", f"{r.early_max_loss:.3f}", f"{r.val_bpc:.3f}"]
        for r in report.rows
    ]
    return header, rows


def demo2_columns(setup: SetupView, report: Demo2Report) -> tuple[list[str], list[list[str]]]:
    k = report.plan.ckpt_step
    hi = min(k + 100, setup.steps)
    header = [
        "remedy",
        f"max loss {k}-{hi - 1}",
        "max attn logit",
        *(f"loss @{s}" for s in report.steps_at),
        "val bits/char",
    ]
    rows = [
        [
            r.label,
            f"{r.max_loss:.3f}",
            f"{r.max_logit:.1f}",
            *(f"{v:.3f}" for v in r.losses_at),
            f"{r.val_bpc:.3f}",
        ]
        for r in report.rows
    ]
    return header, rows


def _rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    """A rich table of ``header`` and ``rows``, first column left-aligned, the rest right."""
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def print_demo1(setup: SetupView, report: Demo1Report, console: Console | None = None) -> None:
    console = console or Console()
    header, rows = demo1_columns(setup, report)
    title = f"Demo 1: checkpoint at step {setup.ckpt_step}, resumed to step {setup.steps}"
    console.print(_rich_table(title, header, rows))
    console.print(
        f"Every logged training loss of the exact resume ({report.compared_steps} steps) equals "
        f"the reference: [bold]{report.exact_losses_equal}[/bold]"
    )
    for i, text in enumerate(report.observations, 1):
        console.print(f"  {i}. {text}")


def print_demo2(setup: SetupView, report: Demo2Report, console: Console | None = None) -> None:
    console = console or Console()
    header, rows = demo2_columns(setup, report)
    title = (
        f"Demo 2: remedies from the step-{report.plan.ckpt_step} checkpoint "
        f"(spike detected at step {report.plan.onset})"
    )
    console.print(_rich_table(title, header, rows))
    for i, text in enumerate(report.observations, 1):
        console.print(f"  {i}. {text}")


# ----------------------------------------------------------------------------- demo 3


@dataclass(frozen=True)
class PalmCost:
    """PaLM's spike handling, in round numbers (PaLM paper, section 5.1 and table 1)."""

    spikes: int = 20
    """Loss spikes during training ('about 20')."""
    rollback_steps: int = 100
    """Steps rolled back for each spike ('about 100 steps before the spike')."""
    skip_min: int = 200
    """Fewest batches skipped per spike."""
    skip_max: int = 500
    """Most batches skipped per spike."""
    total_steps: int = 255_000
    """Steps of the whole run."""
    final_batch_tokens: int = 2048 * 2048
    """Tokens per batch at the end of training (2048 sequences x 2048 tokens)."""
    total_tokens: float = 780e9
    """Tokens of the whole run."""

    def __post_init__(self) -> None:
        for name in ("spikes", "rollback_steps", "total_steps", "final_batch_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PalmCost.{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.skip_min <= self.skip_max:
            raise ValueError(f"need 0 <= skip_min={self.skip_min} <= skip_max={self.skip_max}")

    @property
    def recomputed(self) -> int:
        return self.spikes * self.rollback_steps

    @property
    def skipped(self) -> tuple[int, int]:
        return self.spikes * self.skip_min, self.spikes * self.skip_max

    @property
    def skipped_tokens_max(self) -> float:
        return self.skipped[1] * self.final_batch_tokens

    def lines(self) -> list[str]:
        lo, hi = self.skipped
        return [
            f"about {self.spikes} spikes x a rollback of about {self.rollback_steps} steps = "
            f"{self.recomputed:,} steps recomputed, {self.recomputed / self.total_steps:.1%} "
            f"of {self.total_steps:,} steps",
            f"skipped data: {self.spikes} x {self.skip_min}-{self.skip_max} batches = "
            f"{lo:,}-{hi:,} batches; at the final batch of "
            f"{self.final_batch_tokens / 1e6:.1f}M tokens at most about "
            f"{self.skipped_tokens_max / 1e9:.0f}B tokens, "
            f"{self.skipped_tokens_max / self.total_tokens:.0%} of {self.total_tokens / 1e9:.0f}B "
            "(an upper bound: earlier batches were smaller)",
        ]


def print_demo3(
    cost: PalmCost, ledger: list[LedgerRow] | None = None, console: Console | None = None
) -> None:
    console = console or Console()
    console.rule("Demo 3: what PaLM's remedy cost (rough accounting)")
    for line in cost.lines():
        console.print(f"  {line}")
    if ledger:
        header = ["remedy", "steps recomputed up to the spike", "batches skipped", "wall time (s)"]
        rows = [
            [row.remedy, str(row.steps_recomputed), str(row.batches_skipped), f"{row.wall_s:.1f}"]
            for row in ledger
        ]
        title = "The same ledger for demo 2 (per remedy branch)"
        console.print(_rich_table(title, header, rows))
    console.print(
        "  The recomputation is cheap (about 1% of the steps); the real cost is people: "
        "someone must notice each spike, choose the checkpoint, and decide how much to skip."
    )
