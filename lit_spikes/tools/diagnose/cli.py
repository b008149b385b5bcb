"""``lit-spikes diagnose``: its options (the fields of ``DiagnoseConfig`` and of
``DiagnoseCommand``, with their docstrings as help, on the parser every command outside
the LightningCLI shares, ``command_line``), ``--model``/``--data`` class paths as
``lit-spikes fit`` takes them, the data config its built-in data's options give, the
verdict's table and its JSON file."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml
from jsonargparse import ArgumentParser
from rich.console import Console
from rich.table import Table

from lit_spikes.checkpoints import CheckpointError
from lit_spikes.shared.training import unwritable_directory
from lit_spikes.tools.command_line import (
    add_class_path,
    as_plain,
    command_parser,
    config_of,
    parse_config,
)
from lit_spikes.tools.defaults import DEMO_DATA
from lit_spikes.tools.diagnose.config import DiagnoseConfig
from lit_spikes.tools.diagnose.replay import CheckpointReads
from lit_spikes.tools.diagnose.run import diagnose
from lit_spikes.tools.diagnose.subject import loaded_copies
from lit_spikes.tools.diagnose.verdict import Verdict
from lit_spikes.tools.factories import ClassPath
from lit_spikes.tools.run_record import announce, read_record, record_path

PROG = "lit-spikes diagnose"
DESCRIPTION = (
    "Replay a spike from a checkpoint before it: same data (does it come back, "
    "bit-exactly?), other data (still there?), and optionally an earlier checkpoint; say "
    "data-caused, state-caused or not-reproducible. --model and --data take class paths "
    "as lit-spikes fit does (default: what the run's config.yaml names, else the built-in "
    "TinyGPTModule and StepDataModule, rebuilt from the checkpoint)."
)


@dataclass(frozen=True)
class DiagnoseCommand:
    """Which spike of which run, what else it trained with, and where the results go."""

    ckpt_path: Path
    """A step=<k>.ckpt of the run, written before the spike."""
    spike_step: int
    """Global step of the spike's onset."""
    earlier_ckpt_path: Path | None = None
    """An earlier checkpoint of the run, for replay (c)."""
    spike_loss: float | None = None
    """The loss the run logged at the spike (default: from the run's TensorBoard events
    next to the checkpoint)."""
    gradient_clip_val: float | None = None
    """The gradient clipping the run trained with (default: the checkpoint's; 0: none)."""
    data_config: Path | None = None
    """The built-in data's DataConfig: a JSON/YAML file of its fields, a recover ledger or
    config file (its data section) or lit-spikes fit's config.yaml (default: the data
    config the checkpoint holds)."""
    data_seed: int | None = None
    """The built-in data's seed (default: the checkpoint's)."""
    batch_size: int | None = None
    """The built-in data's rows per step (default: the checkpoint's)."""
    poison: list[int] | None = None
    """Data positions the run had poisoned (built-in data), as a list: [28, 29]."""
    log_root: Path | None = None
    """Keep the replays' TensorBoard runs here (default: a temporary directory)."""
    json: Path | None = None
    """Also write the verdict as JSON to this file."""


