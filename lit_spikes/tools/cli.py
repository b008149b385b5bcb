"""``lit-spikes``: the console script. ``fit`` and ``validate`` go to the LightningCLI
(``lit_spikes.tools.fit_cli``); ``recover`` (automatic spike recovery), ``diagnose`` (replay
diagnosis of a spike) and ``check-resume`` (does a module resume bit for bit) are plain
argparse commands of their own modules.

Nothing heavy is imported here: the top-level help, a misspelt command and the dispatch
answer before Lightning and torch are imported (seconds), and each command imports only
what it needs. ``build_cli``, ``LitSpikesCLI`` and the rest of ``lit_spikes.tools.fit_cli``
stay importable from here, as they were.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from lit_spikes.tools.commands import COMMANDS, DESCRIPTION, NAMES, TOP_USAGE
from lit_spikes.tools.import_guard import named_by_user

if TYPE_CHECKING:
    from lit_spikes.tools.diagnose import Verdict
    from lit_spikes.tools.fit_cli import (
        RESUMABLE_CHANGES,
        TRAINER_DEFAULTS,
        LitSpikesCLI,
        build_cli,
    )
    from lit_spikes.tools.recover import RecoverResult

__all__ = [
    "DESCRIPTION",
    "RESUMABLE_CHANGES",
    "TRAINER_DEFAULTS",
    "LitSpikesCLI",
    "build_cli",
    "main",
]

USAGE = f"usage: {TOP_USAGE}"


def __getattr__(name: str) -> Any:
    # The LightningCLI's names, imported on first use only (see the module's docstring)
    if name in __all__:
        return getattr(importlib.import_module("lit_spikes.tools.fit_cli"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _top_level_help() -> None:
    print(f"{USAGE}\n\n{DESCRIPTION}\n\nEach command's own options: lit-spikes <command> --help")
    raise SystemExit(0)


def _command(name: str, argv: list[str]) -> Any:
    """A command of its own module; one not installed (yet) is a usage error."""
    try:
        module = importlib.import_module(COMMANDS[name])
    except ModuleNotFoundError as error:
        if error.name != COMMANDS[name]:
            raise  # the module is there; something it imports is not
        print(f"{USAGE}\nlit-spikes: error: {name} is not in this installation", file=sys.stderr)
        raise SystemExit(2) from None
    return module.main(argv)


def _no_command(argv: list[str]) -> bool:
    """Options alone (``lit-spikes --print_config``): no command among them, and no
    top-level ``-c``/``--config`` file, which may name one."""
    configs = ("-c", "--config")
    return not any(a in NAMES or a in configs or a.startswith("--config=") for a in argv)


def main(
    args: list[str] | None = None,
) -> LitSpikesCLI | RecoverResult | Verdict | int | None:
    """Run the CLI; a run stopped by SIGTERM/SIGINT exits with 128 + the signal number
    (after writing its checkpoint), so a job scheduler sees it did not finish.

    ``recover``, ``diagnose`` and ``check-resume`` go to their own modules' ``main``:
    in-process callers (``args`` given) get their result back; the console script
    (``sys.exit(main())``) gets None, so exit status 0, but from ``check-resume`` its
    exit status. Anything else goes to the LightningCLI."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] in ("-h", "--help"):
        _top_level_help()
    if not argv or not (argv[0].startswith("-") or argv[0] in NAMES) or _no_command(argv):
        # LightningCLI's own message names only its commands (fit, validate)
        what = "no command given" if not argv else f"unknown command {argv[0]!r}"
        if argv and argv[0].startswith("-"):
            what = f"no command given (before {argv[0]})"
        print(
            f"{USAGE}\nlit-spikes: error: {what}: choose from {', '.join(NAMES)} "
            "(lit-spikes --help)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    # What a file the user did not name (a run's record, a ledger) may make it import
    with named_by_user(argv):
        return _dispatch(argv, args)


def _dispatch(
    argv: list[str], args: list[str] | None
) -> LitSpikesCLI | RecoverResult | Verdict | int | None:
    if argv[0] in COMMANDS:
        result = _command(argv[0], argv[1:])
        if argv[0] == "check-resume" and args is None:
            raise SystemExit(result)  # its status: 1 when the resume is not exact
        return result if args is not None else None
    from lit_spikes.tools.fit_cli import run

    # The console script does sys.exit(main()): anything but None would exit with 1.
    return run(args)


if __name__ == "__main__":
    main()
