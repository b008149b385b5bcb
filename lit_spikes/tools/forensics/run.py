"""``forensics``: a spike's steps computed again from a checkpoint before it, exactly, with
per-layer instruments attached; checked loss by loss against the run's log, then read
for which layer went first."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_spikes.checkpoints import checkpoint_files
from lit_spikes.shared.training import CHECKPOINT_DIRNAME
from lit_spikes.tools.diagnose.config import DiagnoseConfig
from lit_spikes.tools.diagnose.replay import CheckpointReads
from lit_spikes.tools.diagnose.run import Sources, prepare
from lit_spikes.tools.forensics.config import ForensicsConfig
from lit_spikes.tools.forensics.instruments import LayerInstruments
from lit_spikes.tools.forensics.verdict import RUN, Exit, Reading, exits, read


class ReplayNotExact(ValueError):
    """The replay did not compute what the run logged: its per-layer numbers would be
    another run's."""


@dataclass
class Forensics:
    """A spike's forensics: the replay, its check against the run, and the reading."""

    spike_step: int
    ckpt_path: Path
    ckpt_step: int
    layers: list[str]
    series: dict[tuple[str, str], dict[int, float]]
    """Every statistic by ``(layer, stat)``, each ``{step: value}``; the run's loss, LR
    and the module's columns under the layer ``RUN``."""
    band_steps: range
    window: range
    checked: list[int]
    """The steps whose replayed loss was compared with the run's logged loss (all equal
    to the bit, or the replay is refused)."""
    exits: list[Exit] = field(default_factory=list)
    reading: Reading = field(default_factory=lambda: read([], []))
    pace: tuple[int, float, float] | None = None
    """The steps timed (from the replay's first step's end to its last's), the seconds
    the replay took for them, and the seconds spent in the instruments (all steps)."""


def find_checkpoint(run: str | Path, spike_step: int, before: int) -> Path:
    """The newest checkpoint of ``run`` at least ``before`` steps before the spike:
    ``run`` is a checkpoint itself, its run's directory or that run's ``checkpoints``.

    Raises:
        ValueError: no checkpoint there, or none early enough (naming the steps found).
    """
    path = Path(run)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(
            f"run={path} is neither a checkpoint nor a directory: give a run's directory "
            "(its checkpoints/ beside its TensorBoard events) or one of its checkpoints"
        )
    directory = path / CHECKPOINT_DIRNAME if (path / CHECKPOINT_DIRNAME).is_dir() else path
    files = checkpoint_files(directory)
    early = [(step, file) for step, file in files if step <= spike_step - before]
    if not early:
        steps = [step for step, _ in files]
        raise ValueError(
            f"no checkpoint in {directory} is {before} or more steps before spike_step="
            f"{spike_step} (steps found: {steps or 'none'}): give a run whose files start "
            "earlier, or a smaller --window/--band_steps"
        )
    return max(early)[1]


def forensics(
    run: str | Path,
    spike_step: int,
    config: ForensicsConfig | None = None,
    *,
    sources: Sources | None = None,
    log_root: str | Path | None = None,
) -> Forensics:
    """Replay the steps before a spike with per-layer instruments and read which layer
    went first.

    Args:
        run: a checkpoint before the spike, or the run's directory (its newest
            checkpoint at least ``window + band_steps`` steps before the spike is used).
        spike_step: the global step of the loss spike's onset.
        config: the window, the bands and the layers (``ForensicsConfig``).
        sources: the module, data, callbacks and Trainer arguments where the run's own
            record is not taken (as ``diagnose`` takes them).
        log_root: where the replay's TensorBoard run goes (None: a temporary directory).

    Raises:
        ReplayNotExact: a replayed loss differs from the run's logged one, or the run
            was trained where a replay here cannot match it to the bit.
        ValueError, CheckpointError: as ``diagnose``; no checkpoint early enough.
    """
    config = config or ForensicsConfig()
    ckpt = find_checkpoint(run, spike_step, config.window + config.band_steps)
    reads = CheckpointReads()
    k = int(reads(ckpt)["global_step"])
    if spike_step - k < config.window + config.band_steps:
        raise ValueError(
            f"{ckpt} is at step {k}, {spike_step - k} steps before spike_step={spike_step}: "
            f"the bands need {config.band_steps} steps before the {config.window}-step "
            "window; give an earlier checkpoint"
        )
    instruments = LayerInstruments(config.layers)
    records, logged, columns = _replay(
        ckpt, spike_step, config, sources or Sources(), (reads, log_root), instruments
    )
    checked = _check_exact(records, logged)
    layers = list(instruments.layers)
    series = _series(records, instruments.records, columns)
    start = spike_step - config.window
    result = Forensics(
        spike_step=spike_step,
        ckpt_path=ckpt,
        ckpt_step=k,
        layers=layers,
        series=series,
        band_steps=range(k, start),
        window=range(start, spike_step + 1),
        checked=checked,
    )
    result.exits = exits(series, result.band_steps, result.window, config.width, config.floor)
    result.pace = _pace(instruments)
    result.reading = read([e for e in result.exits if e.layer != RUN], layers)
    return result


