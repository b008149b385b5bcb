"""The diagnose panel (issue 64): spikes planted on purpose in two modules written for the
tests, each run trained by ``lit-spikes fit`` and diagnosed by ``lit-spikes diagnose``,
as a user would, and the verdict held against the cause planted. The script
``scripts/diagnose_panel.py`` runs all of it and prints k of n; the tests run its quick
form (``QUICK``).

- poisoned batches (a data position's targets x30): **data-caused**;
- an LR jump for three steps, and a loss-scale bug (the loss x8 for three steps):
  **state-caused**, one of them crossing its detector's threshold only just;
- a step of a clean run: **no-spike**.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_spikes.callbacks import SpikeDetector
from lit_spikes.shared.training import checkpoint_path
from lit_spikes.tools.cli import main

STEPS, EVERY, BEFORE = 60, 10, 5
"""Each run's steps, its checkpoint interval, and the steps at least between the file a
spike is diagnosed from and the spike."""
MLP = "tests.modules.spiky_modules.JumpRegressor"
CONV = "tests.modules.panel_modules.ConvRegressor"
DATA = "tests.modules.spiky_modules.StepRegressionData"
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


@dataclass(frozen=True)
class Planted:
    """One planted spike (or none) and the verdict it calls for."""

    name: str
    planted: str
    """What was planted, in words."""
    model: str
    model_args: dict[str, Any]
    data_args: dict[str, Any]
    expected: str
    step: int
    """The planted step: the spike diagnosed is the first episode onset at or after it;
    for a clean run, the step diagnosed."""
    detector: dict[str, Any] = field(default_factory=lambda: {"ratio": 3.0})
    """The run's ``SpikeDetector`` arguments (diagnose judges by the run's own)."""

    def argv(self, root: Path) -> list[str]:
        """``lit-spikes fit``'s arguments for the run."""
        args = ["fit", "--model", self.model, "--data", DATA]
        for name, value in self.model_args.items():
            args += [f"--model.init_args.{name}", json.dumps(value)]
        for name, value in self.data_args.items():
            args += [f"--data.init_args.{name}", json.dumps(value)]
        args += ["--trainer.callbacks+=lit_spikes.callbacks.SpikeDetector"]
        for name, value in self.detector.items():
            args += [f"--trainer.callbacks.{name}", str(value)]
        args += ["--trainer.max_steps", str(STEPS), "--checkpoint_every", str(EVERY), *QUIET]
        return [*args, "--trainer.default_root_dir", str(root / self.name)]


TRAIN_LOSS = {"monitor": "train_loss", "ratio": 3.0}
CASES = (
    Planted("mlp_poison", "batch 30 poisoned", MLP, {}, {"poison": [30]}, "data-caused", 30),
    Planted("mlp_poison_two", "batches 40, 41 poisoned", MLP, {}, {"poison": [40, 41]},
            "data-caused", 40),
    Planted("conv_poison", "batch 35 poisoned", CONV, {}, {"poison": [35]}, "data-caused",
            35, TRAIN_LOSS),
    Planted("mlp_lr_jump", "LR x20 at steps 30-32", MLP, {"jump_step": 30}, {},
            "state-caused", 30),
    Planted("conv_lr_jump", "LR x1000 at steps 35-37 (AdamW: each weight moves ~LR)", CONV,
            {"jump_step": 35, "jump": 1000.0}, {}, "state-caused", 35, TRAIN_LOSS),
    Planted("conv_loss_scale", "loss x8 at steps 35-37", CONV, {"scale_step": 35}, {},
            "state-caused", 35, TRAIN_LOSS),
    Planted("mlp_lr_jump_near", "LR x4.5 at steps 30-32: only just over the threshold", MLP,
            {"jump_step": 30, "jump": 4.5}, {}, "state-caused", 30),
    Planted("mlp_clean", "nothing: step 40 of a clean run", MLP, {}, {}, "no-spike", 40),
    Planted("conv_clean", "nothing: step 40 of a clean run", CONV, {}, {}, "no-spike", 40,
            TRAIN_LOSS),
)  # fmt: skip
QUICK = ("mlp_poison", "conv_loss_scale", "mlp_lr_jump_near", "mlp_clean")
"""The quick form the tests run: one case of each verdict and the near-threshold one."""


@dataclass
class Outcome:
    """One case's verdict and what it rests on."""

    case: Planted
    spike_step: int | None
    """The step diagnosed (None: the run flagged no spike at or after the planted step)."""
    cause: str | None
    ratios: list[float]
    """Each other-data replay's rise ratio."""
    margin: float | None
    """The flagged value over the detector's threshold there (1.02: only just over)."""
    wall_s: float

    @property
    def right(self) -> bool:
        return self.cause == self.case.expected


def run_panel(root: Path, names: Sequence[str] = ()) -> list[Outcome]:
    """The cases named (all: none named), each in its own folder under ``root``."""
    unknown = sorted(set(names) - {case.name for case in CASES})
    if unknown:
        raise ValueError(f"no panel case {unknown}: the cases are {[c.name for c in CASES]}")
    return [diagnosed(case, root) for case in CASES if not names or case.name in names]


def table(outcomes: Sequence[Outcome]) -> str:
    """The outcomes as a Markdown table, then ``k of n right``."""
    lines = [
        "| case | planted | expected | verdict | other-data rise ratios | over the threshold |",
        "|---|---|---|---|---|---:|",
    ]
    for o in outcomes:
        ratios = ", ".join(f"{r:.2f}" for r in o.ratios) or "-"
        margin = f"{o.margin:.4g}x" if o.margin is not None else "-"
        verdict = o.cause or "no spike flagged"
        mark = verdict if o.right else f"**{verdict}** (wrong)"
        lines.append(
            f"| {o.case.name} | {o.case.planted} | {o.case.expected} | {mark} | {ratios} "
            f"| {margin} |"
        )
    right = sum(o.right for o in outcomes)
    return "\n".join([*lines, "", f"{right} of {len(outcomes)} right"])


def _detector(cli: Any) -> SpikeDetector:
    return next(c for c in cli.trainer.callbacks if isinstance(c, SpikeDetector))


def diagnosed(case: Planted, root: Path) -> Outcome:
    """Train the case's run with ``lit-spikes fit``, then diagnose its spike (or its
    clean step) with ``lit-spikes diagnose`` from the newest file ``BEFORE`` steps
    before it."""
    start = time.perf_counter()
    detector = _detector(main(case.argv(root)))
    step, margin = case.step, None
    if case.expected != "no-spike":
        onsets = [e.onset for e in detector.episodes if e.onset.step >= case.step]
        if not onsets:
            return Outcome(case, None, None, [], None, time.perf_counter() - start)
        step = onsets[0].step
        ratio = case.detector.get("ratio")
        margin = onsets[0].value / (ratio * onsets[0].reference) if ratio else None
    ckpt = checkpoint_path(root / case.name, EVERY * ((step - BEFORE) // EVERY))
    verdict = main(["diagnose", "--ckpt_path", str(ckpt), "--spike_step", str(step)])
    ratios = [o.ratio for o in verdict.other_data]
    return Outcome(case, step, verdict.cause, ratios, margin, time.perf_counter() - start)
