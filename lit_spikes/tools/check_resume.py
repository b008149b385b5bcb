"""``lit-spikes check-resume``: does a LightningModule resume bit for bit, and if not, what
breaks it.

    lit-spikes check-resume --model CLASS_PATH [--data CLASS_PATH] --steps N --resume_at K
        [--model.ARG ...] [--data.ARG ...] [--trainer.ARG ...] [--config FILE]
        [--seed S] [--new_process true] [--ignore_attributes '[NAME, ...]']
        [--exact_resume false] [--num_threads N]

trains the module uninterrupted to step N and again interrupted at step K (a real .ckpt
written by ModelCheckpoint, resumed in a fresh Trainer) and prints a table of components,
same or differs, the first divergence and the likely fix. Exit status: 0 when the resume
is exact, 1 when it is not, 2 on a usage error. Class paths, ``--config`` and
``--trainer.*`` read as ``lit-spikes fit`` reads them (jsonargparse);
``--trainer.callbacks+=lit_spikes.callbacks.ExactResume`` adds a callback to every run. The
module is set up as ``lit-spikes fit`` sets it up, so that the verdict is fit's: an
``ExactResume`` added where fit adds one (``--exact_resume``), one torch thread
(``--num_threads``), seed 0; both are said in a line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from jsonargparse import ArgumentParser

from lit_spikes.tools.command_line import command_parser
from lit_spikes.tools.factories import Instantiate as Instantiate  # (recover imports it from here)
from lit_spikes.tools.factories import instantiate
from lit_spikes.tools.fit_defaults import adds_exact_resume

PROG = "lit-spikes check-resume"
EXACT_RESUME = "lit_spikes.callbacks.ExactResume"
CHECKER_SETS = ("max_steps", "default_root_dir", "enable_checkpointing")
"""Trainer arguments the check sets itself (``--steps``; its directories and checkpoint)."""
TRAINER_DEFAULTS = {
    "trainer.logger": False,
    "trainer.enable_progress_bar": False,
    "trainer.enable_model_summary": False,
    "trainer.num_sanity_val_steps": 0,
    "trainer.max_epochs": -1,
}


DESCRIPTION = (
    "Does a LightningModule resume bit for bit? Trains it uninterrupted to --steps and "
    "interrupted at --resume_at (a ModelCheckpoint .ckpt, resumed in a fresh Trainer); prints "
    "each component, same or differs, the first divergence and its likely fix. Exit status: "
    "0 the resume is exact, 1 it is not, 2 a usage error. docs/check-resume.md has more."
)


@dataclass(frozen=True)
class CheckResumeConfig:
    """How the check trains the module (its model, data and Trainer come as class paths)."""

    steps: int
    """Train to this global step."""
    resume_at: int
    """Interrupt at this global step, write a .ckpt, resume from it."""
    seed: int = 0
    """``seed_everything`` before each run."""
    new_process: bool = False
    """Resume in a new Python process (the classes are imported there by path)."""
    ignore_attributes: list[str] = field(default_factory=list)
    """Plain attributes of the module or of callbacks that are no training state (a log of
    losses, say): not compared."""
    exact_resume: bool = True
    """Add an ExactResume unless the module or --trainer.callbacks has one, as ``lit-spikes
    fit`` does (false: check the module as a plain Trainer runs it)."""
    num_threads: int = 1
    """torch threads for the check's runs: 1, as ``lit-spikes fit`` runs a user's module
    (a step's float sums, and so its bits, may depend on the count)."""


def build_parser() -> ArgumentParser:
    import lightning.pytorch as pl

    parser = command_parser(PROG, DESCRIPTION, CheckResumeConfig)
    parser.add_subclass_arguments(pl.LightningModule, "model", required=True, fail_untyped=False)
    parser.add_subclass_arguments(
        pl.LightningDataModule, "data", required=False, fail_untyped=False
    )
    parser.add_class_arguments(
        pl.Trainer,
        "trainer",
        instantiate=False,
        fail_untyped=False,
        sub_configs=True,
        skip=set(CHECKER_SETS),
    )
    parser.set_defaults(TRAINER_DEFAULTS)
    return parser


def _plan_arguments(parser: ArgumentParser, config: Any) -> dict[str, Any]:
    """``check_resume``'s arguments from the parsed options; the objects are built once
    here, so a constructor's error is a usage error before anything trains."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    built = instantiate(parser, config)
    trainer = dict(built.trainer.as_dict() if hasattr(built.trainer, "as_dict") else built.trainer)
    callbacks = config.trainer.get("callbacks") or []
    configured = trainer.pop("callbacks", None) or []
    specs = [c.as_dict() if hasattr(c, "as_dict") else c for c in callbacks]
    plain = {"exact_resume": config.exact_resume, "model": config.model.as_dict()}
    if adds_exact_resume(plain, configured if isinstance(configured, list) else [configured]):
        specs.append({"class_path": EXACT_RESUME})  # as lit-spikes fit adds it
    data = config.get("data")
    return {
        "model": Instantiate(pl.LightningModule, config.model.as_dict()),
        "data": Instantiate(pl.LightningDataModule, data.as_dict()) if data else None,
        "callbacks": Instantiate(list[Callback], specs) if specs else None,
        "steps": config.steps,
        "resume_at": config.resume_at,
        "seed": config.seed,
        "new_process": config.new_process,
        "ignore_attributes": tuple(config.ignore_attributes),
        "trainer_kwargs": {k: v for k, v in trainer.items() if v is not None},
    }


def _usage_error(message: str) -> int:
    print(f"usage: {PROG} --model CLASS_PATH --steps N --resume_at K ...", file=sys.stderr)
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    """Run the check; 0: the resume is exact, 1: it is not, 2: a usage error."""
    parser = build_parser()
    try:
        config = parser.parse_args(argv)
    except SystemExit as done:  # jsonargparse printed the usage error (or --help)
        return done.code if isinstance(done.code, int) else 2
    import torch

    from lit_spikes.testing import check_resume, format_report
    from lit_spikes.testing.check import CheckInputError

    try:
        arguments = _plan_arguments(parser, config)
    except Exception as error:  # a constructor refused its arguments: bad input
        return _usage_error(f"{type(error).__name__}: {error}")
    if config.num_threads < 1:
        return _usage_error(f"--num_threads={config.num_threads} must be >= 1")
    torch.set_num_threads(config.num_threads)
    added = any(
        spec.get("class_path") == EXACT_RESUME
        for spec in getattr(arguments["callbacks"], "spec", None) or []
    )
    print(
        f"{PROG}: {config.num_threads} torch thread(s) (--num_threads); "
        + (
            "ExactResume added, as lit-spikes fit adds it (--exact_resume false: none)"
            if added
            else "no ExactResume added"
        ),
        file=sys.stderr,
    )
    try:
        report = check_resume(**arguments)
    except CheckInputError as error:
        return _usage_error(str(error))
    print(format_report(report))
    return 0 if report.exact else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
