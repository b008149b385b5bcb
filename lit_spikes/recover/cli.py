"""``lit-spikes recover``: the command line of the recovery loop (its flags on top of a
``--config`` file), and the exit statuses a job scheduler sees."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from rich.console import Console

from lit_spikes.callbacks import RunDirectoryBusy
from lit_spikes.checkpoints import CheckpointError
from lit_spikes.recover.config import REMEDIES, RecoverConfig
from lit_spikes.recover.ledger import LEDGER_NAME, LedgerMismatch, LedgerUnreadable, NotALogRoot
from lit_spikes.recover.loop import RecoverResult, _Interrupted, recover
from lit_spikes.recover.ranks import RankZeroStopped
from lit_spikes.training import unwritable_directory


def build_parser() -> argparse.ArgumentParser:
    defaults = RecoverConfig()
    parser = argparse.ArgumentParser(
        prog="lit-spikes recover",
        description="Train with automatic spike recovery: detect, roll back to a real "
        "checkpoint, try remedies in a ladder, accept one, train on; resumable from its "
        "ledger (run it again with the same arguments after an interruption).",
    )
    add = parser.add_argument
    add(
        "--log-root",
        type=Path,
        help=f"runs, ledger, stitched run (default: --config's log_root, else {defaults.log_root})",
    )
    add(
        "--config",
        type=Path,
        help="YAML (or JSON) file of RecoverConfig fields, e.g. configs/recover.yaml "
        "(flags override it)",
    )
    add("--steps", type=int, help="global step to train to (default: the schedule's end)")
    add("--model-seed", type=int, help=f"default {defaults.model_seed}")
    add("--data-seed", type=int, help=f"default {defaults.data.seed}")
    add("--peak-lr", type=float, help=f"default {defaults.optim.peak_lr}")
    add("--qk-norm", action="store_true", default=None, help="train with QK-norm")
    add("--poison", type=int, nargs="+", help="plant bad batches at these data positions")
    add("--checkpoint-every", type=int, help=f"default {defaults.checkpoint_every}")
    add("--val-every", type=int, help=f"default {defaults.val_every}; 0: only at the end")
    add("--rollback-distance", type=int, help=f"default {defaults.rollback_distance}")
    add("--ladder", type=str, help=f"comma-separated remedies (default {','.join(REMEDIES)})")
    add("--skip-before", type=int, help=f"default {defaults.skip_before}")
    add("--skip-length", type=int, help=f"default {defaults.skip_length}")
    add("--lr-factor", type=float, help=f"default {defaults.lr_factor}")
    add("--skip-step-sigma", type=float, help=f"default {defaults.skip_step_sigma}")
    add("--skip-step-window", type=int, help=f"default {defaults.skip_step_window}")
    add("--clip-norm", type=float, help=f"default {defaults.clip_norm}")
    add("--accept-margin", type=int, help=f"default {defaults.accept_margin}")
    add("--max-interventions", type=int, help=f"default {defaults.max_interventions}")
    add("--max-branches", type=int, help=f"default {defaults.max_branches}")
    add("--detector-ratio", type=float, help=f"default {defaults.detector.ratio}")
    add("--detector-window", type=int, help=f"default {defaults.detector.window}")
    add("--compare", action="store_true", default=None, help="add do-nothing and QK-norm rows")
    add("--devices", type=int, help="processes per machine; > 1 trains with DDP (default 1)")
    add("--num-nodes", type=int, help="machines, each running this command (default 1)")
    add("--strategy", type=str, help="auto or ddp (default auto: ddp when > 1 process)")
    add("--fresh", action="store_true", help="discard an existing ledger and its runs")
    add("--progress", action="store_true", help="show Lightning's progress bar per branch")
    return parser


def _read_config_file(path: Path) -> dict[str, Any]:
    try:  # YAML (configs/recover.yaml); JSON is YAML too
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path} is not valid YAML: {error}") from None
    if not isinstance(loaded, dict | None):
        raise ValueError(
            f"--config {path} holds a {type(loaded).__name__}, not a mapping of "
            "settings (see configs/recover.yaml)"
        )
    return loaded or {}


def config_from_args(args: argparse.Namespace) -> RecoverConfig:
    """A config from ``--config`` (if given) with the flags on top.

    Raises:
        ValueError: a bad value (named by the dataclass that refuses it).
        OSError: an unreadable ``--config`` file.
    """
    data = _read_config_file(args.config) if args.config else {}
    if args.log_root is not None:
        data["log_root"] = str(args.log_root)
    flat = {
        "max_steps": args.steps,
        "model_seed": args.model_seed,
        "checkpoint_every": args.checkpoint_every,
        "rollback_distance": args.rollback_distance,
        "skip_before": args.skip_before,
        "skip_length": args.skip_length,
        "lr_factor": args.lr_factor,
        "skip_step_sigma": args.skip_step_sigma,
        "skip_step_window": args.skip_step_window,
        "clip_norm": args.clip_norm,
        "accept_margin": args.accept_margin,
        "max_interventions": args.max_interventions,
        "max_branches": args.max_branches,
        "compare": args.compare,
        "devices": args.devices,
        "num_nodes": args.num_nodes,
        "strategy": args.strategy,
    }
    data.update({k: v for k, v in flat.items() if v is not None})
    if args.val_every is not None:
        data["val_every"] = args.val_every or None  # 0: only at the end
    if args.ladder is not None:
        data["ladder"] = [r.strip() for r in args.ladder.split(",") if r.strip()]
    for section, key, value in (
        ("data", "seed", args.data_seed),
        ("data", "poison", args.poison),
        ("optim", "peak_lr", args.peak_lr),
        ("gpt", "qk_norm", args.qk_norm),
        ("detector", "ratio", args.detector_ratio),
        ("detector", "window", args.detector_window),
    ):
        if value is not None:
            if data.get(section) is None:  # absent, or "data:" left empty in the file
                data[section] = {}
            if not isinstance(data[section], dict):
                raise ValueError(f"RecoverConfig {section}: {data[section]!r} is not a mapping")
            data[section][key] = value
    return RecoverConfig.from_dict(data)


def main(argv: Sequence[str] | None = None) -> RecoverResult:
    """``lit-spikes recover``; exits 128 + the signal number when a signal stopped it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError, OSError) as error:
        parser.error(str(error))
    if config.log_root.exists() and not config.log_root.is_dir():
        parser.error(f"--log-root {config.log_root} is a file, not a directory")
    problem = unwritable_directory(config.log_root)
    if problem is not None:
        parser.error(f"--log-root {config.log_root} {problem}: choose a writable directory")
    console = Console() if Console().is_terminal else Console(width=160)
    try:
        return recover(config, console, progress_bar=args.progress, fresh=args.fresh)
    except RankZeroStopped:
        raise SystemExit(0) from None  # rank 0 says why, and exits with the status
    except SIGTERMException:
        # Lightning's own handler (outside a branch's training): SystemExit(None), status 0
        raise SystemExit(128 + signal.SIGTERM) from None
    except _Interrupted as stop:
        if getattr(rank_zero_only, "rank", 0) != 0:
            raise SystemExit(0) from None  # as above: Lightning's launcher would kill rank 0
        console.print(
            f"Stopped by {signal.Signals(stop.signum).name}; the ledger "
            f"{config.log_root / LEDGER_NAME} says where: run the same command to continue."
        )
        raise SystemExit(128 + stop.signum) from None
    except (LedgerMismatch, LedgerUnreadable, NotALogRoot) as error:
        parser.error(str(error))
    except CheckpointError as error:  # one the ledger names, gone (a moved or copied root)
        parser.error(
            f"{error}. The ledger {config.log_root / LEDGER_NAME} names the checkpoints it "
            "goes on from: continue it where they are, or start anew with --fresh"
        )
    except RunDirectoryBusy as error:
        # Another recover (or fit) trains there: not a crash, a scheduler may retry later.
        console.print(f"lit-spikes recover: error: {error}")
        raise SystemExit(os.EX_TEMPFAIL) from None


if __name__ == "__main__":
    main()