def _replay(
    ckpt: Path,
    spike_step: int,
    config: ForensicsConfig,
    sources: Sources,
    where: tuple[CheckpointReads, str | Path | None],
    instruments: LayerInstruments,
) -> tuple[dict[int, dict[str, float]], dict[int, float], list[str]]:
    """The replay from ``ckpt`` with ``instruments`` (``where``: the files read, and the
    replay's log root): each step's record, the run's logged loss by step, and the
    module's column keys."""
    reads, log_root = where
    replay_config = DiagnoseConfig(horizon=max(config.after, 1), exact_resume=config.exact_resume)
    with tempfile.TemporaryDirectory(prefix="lit-spikes-forensics-") as temp:
        root = Path(log_root) if log_root is not None else Path(temp)
        prepared = prepare(ckpt, spike_step, replay_config, sources, reads, root)
        replayer = prepared.replayer
        _refuse_incomparable(replayer.incomparable)  # before a replay that could not match
        replayer.instruments = [instruments]
        _, records = replayer.run("forensics", ckpt)
    return records, replayer.logged, [c.key for c in replayer.columns]


def _refuse_incomparable(incomparable: str | None) -> None:
    """A run no replay here can match to the bit (another machine's versions, several
    processes) is refused before it is replayed.

    Raises:
        ReplayNotExact: naming why.
    """
    if incomparable is not None:
        raise ReplayNotExact(
            f"the run cannot be replayed to the bit here ({incomparable}): the per-layer "
            "numbers would be another run's; replay it where it was trained, on as many "
            "processes (a replay across process counts waits for the elastic resume)"
        )


def _check_exact(records: dict[int, dict[str, float]], logged: dict[int, float]) -> list[int]:
    """The replayed steps whose loss the run logged, each equal to the bit.

    Raises:
        ReplayNotExact: naming the first step that differs.
    """
    checked = []
    for step in sorted(records):
        if step not in logged:
            continue
        replayed, ran = float(records[step]["loss"]), logged[step]
        same = replayed == ran or (math.isnan(replayed) and math.isnan(ran))
        if not same:
            raise ReplayNotExact(
                f"the replayed loss at step {step} is {replayed!r}, the run logged "
                f"{ran!r}: the replay is not the run (its module, data, callbacks "
                "or Trainer settings differ from the run's: lit-spikes diagnose names them)"
            )
        checked.append(step)
    return checked


def _series(
    records: dict[int, dict[str, float]],
    layered: dict[int, dict[str, dict[str, float]]],
    columns: Sequence[str],
) -> dict[tuple[str, str], dict[int, float]]:
    """The instruments' numbers by ``(layer, stat)``, and the run's own under ``RUN``."""
    series: dict[tuple[str, str], dict[int, float]] = {}
    for step, layers in sorted(layered.items()):
        for layer, stats in layers.items():
            for stat, number in stats.items():
                series.setdefault((layer, stat), {})[step] = number
    for step, row in sorted(records.items()):
        for key in ("loss", "lr", *columns):
            value: Any = row.get(key)
            if isinstance(value, int | float):
                series.setdefault((RUN, key), {})[step] = float(value)
    return series


def _pace(instruments: LayerInstruments) -> tuple[int, float, float] | None:
    """The steps timed, the replay's seconds for them, and the instruments' share."""
    seconds = instruments.seconds
    if len(seconds) < 2:
        return None
    first, last = min(seconds), max(seconds)
    return last - first, seconds[last] - seconds[first], instruments.own_seconds
