"""The seed's demos rebuilt on Lightning: runs, tables and observations computed from them.

Demo 1 (checkpoint and resume) and demo 2 (remedies for a spike) share one reference
run: it trains from scratch with a spike detector, writes ``step=<k>.ckpt`` files, and
every other row is a branch resumed from one of those real checkpoint files.

Here: the setup, the branches each demo runs and the reports computed from their results.
The reports' rows, their tables and demo 3's accounting are ``lit_spikes.demo.demo_tables``'s,
re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lit_spikes.demo.ablations import ForgetOptimizerState
from lit_spikes.demo.branches import Branch, BranchResult
from lit_spikes.demo.data import DataConfig
from lit_spikes.demo.demo_tables import (
    Demo1Report,
    Demo1Row,
    Demo2Report,
    Demo2Row,
    LedgerRow,
    PalmCost,
    PlanView,
    SetupView,
    demo1_columns,
    demo2_columns,
    markdown_table,
    print_demo1,
    print_demo2,
    print_demo3,
)
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import DEFAULT_MODEL_SEED, OptimConfig
from lit_spikes.shared.cores import usable_cores
from lit_spikes.shared.training import checkpoint_path

__all__ = [
    "DEMO_BRANCHES",
    "REFERENCE",
    "Demo1Report",
    "Demo1Row",
    "Demo2Report",
    "Demo2Row",
    "DemoSetup",
    "LedgerRow",
    "NoSpikeAfterWarmup",
    "PalmCost",
    "PlanView",
    "SetupView",
    "SpikePlan",
    "default_workers",
    "demo1_branches",
    "demo1_columns",
    "demo1_report",
    "demo2_branches",
    "demo2_columns",
    "demo2_ledger",
    "demo2_report",
    "markdown_table",
    "max_param_diff",
    "plan_remedies",
    "print_demo1",
    "print_demo2",
    "print_demo3",
    "usable_cores",
]

REFERENCE = "demo1/reference"
"""The reference run's name, hence its directory under the log root."""


DEMO_BRANCHES = 7
"""Branches of demos 1 and 2 together: more workers than this would idle."""


def default_workers() -> int:
    """Worker processes that give each usable core (``usable_cores``) one training
    process, counting the main process. More processes than cores time-share them: 3
    plain training loops on this project's 2 cores got 4% less done than 2 did, and the
    main job took 2% longer."""
    return max(1, min(usable_cores() - 1, DEMO_BRANCHES))


