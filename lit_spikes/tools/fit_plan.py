"""What ``lit-spikes fit --ckpt_path`` resolves to, found once (``ResumePlan``), and the
checks of a parsed ``fit``/``validate`` configuration as functions of the configuration,
the plan and the run directory: each returns the error to print, or None. The CLI
(``fit_cli``) turns a problem into a usage error (exit 2) before any file is written."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_spikes.checkpoints import checkpoint_files_if_any
from lit_spikes.shared.training import CHECKPOINT_DIRNAME, unwritable_directory
from lit_spikes.tools.cli_parsing import launched_rank, trainer_setting_problem
from lit_spikes.tools.fit_defaults import stated_run_steps
from lit_spikes.tools.resume_callbacks import RecordedCallbacks
from lit_spikes.tools.run_record import RECORD_NAME, read_record, record_path

LIGHTNING_KEYWORDS = ("best", "hpc", "registry")
"""``--ckpt_path`` keywords of Lightning's for files lit-spikes does not write."""


@dataclass(frozen=True)
class ResumePlan:
    """A run's ``--ckpt_path``, resolved: ``ResumePlan()`` is a new run."""

    path: str | None = None
    """The checkpoint file resumed (fit) or evaluated (validate), ``latest``/``last``
    resolved; None: a new run."""
    step: int | None = None
    """Its global step: where the resumed run's TensorBoard curves continue."""
    checkpoint: dict[str, Any] | None = None
    """fit: the loaded file, whose data state is checked before anything is written."""
    record: RecordedCallbacks | None = None
    """fit: the callbacks the file's record names, and which of them cannot be rebuilt."""
    callbacks: list[dict[str, Any]] = field(default_factory=list)
    """fit: the default ``trainer.callbacks`` of the resume (``{class_path, init_args}``)."""
    restart: bool = False
    """``--ckpt_path last`` in a directory holding only the TensorBoard events of a run that
    wrote no checkpoint: those events go, and the run starts anew."""


def ckpt_keyword_problem(path: str | None) -> str | None:
    if path not in LIGHTNING_KEYWORDS:
        return None
    return (
        f"--ckpt_path {path}: Lightning's keyword for a file lit-spikes does not write "
        "(its checkpoints are step=<k>.ckpt); use --ckpt_path latest for the newest, "
        "or last (the newest, or a new run where there is none yet)"
    )


def run_length(config: Any) -> int:
    """The parsed run's ``max_steps``: as given, else the module's ``ToolFacts.run_steps``
    (TinyGPT: where its schedule ends), else Lightning's -1 (no limit)."""
    steps = config["trainer"]["max_steps"]
    if steps is None or steps == -1:
        stated = stated_run_steps(config["model"])
        if stated is not None:
            return stated
    return -1 if steps is None else int(steps)


