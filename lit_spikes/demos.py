"""The seed's demos rebuilt on Lightning: runs, tables and observations computed from them.

Demo 1 (checkpoint and resume) and demo 2 (remedies for a spike) share one reference
run: it trains from scratch with a spike detector, writes ``step=<k>.ckpt`` files, and
every other row is a branch resumed from one of those real checkpoint files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lit_spikes.ablations import ForgetOptimizerState
from lit_spikes.branches import Branch, BranchResult
from lit_spikes.data import DataConfig
from lit_spikes.model import GPTConfig
from lit_spikes.module import OptimConfig
from lit_spikes.training import checkpoint_path


@dataclass
class DemoSetup:
    """The shared setup of the demos; the defaults are the seed's (and the README's)."""

    gpt: GPTConfig = field(default_factory=GPTConfig)
    """Model shape: 4 layers, d 64, context 64, no QK-norm."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW at peak LR 0.1, 100 warm-up steps, cosine to 10%, 400 steps."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data seed, batch 16."""
    model_seed: int = 2
    """Initialisation seed of the model."""
    ckpt_step: int = 100
    """Demo 1 resumes from the checkpoint of this step."""
    checkpoint_every: int = 50
    """The reference run writes ``step=<k>.ckpt`` every this many steps."""
    val_every: int = 100
    """Validation interval (it must divide the run length, so every row ends validated)."""
    other_data_seed: int = 7
    """Data seed of demo 1's 'data order changed' row."""
    log_root: Path = Path("runs")
    """TensorBoard root: each demo writes ``<log_root>/demo<k>/<row>``."""
    workers: int = 2
    """Worker processes for the branches (one CPU thread each)."""

    def __post_init__(self) -> None:
        steps = self.optim.max_steps
        if not 0 < self.ckpt_step < steps:
            raise ValueError(f"ckpt_step={self.ckpt_step} must be in (0, {steps})")
        if self.ckpt_step % self.checkpoint_every:
            raise ValueError(
                f"ckpt_step={self.ckpt_step} must be a multiple of "
                f"checkpoint_every={self.checkpoint_every}, or no checkpoint is written there"
            )
        if steps % self.val_every:
            raise ValueError(f"val_every={self.val_every} must divide max_steps={steps}")

    @property
    def steps(self) -> int:
        return self.optim.max_steps

    def branch(self, name: str, label: str, **changes: object) -> Branch:
        base = Branch(
            name=name,
            label=label,
            max_steps=self.steps,
            gpt=self.gpt,
            optim=self.optim,
            data=self.data,
            model_seed=self.model_seed,
            val_every=self.val_every,
        )
        return replace(base, **changes)  # type: ignore[arg-type]

    def reference(self, demo_dir: str = "demo1", **changes: object) -> Branch:
        """The uninterrupted run that writes the checkpoints every branch resumes from."""
        return self.branch(
            "reference",
            "uninterrupted (reference)",
            checkpoint_every=self.checkpoint_every,
            **changes,
        )

    def checkpoint(self, step: int, demo_dir: str = "demo1") -> Path:
        return checkpoint_path(self.log_root / demo_dir / "reference", step)


# ----------------------------------------------------------------------------- demo 1


def demo1_branches(setup: DemoSetup) -> list[Branch]:
    """Demo 1's resumes, each from the reference run's ``step=<ckpt_step>.ckpt``."""
    ckpt = setup.checkpoint(setup.ckpt_step)
    return [
        setup.branch("resume_exact", "resume: params + optimizer + data position", ckpt_path=ckpt),
        setup.branch(
            "resume_fresh_adamw",
            "resume: optimizer state forgotten (fresh AdamW)",
            ckpt_path=ckpt,
            callbacks=[ForgetOptimizerState()],
        ),
        setup.branch(
            "resume_data_seed_7",
            f"resume: data order changed (data seed {setup.other_data_seed})",
            ckpt_path=ckpt,
            data=replace(setup.data, seed=setup.other_data_seed),
        ),
    ]


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


def max_param_diff(a: BranchResult, b: BranchResult) -> float:
    return max((a.state[k].double() - b.state[k].double()).abs().max().item() for k in a.state)


def demo1_report(
    setup: DemoSetup, reference: BranchResult, results: dict[str, BranchResult]
) -> Demo1Report:
    k = setup.ckpt_step
    ordered = [reference, *(results[b.name] for b in demo1_branches(setup))]
    rows = [
        Demo1Row(r.label, max_param_diff(r, reference), r.window(k, k + 10), r.val_bpc)
        for r in ordered
    ]
    exact, fresh, other = (results[b.name] for b in demo1_branches(setup))
    ref_losses = reference.losses()
    exact_losses = exact.losses()
    equal = all(ref_losses[s] == loss for s, loss in exact_losses.items())
    observations = []
    diff = rows[1].max_param_diff
    observations.append(
        f"Exact resume: largest parameter difference {diff:.1e} and "
        + (
            f"all {len(exact_losses)} training losses after step {k} equal to the reference: "
            "the resumed run IS the original run (PaLM: bitwise reproducible from any checkpoint)."
            if diff == 0.0 and equal
            else "the resumed run is NOT bit-equal to the reference: the checkpoint misses state."
        )
    )
    before = ref_losses[k - 1] if k - 1 in ref_losses else ref_losses[k]
    jump = fresh.window(k, k + 10)
    observations.append(
        f"Fresh AdamW: Adam's first update with zero moments moves every weight by about the "
        f"full LR; the loss goes from {before:.3f} (step {k - 1}) to at most {jump:.3f} in the "
        f"next 10 steps and the run ends at {fresh.val_bpc:.3f} bits/char, "
        + _compare(fresh.val_bpc, reference.val_bpc)
        + " the reference."
    )
    observations.append(
        f"Data order changed (seed {setup.other_data_seed}): another trajectory, ending at "
        f"{other.val_bpc:.3f} bits/char, "
        + _compare(other.val_bpc, reference.val_bpc)
        + " the reference. Better or worse, nobody can confirm any more that the resumed run "
        "is the original one."
    )
    return Demo1Report(rows, equal, len(exact_losses), observations)


def _compare(value: float, reference: float) -> str:
    if math.isclose(value, reference, rel_tol=0.0, abs_tol=0.005):
        return f"about the same as ({reference:.3f})"
    return f"{'worse' if value > reference else 'better'} than ({reference:.3f})"


def print_demo1(setup: DemoSetup, report: Demo1Report, console: Console | None = None) -> None:
    console = console or Console()
    k = setup.ckpt_step
    table = Table(title=f"Demo 1: checkpoint at step {k}, resumed to step {setup.steps}")
    table.add_column("run")
    table.add_column("max |param - reference|", justify="right")
    table.add_column(f"max loss, steps {k}-{k + 9}", justify="right")
    table.add_column("val bits/char", justify="right")
    for row in report.rows:
        table.add_row(
            row.label,
            f"{row.max_param_diff:.1e}",
            f"{row.early_max_loss:.3f}",
            f"{row.val_bpc:.3f}",
        )
    console.print(table)
    console.print(
        f"Every logged training loss of the exact resume ({report.compared_steps} steps) equals "
        f"the reference: [bold]{report.exact_losses_equal}[/bold]"
    )
    for i, text in enumerate(report.observations, 1):
        console.print(f"  {i}. {text}")