@dataclass
class DemoSetup:
    """The shared setup of the demos; the defaults are the seed's (and the README's)."""

    gpt: GPTConfig = field(default_factory=GPTConfig)
    """Model shape: 4 layers, d 64, context 64, no QK-norm."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW at peak LR 0.1, 100 warm-up steps, cosine to 10%, 400 steps."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data seed, batch 16."""
    model_seed: int = DEFAULT_MODEL_SEED
    """Initialisation seed of the model."""
    ckpt_step: int = 100
    """Demo 1 resumes from the checkpoint of this step."""
    checkpoint_every: int = 50
    """The reference run writes ``step=<k>.ckpt`` every this many steps."""
    val_every: int = 100
    """The reference run's validation interval (it must divide the run length); the
    branches validate once, at their end, which is all their table rows need."""
    other_data_seed: int = 7
    """Data seed of demo 1's 'data order changed' row."""
    rollback_distance: int = 20
    """Demo 2 resumes from the newest checkpoint at least this many steps before the spike."""
    skip_window: int = 30
    """Data positions each of demo 2's skip windows covers (the seed's 30)."""
    log_root: Path = Path("runs")
    """TensorBoard root: each demo writes ``<log_root>/demo<k>/<row>``."""
    figures_dir: Path | None = None
    """Where the comparison PNGs go as well as ``<log_root>/demo<k>/`` (the README's)."""
    workers: int = field(default_factory=default_workers)
    """Worker processes for the branches, beside this process, which trains too (one CPU
    thread each): by default one per core but this process's, at most one per branch."""
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``pl.Trainer`` arguments for every run, e.g. ``devices=2, strategy="ddp"``:
    then each run spans the processes and the runs go one after the other."""

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

    @property
    def distributed(self) -> bool:
        """Whether every run spans several processes (Lightning DDP)."""
        devices = self.trainer_kwargs.get("devices", 1)
        nodes = self.trainer_kwargs.get("num_nodes", 1)
        return (isinstance(devices, int) and devices > 1) or int(nodes) > 1

    def branch(self, name: str, label: str, **changes: object) -> Branch:
        base = Branch(
            name=name,
            label=label,
            max_steps=self.steps,
            gpt=self.gpt,
            optim=self.optim,
            data=self.data,
            model_seed=self.model_seed,
            val_every=self.steps,
            trainer_kwargs=dict(self.trainer_kwargs),
        )
        return replace(base, **changes)  # type: ignore[arg-type]

    def reference(self, **changes: object) -> Branch:
        """The uninterrupted run that writes the checkpoints every branch resumes from;
        it watches for spikes (demo 2 needs them) without acting on them."""
        from lit_spikes.callbacks import SpikeDetector

        # Judged every step: the main job plans demo 2's branches as soon as the spike shows.
        # The demo's own rule, 1.4x the mean of the last 20 steps (configs/ say the same):
        # its tables were measured with it (the default, robust_z, flags 150-152 there).
        detector = SpikeDetector(
            min_step=self.optim.warmup_steps, ratio=1.4, read_every=1, curves={"loss": "train/loss"}
        )
        changes.setdefault("callbacks", [detector])
        changes.setdefault("val_every", self.val_every)
        return self.branch(
            REFERENCE,
            "uninterrupted (reference)",
            checkpoint_every=self.checkpoint_every,
            **changes,
        )

    def checkpoint(self, step: int) -> Path:
        return checkpoint_path(self.log_root / REFERENCE, step)


# ----------------------------------------------------------------------------- demo 1


def demo1_branches(setup: DemoSetup) -> list[Branch]:
    """Demo 1's resumes, each from the reference run's ``step=<ckpt_step>.ckpt``."""
    ckpt = setup.checkpoint(setup.ckpt_step)
    return [
        setup.branch(
            "demo1/resume_exact", "resume: params + optimizer + data position", ckpt_path=ckpt
        ),
        setup.branch(
            "demo1/resume_fresh_adamw",
            "resume: optimizer state forgotten (fresh AdamW)",
            ckpt_path=ckpt,
            callbacks=[ForgetOptimizerState()],
        ),
        setup.branch(
            "demo1/resume_other_data_seed",
            f"resume: data order changed (data seed {setup.other_data_seed})",
            ckpt_path=ckpt,
            data=replace(setup.data, seed=setup.other_data_seed),
        ),
    ]


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


# ----------------------------------------------------------------------------- demo 2


@dataclass
class SpikePlan:
    """Where the reference run spiked and what demo 2 branches from."""

    onset: int
    """First step of the first spike the detector flagged after warm-up."""
    ckpt_step: int
    """Step of the checkpoint the remedies resume from (RollbackRestore's choice)."""
    ckpt_path: Path
    skip_before: tuple[int, int]
    """Data positions of the window that ends where the spike starts."""
    skip_straddle: tuple[int, int]
    """Data positions of the window that straddles the spike's start."""
    spike_value: float = float("nan")
    """The loss at the onset."""
    spike_reference: float = float("nan")
    """The detector's reference (rolling mean) the onset was compared with."""


class NoSpikeAfterWarmup(RuntimeError):
    """The reference run had no loss spike after warm-up: demo 2 has nothing to remedy
    (demo 1 does not need one)."""


def plan_remedies(setup: DemoSetup, spikes: list[dict[str, Any]]) -> SpikePlan:
    """Derive demo 2's checkpoint and skip windows from the spikes the detector found.

    Raises:
        NoSpikeAfterWarmup: the reference run had no spike after warm-up.
    """
    from lit_spikes.callbacks.rollback import RollbackRestore

    after = sorted(
        (s for s in spikes if int(s["step"]) >= setup.optim.warmup_steps),
        key=lambda s: int(s["step"]),
    )
    if not after:
        raise NoSpikeAfterWarmup(
            "the reference run had no loss spike after warm-up, so demo 2 has nothing to "
            f"remedy (spike steps: {[s['step'] for s in spikes]}). The spike depends on the "
            "CPU's kernels and on the seeds: from Python, DemoSetup(model_seed=...) or "
            "DemoSetup(data=DataConfig(seed=...)) moves it"
        )
    first = after[0]
    onset, window, distance = int(first["step"]), setup.skip_window, setup.rollback_distance
    rollback = RollbackRestore(
        setup.checkpoint(0).parent, spike_step=onset, distance=min(distance, onset)
    )
    k = rollback.ckpt_step
    # Positions equal steps up to the spike: the reference run skipped nothing.
    before = (max(k, onset - window), onset)
    straddle_start = max(k, onset - window // 3)
    return SpikePlan(
        onset,
        k,
        rollback.ckpt_path,
        before,
        (straddle_start, straddle_start + window),
        float(first["value"]),
        float(first["reference"]),
    )


def demo2_branches(setup: DemoSetup, plan: SpikePlan) -> list[Branch]:
    """Demo 2's remedies, each resumed from the checkpoint before the spike."""
    from lit_spikes.callbacks import BatchSkipper, LRScaler

    k, ckpt = plan.ckpt_step, plan.ckpt_path
    (a0, a1), (b0, b1) = plan.skip_before, plan.skip_straddle
    return [
        setup.branch(
            "demo2/skip_before",
            f"skip data {a0}-{a1 - 1} (PaLM)",
            ckpt_path=ckpt,
            callbacks=[BatchSkipper(ranges=[plan.skip_before])],
        ),
        setup.branch(
            "demo2/skip_straddle",
            f"skip data {b0}-{b1 - 1} (PaLM)",
            ckpt_path=ckpt,
            callbacks=[BatchSkipper(ranges=[plan.skip_straddle])],
        ),
        setup.branch(
            "demo2/scale_lr",
            "halve the LR (OPT)",
            ckpt_path=ckpt,
            callbacks=[LRScaler(0.5, start_step=k)],
        ),
        setup.branch(
            "demo2/clip",
            "gradient clipping at norm 1.0",
            ckpt_path=ckpt,
            trainer_kwargs={**setup.trainer_kwargs, "gradient_clip_val": 1.0},
        ),
    ]


def demo2_report(
    setup: DemoSetup, plan: SpikePlan, reference: BranchResult, results: dict[str, BranchResult]
) -> Demo2Report:
    k = plan.ckpt_step
    hi = min(k + 100, setup.steps)
    steps_at = sorted(
        {min(k + 100, setup.steps - 1), min(k + 200, setup.steps - 1), setup.steps - 1}
    )
    ordered = [reference, *(results[b.name] for b in demo2_branches(setup, plan))]
    labels = ["do nothing (reference)", *(r.label for r in ordered[1:])]
    rows = [
        Demo2Row(
            label,
            r.window(k, hi),
            r.window(k, hi, "max_logit"),
            [r.at(s) for s in steps_at],
            r.val_bpc,
            r.start_step if r is not reference else 0,
        )
        for label, r in zip(labels, ordered, strict=True)
    ]
    observations = _demo2_observations(setup, plan, reference, rows, steps_at)
    return Demo2Report(plan, steps_at, rows, observations)


def _demo2_observations(
    setup: DemoSetup,
    plan: SpikePlan,
    reference: BranchResult,
    rows: list[Demo2Row],
    steps_at: list[int],
) -> list[str]:
    """What demo 2's rows show, in words: the spike, the best remedy, then each remedy
    (``rows`` in ``demo2_branches``'s order after the reference's)."""
    k = plan.ckpt_step
    ref, skip_a, skip_b, half, clip = rows
    best = min(rows[1:], key=lambda r: r.val_bpc)
    obs = [
        f"The detector flagged the reference's spike at step {plan.onset}: loss "
        f"{plan.spike_value:.3f}, {plan.spike_value / plan.spike_reference:.2f}x the mean of "
        f"the steps before ({plan.spike_reference:.3f}), largest attention logit around it "
        f"{reference.window(plan.onset - 5, plan.onset + 5, 'max_logit'):.0f}. Every remedy "
        f"resumes from the real checkpoint of step {k} and runs to step {setup.steps}.",
        f"Best remedy by validation: {best.label} ({best.val_bpc:.3f} bits/char against "
        f"{ref.val_bpc:.3f} for doing nothing).",
    ]
    skips = [skip_a, skip_b]
    helped = [r for r in skips if r.val_bpc < ref.val_bpc - 0.005]
    obs.append(
        "Skipping data: "
        + "; ".join(f"{r.label} ends at {r.val_bpc:.3f}" for r in skips)
        + (
            ": neither window helps, so the spike is not caused by those batches."
            if not helped
            else f": {len(helped)} of 2 windows help"
            + (", the other does not: a lottery, not a cure." if len(helped) == 1 else ".")
        )
    )
    obs.append(
        f"Halving the LR: loss at step {steps_at[0]} is {half.losses_at[0]:.3f} against "
        f"{ref.losses_at[0]:.3f}, validation {half.val_bpc:.3f} against {ref.val_bpc:.3f}: "
        + ("it helps." if half.val_bpc < ref.val_bpc - 0.005 else "it does not help.")
        + f" The largest attention logit after the checkpoint: {half.max_logit:.0f} against "
        f"{ref.max_logit:.0f}."
    )
    obs.append(
        f"Clipping at norm 1.0 ends at {clip.val_bpc:.3f} against {ref.val_bpc:.3f}: "
        + (
            "it helps."
            if clip.val_bpc < ref.val_bpc - 0.005
            else "it does not help: the logit growth comes from many small steady updates, "
            "not from a few huge gradients."
        )
    )
    return obs


# ----------------------------------------------------------------------------- demo 3


def demo2_ledger(
    setup: DemoSetup, plan: SpikePlan, results: dict[str, BranchResult]
) -> list[LedgerRow]:
    """Demo 2's cost, PaLM-style: each remedy branch recomputes the steps from its
    checkpoint to the spike and beyond; skipping remedies drop batches."""
    rows = []
    for branch in demo2_branches(setup, plan):
        result = results[branch.name]
        positions = [int(r["position"]) for r in result.history]
        skipped = positions[-1] - int(result.history[-1]["step"]) if positions else 0
        rows.append(LedgerRow(result.label, plan.onset - plan.ckpt_step, skipped, result.wall_s))
    return rows