def _option(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``args`` (the last one given)."""
    value = None
    for i, token in enumerate(args):
        if token == name and i + 1 < len(args):
            value = args[i + 1]
        elif token.startswith(f"{name}="):
            value = token.partition("=")[2]
    return value


def recorded_classes(args: list[str], default_root: str) -> dict[str, Any] | None:
    """The ``model`` and ``data`` sections of the record a ``fit``/``validate`` command
    line resumes (``--ckpt_path`` and its run's ``config.yaml``), where the command line
    names no ``--model`` class: the defaults to parse it against, before the parse, so
    that a requeue's ``--model.lr`` is read as the recorded module's argument (it was
    refused as the project's module's). None: nothing recorded to take.

    Raises:
        RecordError: the record's class paths are not what their entries take.
    """
    path = _option(args, "--ckpt_path")
    if not args or args[0] not in ("fit", "validate") or not path or _option(args, "--model"):
        return None
    root = Path(_option(args, "--trainer.default_root_dir") or default_root)
    record = root / RECORD_NAME if path in ("last", "latest") else record_path(Path(path))
    recorded = read_record(record) if record is not None and record.is_file() else {}
    model = recorded.get("model")
    if not isinstance(model, dict):
        return None
    return {"model": model, "data": recorded.get("data")}


def weights_problem(model: Any, checkpoint: dict[str, Any] | None, path: str) -> str | None:
    """Why ``model`` cannot take the weights of ``checkpoint`` (None: it can, or there is
    none): names or shapes that differ, which Lightning's ``load_state_dict`` reports
    as a traceback once the run's files are written. (A module built lazily, in
    ``configure_model``, has its weights only then: nothing to compare.)"""
    saved = None if checkpoint is None else checkpoint.get("state_dict")
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if not isinstance(saved, dict) or not own:
        return None
    theirs = {k: tuple(getattr(v, "shape", ())) for k, v in saved.items()}
    differ = [f"{k}: {theirs[k]} in the file, {own[k]} here" for k in own.keys() & theirs.keys()
              if theirs[k] != own[k]]  # fmt: skip
    if getattr(model, "strict_loading", True):
        differ += [f"{k}: not in the file" for k in own.keys() - theirs.keys()]
        differ += [f"{k}: not in {type(model).__name__}" for k in theirs.keys() - own.keys()]
    if not differ:
        return None
    shown = "; ".join(sorted(differ)[:4]) + (f"; {len(differ) - 4} more" if len(differ) > 4 else "")
    return (
        f"--ckpt_path {path} holds the weights of another module than "
        f"{type(model).__name__} of these settings ({shown}): give the run's --model and "
        "its settings (a run's config.yaml beside the file gives them), or start a new run "
        "without --ckpt_path; nothing was written"
    )


def callbacks_once(config: Any) -> None:
    """The run's command again (what a preempted run says to do) lists its
    ``--trainer.callbacks+=`` after the same ones of its config.yaml: each taken once."""
    given = config["trainer"].get("callbacks")
    if isinstance(given, list):
        config["trainer"]["callbacks"] = [c for i, c in enumerate(given) if c not in given[:i]]


def already_finished(config: Any, step: int) -> None:
    """A requeue of a run that reached its ``max_steps`` (the job's command again, into
    its own directory, after its last step): done, not an error. Exit 0 with one line
    (rank 0's), nothing written. Into another directory: ``config_problem`` refuses it."""
    path = config["ckpt_path"]
    root = Path(config["trainer"]["default_root_dir"]).resolve()
    if Path(path).resolve().parent.parent != root:
        return
    if launched_rank() == 0:
        print(
            f"lit-spikes: the run already reached its max_steps={step} (--ckpt_path {path}):"
            " nothing to train, nothing written; to train on, give --trainer.max_steps N "
            "above it",
            file=sys.stderr,
        )
    raise SystemExit(0)


def config_problem(config: Any, subcommand: str | None, resume_step: int | None) -> str | None:
    """Why the parsed ``config`` (one subcommand's section) is refused: the checkpoint
    interval, the run's length against the resume step, checkpointing off, directories
    that cannot take the run's files, Trainer settings."""
    fitting = subcommand == "fit"
    every = config["checkpoint_every"]
    if every < 0:
        return f"--checkpoint_every={every} must be >= 0 (0 turns checkpoints off)"
    given = config["trainer"]["max_steps"]
    if given is not None and (given == 0 or given < -1):
        return f"--trainer.max_steps={given} must be positive, or -1 to end with the schedule"
    steps = run_length(config)
    if fitting and resume_step is not None and 0 < steps <= resume_step:
        return (
            f"--ckpt_path is at step {resume_step}, not before --trainer.max_steps={steps}: "
            "there is nothing left to train; raise max_steps or pick an earlier checkpoint"
        )
    if fitting and every and config["trainer"]["enable_checkpointing"] is False:
        return (
            "--trainer.enable_checkpointing=false: lit-spikes writes its checkpoints as "
            f"--checkpoint_every says ({every}); give --checkpoint_every 0 for none"
        )
    return directory_problem(config, fitting) or (trainer_setting_problem(config["trainer"]))


def directory_problem(config: Any, fitting: bool) -> str | None:
    root = Path(config["trainer"]["default_root_dir"])
    problem = unwritable_directory(root)
    if problem is not None:
        return f"--trainer.default_root_dir={root} {problem}: choose a writable directory"
    checkpoints = root / CHECKPOINT_DIRNAME
    problem = unwritable_directory(checkpoints) if fitting and config["checkpoint_every"] else None
    if problem is not None:  # a read-only checkpoints/ left by another user or a copy
        return (
            f"{checkpoints} {problem}: the run could not write its checkpoints there; "
            "make it writable or choose another --trainer.default_root_dir"
        )
    return None


def history_problem(
    root: str | Path, path: str | None, step: int | None, restart: bool = False
) -> str | None:
    """Why a fit into ``root`` would mix two histories: a new run (``path`` None) where a
    run wrote checkpoints or TensorBoard events (unless ``restart``: ``--ckpt_path last``
    finding events only), or a resume from a file that is not the newest of ``root``'s
    own checkpoints. (``--ckpt_path latest`` always resumes the newest.)"""
    directory = Path(root) / CHECKPOINT_DIRNAME
    steps, events = run_files(root)
    if not steps:
        if path is not None or not events or restart:
            return None
        return (
            f"{root} holds the TensorBoard events of a run ({events[0].name}"
            f"{' and more' if len(events) > 1 else ''}): a new run there would log "
            "the same steps again into its curves; choose another "
            "--trainer.default_root_dir (or start that run anew, its events "
            "removed, with --ckpt_path last)"
        )
    held = f"{directory} holds the checkpoints of a run (step={steps[0]} to step={steps[-1]})"
    elsewhere = "or choose another --trainer.default_root_dir"
    if path is None:
        return (
            f"{held}; a new run there would mix its files and TensorBoard steps with "
            f"that run's. Go on with it (--ckpt_path latest), {elsewhere}"
        )
    if Path(path).resolve().parent != directory.resolve():
        return f"--ckpt_path {path} is not one of them: {held}; {elsewhere}"
    if step is not None and steps[-1] > step:
        return (
            f"--ckpt_path {path} is at step {step}, but {held}, later ones included: "
            f"a run resumed there would mix two histories, and --ckpt_path latest would "
            f"find the other one. Resume into another --trainer.default_root_dir"
        )
    return None


def run_files(root: str | Path) -> tuple[list[int], list[Path]]:
    """The steps of ``root``'s checkpoints and its TensorBoard event files."""
    steps = sorted(s for s, _ in checkpoint_files_if_any(Path(root) / CHECKPOINT_DIRNAME))
    return steps, sorted(Path(root).glob("events.out.tfevents.*"))