def print_verdict(verdict: Verdict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(
        title=f"Replays of the spike at step {verdict.spike_step} "
        f"(checkpoint step {verdict.ckpt_step})"
    )
    table.add_column("replay")
    table.add_column("from step", justify="right")
    table.add_column("data", justify="left")
    for header in ("loss @spike", "max loss", *(c.header for c in verdict.columns)):
        table.add_column(header, justify="right")
    table.add_column("bit-equal")
    table.add_column("rise ratio", justify="right")
    table.add_column("flagged steps")
    for replay in (verdict.same_data, *verdict.other_data, verdict.earlier):
        if replay is None:
            continue
        table.add_row(
            replay.label,
            str(replay.ckpt_step),
            "same"
            if replay.skipped is None
            else f"skip {replay.skipped[0]}-{replay.skipped[1] - 1}",
            f"{replay.loss_at_spike:.4f}",
            f"{replay.max_loss:.4f}",
            *(_cell(replay.extra.get(c.key), c.digits) for c in verdict.columns),
            "n/a" if replay.bit_equal is None else str(replay.bit_equal),
            "" if replay.judgement is None else f"{replay.judgement.ratio:.2f}",
            ", ".join(map(str, replay.flagged)) or "none",
        )
    console.print(table)
    if verdict.original_loss is not None and math.isfinite(verdict.original_loss):
        console.print(f"Original loss at step {verdict.spike_step}: {verdict.original_loss:.4f}")
    for line in verdict.evidence:
        console.print(f"  {line}")
    console.print(f"Verdict: [bold]{verdict.cause}[/bold]")


def _cell(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def build_parser() -> ArgumentParser:
    """The command's parser: ``DiagnoseConfig``'s and ``DiagnoseCommand``'s fields,
    ``--model`` and ``--data`` (class paths, default None: the run's record)."""
    parser = command_parser(PROG, DESCRIPTION, DiagnoseConfig)
    parser.add_class_arguments(DiagnoseCommand, nested_key=None, fail_untyped=False)
    # No default: None lets the run's own record say (subject)
    add_class_path(parser, "model", pl.LightningModule)
    add_class_path(parser, "data", pl.LightningDataModule)
    return parser


def _data_file(path: Path) -> dict[str, Any]:
    """The DataConfig fields of a ``--data_config`` file.

    Raises:
        ValueError: an unreadable file, or one that holds no mapping.
    """
    try:  # YAML, as recover's --config (configs/recover.yaml); JSON is YAML too
        loaded = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"--data_config {path}: {error}") from None
    # a recover ledger holds its config; lit-spikes fit's config.yaml, data.config
    # (data.init_args.config since fit takes any --data class)
    for key in ("config", "data", "init_args", "config"):
        if not isinstance(loaded, dict):
            break
        loaded = loaded.get(key, loaded)
    if not isinstance(loaded, dict):
        raise ValueError(
            f"--data_config {path}: holds a {type(loaded).__name__}, not a mapping of "
            "DataConfig fields (or a recover ledger or config, or lit-spikes fit's "
            "config.yaml)"
        )
    return dict(loaded)


def data_from_args(command: DiagnoseCommand) -> dict[str, Any] | None:
    """The built-in data's settings the options give: ``--data_config`` (a JSON or YAML
    file of its fields, a recover ledger or config, or ``lit-spikes fit``'s config.yaml)
    with ``--data_seed``, ``--batch_size`` and ``--poison`` on top; the data class puts
    them over the checkpoint's own (None: none given, ``diagnose`` takes the run's).

    Raises:
        ValueError: an unreadable file.
    """
    values = _data_file(command.data_config) if command.data_config is not None else {}
    for key, value in (("seed", command.data_seed), ("batch_size", command.batch_size)):
        if value is not None:
            values[key] = value
    if command.poison:
        values["poison"] = list(command.poison)
    return values or None


def built_in_data(command: DiagnoseCommand, values: dict[str, Any]) -> Any:
    """The built-in data (``DEMO_DATA``, by class path) with ``values`` over the settings
    the checkpoint holds (its ``load_from_checkpoint``), a factory of copies.

    Raises:
        ValueError: a value the data's config refuses, or a file it cannot read.
    """
    klass = ClassPath(DEMO_DATA).klass(pl.LightningDataModule, "data")
    try:
        return loaded_copies(klass, command.ckpt_path, config=values)
    except (TypeError, ValueError) as error:
        given = f"--data_config {command.data_config}" if command.data_config else "data"
        raise ValueError(f"{given}: {error}") from None


def _json_value(value: Any) -> Any:
    """NaN and inf as strings: JSON has no such numbers (strict parsers refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    return value


def _check_outputs(parser: ArgumentParser, command: DiagnoseCommand) -> None:
    """Where the replays' runs and the verdict go: checked before the replays, not after."""
    if command.log_root is not None and (problem := unwritable_directory(command.log_root)):
        parser.error(f"--log_root {command.log_root} {problem}")
    if command.json is not None:
        if command.json.is_dir():
            parser.error(f"--json {command.json} is a directory: give a file name")
        if problem := unwritable_directory(command.json.parent):
            parser.error(f"--json {command.json}: its directory {problem}")


def _run(parser: ArgumentParser, config: DiagnoseConfig, parsed: Any) -> Verdict:
    """The diagnosis the parsed options ask for; a bad value is a usage error."""
    command: DiagnoseCommand = config_of(DiagnoseCommand, parsed)
    _check_outputs(parser, command)
    model, data = as_plain(parsed.get("model")), as_plain(parsed.get("data"))
    clip = command.gradient_clip_val
    try:
        reads = CheckpointReads()
        values = data_from_args(command)
        if values is not None and data is not None:
            raise ValueError(
                "--data_config, --data_seed, --batch_size and --poison are the built-in "
                "StepDataModule's: give the settings of --data as --data.init_args.NAME"
            )
        reads(command.ckpt_path)  # a broken file: its own error, before the data's
        own = built_in_data(command, values) if values is not None else None
        if (record := record_path(command.ckpt_path)) is not None and record.is_file():
            read_record(record)  # its class paths checked before the line says it is read
            announce(record)
        return diagnose(
            command.ckpt_path,
            command.spike_step,
            config,
            model=model,
            data=own if own is not None else data,
            trainer_kwargs={"gradient_clip_val": clip} if clip is not None else None,
            original_loss=command.spike_loss,
            earlier_ckpt=command.earlier_ckpt_path,
            log_root=command.log_root,
            reads=reads,
        )
    except (ValueError, CheckpointError) as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> Verdict:
    """``lit-spikes diagnose``: prints the replays and the verdict."""
    parser = build_parser()
    config, parsed = parse_config(parser, DiagnoseConfig, None if argv is None else list(argv))
    verdict = _run(parser, config, parsed)
    console = Console() if Console().is_terminal else Console(width=140)
    print_verdict(verdict, console)
    path = parsed.get("json")
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_json_value(verdict.to_dict()), indent=1, allow_nan=False)
        path.write_text(text + "\n")
    return verdict


if __name__ == "__main__":
    main()
