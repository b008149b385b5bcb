"""``lit-spikes diagnose``: its flags, the data config they give, the verdict's table
and its JSON file."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from lit_spikes.checkpoints import CheckpointError
from lit_spikes.data import (
    DataConfig,
    data_config_from_checkpoint,
    data_config_from_dict,
    plain_config,
)
from lit_spikes.diagnose.config import DiagnoseConfig
from lit_spikes.diagnose.replay import CheckpointReads
from lit_spikes.diagnose.run import diagnose
from lit_spikes.diagnose.verdict import Verdict
from lit_spikes.training import unwritable_directory


def print_verdict(verdict: Verdict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(
        title=f"Replays of the spike at step {verdict.spike_step} "
        f"(checkpoint step {verdict.ckpt_step})"
    )
    table.add_column("replay")
    table.add_column("from step", justify="right")
    table.add_column("data", justify="left")
    for column in ("loss @spike", "max loss", "max attn logit"):
        table.add_column(column, justify="right")
    table.add_column("bit-equal")
    table.add_column("flagged steps")
    for replay in (verdict.same_data, verdict.other_data, verdict.earlier):
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
            f"{replay.max_logit:.1f}",
            "n/a" if replay.bit_equal is None else str(replay.bit_equal),
            ", ".join(map(str, replay.flagged)) or "none",
        )
    console.print(table)
    if verdict.original_loss is not None and math.isfinite(verdict.original_loss):
        console.print(f"Original loss at step {verdict.spike_step}: {verdict.original_loss:.4f}")
    for line in verdict.evidence:
        console.print(f"  {line}")
    console.print(f"Verdict: [bold]{verdict.cause}[/bold]")


def build_parser() -> argparse.ArgumentParser:
    defaults = DiagnoseConfig()
    parser = argparse.ArgumentParser(
        prog="lit-spikes diagnose",
        description="Replay a spike from a checkpoint before it: same data (does it come "
        "back, bit-exactly?), other data (still there?), and optionally an earlier "
        "checkpoint; say data-caused, state-caused or not-reproducible.",
    )
    add = parser.add_argument
    add("--ckpt", type=Path, required=True, help="a step=<k>.ckpt written before the spike")
    add("--spike-step", type=int, required=True, help="global step of the spike's onset")
    add("--earlier-ckpt", type=Path, help="an earlier checkpoint for replay (c)")
    add(
        "--spike-loss",
        type=float,
        help="the loss logged at the spike (default: from the "
        "run's TensorBoard events next to the checkpoint)",
    )
    add(
        "--data-config",
        type=Path,
        help="JSON/YAML file of the run's DataConfig fields, a recover ledger / RecoverConfig "
        "file (its 'data' section) or lit-spikes fit's config.yaml (default: the data config "
        "the checkpoint holds)",
    )
    add("--data-seed", type=int, help="data seed (default: the checkpoint's)")
    add("--batch-size", type=int, help="rows per step (default: the checkpoint's)")
    add("--poison", type=int, nargs="+", help="data positions the run had poisoned")
    add(
        "--clip",
        type=float,
        help="gradient_clip_val the run trained with (default: the checkpoint's; 0: none)",
    )
    add(
        "--window-before",
        type=int,
        default=defaults.window_before,
        help="replay (b) skips the data positions from the spike's minus this "
        f"(default {defaults.window_before})",
    )
    add(
        "--window-after",
        type=int,
        default=defaults.window_after,
        help=f"... to the spike's plus this (default {defaults.window_after})",
    )
    add(
        "--horizon",
        type=int,
        default=defaults.horizon,
        help=f"replays train this many steps past the spike (default {defaults.horizon})",
    )
    add("--log-root", type=Path, help="keep the replays' TensorBoard runs here")
    add("--json", type=Path, help="also write the verdict as JSON to this file")
    return parser


def data_from_args(
    args: argparse.Namespace, reads: CheckpointReads | None = None
) -> DataConfig | None:
    """The run's ``DataConfig``: the checkpoint's, with ``--data-config`` (a JSON or YAML
    file of its fields, a recover ledger or config, or ``lit-spikes fit``'s config.yaml)
    and the flags on top (None: none given, ``diagnose`` takes the checkpoint's).

    Raises:
        ValueError: an unreadable file or a value ``DataConfig`` refuses.
    """
    values: dict[str, Any] = {}
    if args.data_config is not None:
        try:  # YAML, as recover's --config (configs/recover.yaml); JSON is YAML too
            loaded = yaml.safe_load(args.data_config.read_text()) or {}
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as error:
            raise ValueError(f"--data-config {args.data_config}: {error}") from None
        # a recover ledger holds its config; lit-spikes fit's config.yaml, data.config
        # (data.init_args.config since fit takes any --data class)
        for key in ("config", "data", "init_args", "config"):
            if not isinstance(loaded, dict):
                break
            loaded = loaded.get(key, loaded)
        if not isinstance(loaded, dict):
            raise ValueError(
                f"--data-config {args.data_config}: holds a {type(loaded).__name__}, not a "
                "mapping of DataConfig fields (or a recover ledger or config, or lit-spikes "
                "fit's config.yaml)"
            )
        values = dict(loaded)
    for key, value in (("seed", args.data_seed), ("batch_size", args.batch_size)):
        if value is not None:
            values[key] = value
    if args.poison:
        values["poison"] = args.poison
    if not values:
        return None
    # On top of what the checkpoint holds (all of the data config, or its seed in files
    # from before); an unreadable file is reported by diagnose itself.
    try:
        base = plain_config(
            asdict(data_config_from_checkpoint((reads or CheckpointReads())(args.ckpt)))
        )
    except CheckpointError:
        base = {}
    world = {**base.get("world", {}), **values.get("world", {})}
    try:
        return data_config_from_dict(base | values | ({"world": world} if world else {}))
    except TypeError as error:
        raise ValueError(f"--data-config {args.data_config}: {error}") from None


def _json_value(value: Any) -> Any:
    """NaN and inf as strings: JSON has no such numbers (strict parsers refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    return value


def main(argv: Sequence[str] | None = None) -> Verdict:
    """``lit-spikes diagnose``: prints the replays and the verdict."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Before the replays, not after them: where their runs and the verdict go.
    if args.log_root is not None and (problem := unwritable_directory(args.log_root)):
        parser.error(f"--log-root {args.log_root} {problem}")
    if args.json is not None:
        if args.json.is_dir():
            parser.error(f"--json {args.json} is a directory: give a file name")
        if problem := unwritable_directory(args.json.parent):
            parser.error(f"--json {args.json}: its directory {problem}")
    try:
        config = DiagnoseConfig(args.window_before, args.window_after, args.horizon)
        reads = CheckpointReads()  # the data config's file is the first replay's
        data = data_from_args(args, reads)
        verdict = diagnose(
            args.ckpt,
            args.spike_step,
            data=data,
            trainer_kwargs={"gradient_clip_val": args.clip} if args.clip is not None else None,
            original_loss=args.spike_loss,
            earlier_ckpt=args.earlier_ckpt,
            config=config,
            log_root=args.log_root,
            reads=reads,
        )
    except (ValueError, CheckpointError) as error:
        parser.error(str(error))
    console = Console() if Console().is_terminal else Console(width=140)
    print_verdict(verdict, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_json_value(verdict.to_dict()), indent=1, allow_nan=False)
        args.json.write_text(text + "\n")
    return verdict


if __name__ == "__main__":
    main()
