"""``lit-spikes forensics``: which layer went first before a spike, by an exact replay with
per-layer instruments; the verdict on the terminal, TensorBoard runs, a figure, JSON."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl

from lit_spikes.checkpoints import CheckpointError
from lit_spikes.shared.training import unwritable_directory
from lit_spikes.tools.command_line import (
    CommandParser,
    add_class_path,
    as_plain,
    command_parser,
    config_of,
    parse_config,
)
from lit_spikes.tools.forensics.config import ForensicsConfig
from lit_spikes.tools.forensics.run import Forensics, ReplayNotExact, forensics

PROG = "lit-spikes forensics"
DESCRIPTION = (
    "Which layer went first before a loss spike: the steps before it computed again from "
    "a checkpoint of the run, exactly (every replayed loss checked against the run's log "
    "to the bit, or refused), with per-layer instruments attached (gradient, weight and "
    "update norms, the optimizer's state, the outputs' statistics, non-finite "
    "gradients); each statistic's band from the steps before the window, and the first "
    "to leave it. The run pays nothing: nothing is recorded while it trains. --model and "
    "--data as lit-spikes diagnose takes them (default: the run's config.yaml)."
)


@dataclass(frozen=True)
class ForensicsCommand:
    """Which spike of which run, and where the results go."""

    run: Path
    """The run's directory (its checkpoints/ beside its TensorBoard events), or one of
    its checkpoints, at least window + band_steps steps before the spike."""
    spike_step: int
    """Global step of the spike's onset (as the run's SpikeDetector flagged it)."""
    out: Path | None = None
    """TensorBoard runs (a run per layer), forensics.png and forensics.json go here
    (default: <run>/forensics/step<spike_step>, beside the run's own events)."""
    figures_dir: Path | None = None
    """A second place for forensics.png."""


def build_parser() -> CommandParser:
    parser = command_parser(PROG, DESCRIPTION, ForensicsConfig)
    parser.add_class_arguments(ForensicsCommand, nested_key=None, fail_untyped=False)
    add_class_path(parser, "model", pl.LightningModule)  # None: the run's own record
    add_class_path(parser, "data", pl.LightningDataModule)
    return parser


def main(argv: Sequence[str] | None = None) -> Forensics:
    """Replay, read and write; a bad option exits 2 before anything runs, a replay that
    is not the run exits 1 naming the step."""
    from lit_spikes.tools.diagnose.run import Sources

    parser = build_parser()
    args = None if argv is None else list(argv)
    config, parsed = parse_config(parser, ForensicsConfig, args)
    command: ForensicsCommand = config_of(ForensicsCommand, parsed)
    for option, where in (("--out", command.out), ("--figures_dir", command.figures_dir)):
        if where is not None and (problem := unwritable_directory(where)):
            parser.error(f"{option} {where} {problem}")
    sources = Sources(model=as_plain(parsed.get("model")), data=as_plain(parsed.get("data")))
    try:
        result = forensics(command.run, command.spike_step, config, sources=sources)
    except ReplayNotExact as refused:
        print(f"{PROG}: refused: {refused}", file=sys.stderr)
        raise SystemExit(1) from None
    except (ValueError, CheckpointError) as error:
        parser.error(str(error))
    run_dir = result.ckpt_path.parent.parent
    out = command.out or run_dir / "forensics" / f"step{command.spike_step}"
    from lit_spikes.tools.forensics.outputs import write_figure, write_json, write_tensorboard
    from lit_spikes.tools.forensics.report import verdict_lines

    for line in verdict_lines(result):
        print(line)
    written = [write_tensorboard(result, out), write_figure(result, out / "forensics.png")]
    written.append(write_json(result, out / "forensics.json"))
    if command.figures_dir is not None:
        written.append(write_figure(result, command.figures_dir / "forensics.png"))
    print(f"Written: {', '.join(map(str, written))} (tensorboard --logdir {out})")
    return result


if __name__ == "__main__":
    main()
