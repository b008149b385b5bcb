"""``lit-spikes recover``: the command line of the recovery loop (its flags on top of a
``--config`` file), and the exit statuses a job scheduler sees."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from rich.console import Console

from lit_spikes.callbacks import RunDirectoryBusy
from lit_spikes.checkpoints import CheckpointError
from lit_spikes.shared.training import unwritable_directory
from lit_spikes.tools.command_line import CommandParser, add_class_path, command_parser, config_of
from lit_spikes.tools.recover.config import RecoverConfig, default_data, default_model
from lit_spikes.tools.recover.ledger import (
    LEDGER_NAME,
    LedgerMismatch,
    LedgerUnreadable,
    NotALogRoot,
)
from lit_spikes.tools.recover.loop import RecoverInterrupted, RecoverResult, recover
from lit_spikes.tools.recover.ranks import RankZeroStopped

PROG = "lit-spikes recover"
DESCRIPTION = (
    "Train with automatic spike recovery: detect, roll back to a real checkpoint, try "
    "remedies in a ladder, accept one, train on; resumable from its ledger (run it again "
    "with the same arguments after an interruption). Options are RecoverConfig's fields "
    "(--model/--data: any LightningModule/LightningDataModule by class path, as lit-spikes "
    "fit takes them); --print_config writes a YAML that --config reads back."
)


def build_parser() -> CommandParser:
    """The options: ``RecoverConfig``'s fields (``--model``/``--data`` as class paths with
    ``--model.init_args.NAME``), ``--config``, ``--print_config``, ``--fresh``,
    ``--progress``."""
    # model and data: class paths (below), not the dicts the dataclass holds them as
    parser = command_parser(PROG, DESCRIPTION, RecoverConfig, skip={"model", "data"})
    add_class_path(parser, "model", pl.LightningModule, default_model())
    add_class_path(parser, "data", pl.LightningDataModule, default_data())
    parser.add_argument(
        "--fresh", action="store_true", help="discard an existing ledger and its runs"
    )
    parser.add_argument(
        "--progress", action="store_true", help="show Lightning's progress bar per branch"
    )
    return parser


def parse(argv: Sequence[str] | None = None) -> tuple[RecoverConfig, Any]:
    """The config and the parsed options (``fresh``, ``progress``); a value the config
    refuses is a usage error (two lines, as any other)."""
    parser = build_parser()
    parsed = parser.parse_args(argv)
    try:
        config: RecoverConfig = config_of(RecoverConfig, parsed)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    return config, parsed


def main(argv: Sequence[str] | None = None) -> RecoverResult:
    """``lit-spikes recover``; exits 128 + the signal number when a signal stopped it."""
    parser = build_parser()
    config, args = parse(argv)
    if config.log_root.exists() and not config.log_root.is_dir():
        parser.error(f"--log_root {config.log_root} is a file, not a directory")
    problem = unwritable_directory(config.log_root)
    if problem is not None:
        parser.error(f"--log_root {config.log_root} {problem}: choose a writable directory")
    console = Console() if Console().is_terminal else Console(width=160)
    try:
        return recover(config, console, progress_bar=args.progress, fresh=args.fresh)
    except RankZeroStopped:
        raise SystemExit(0) from None  # rank 0 says why, and exits with the status
    except SIGTERMException:
        # Lightning's own handler (outside a branch's training): SystemExit(None), status 0
        raise SystemExit(128 + signal.SIGTERM) from None
    except RecoverInterrupted as stop:
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
