"""Replay diagnosis of a loss spike (``lit-spikes diagnose``): data, state, or neither?

From a real checkpoint written before the spike, the run is replayed past the spike's
step, bit-exactly (the data of a step is a function of the step, the rest is in the
checkpoint):

(a) the same state with the same data. Does the same spike come back, the same loss to
    the last bit? If not, the original spike is **not reproducible**: something outside
    the run's state and data made it (a hardware fault, a bit flip, a stray process).
    If the same loss comes back but the detector does not flag that step, it is **no
    spike**, and there is nothing to diagnose there.
(b) the same state with other data: the data positions around the spike's are skipped,
    so from the window on every step sees batches it never saw. Does it still spike?
    Then the spike is **state-caused** (the weights, the optimizer's moments and the LR
    were going to blow up whatever came next); otherwise **data-caused** (those batches).
(c) optionally, an earlier checkpoint with the same data: the spike must come back from
    there too, to the same bits. If it does not, the later checkpoint's state is not the
    product of the run's own history: the spike is **not reproducible** from clean state.

A spike is judged by a ``SpikeDetector`` run over each replay's losses (its reference
seeded from the detector state in the checkpoint when there is one), counting flags
from ``window_before`` steps before the spike to the end of the replay.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from lightning.pytorch.callbacks import Callback
from rich.console import Console
from rich.table import Table

from lit_spikes.callbacks import BatchSkipper, LRScaler, SkipStep, SpikeDetector
from lit_spikes.checkpoints import CheckpointError, checkpoint_step, load_checkpoint
from lit_spikes.data import (
    DataConfig,
    StepDataModule,
    data_config_from_checkpoint,
    data_config_from_dict,
    flat_config,
    plain_config,
)
from lit_spikes.model import GPTConfig
from lit_spikes.module import (
    CHECKPOINT_KEY,
    OptimConfig,
    TinyGPTModule,
    clipping_from_checkpoint,
    software_fingerprint,
)
from lit_spikes.recover import DetectorConfig
from lit_spikes.training import RunSpec, quiet_branches, unwritable_directory

Cause = Literal["data-caused", "state-caused", "not-reproducible", "no-spike"]


@dataclass(frozen=True)
class DiagnoseConfig:
    """How far the replays go and which data the other-data replay leaves out."""

    window_before: int = 5
    """The other-data replay skips data positions from the spike's minus this ..."""
    window_after: int = 25
    """... to the spike's plus this (PaLM skipped a few hundred batches around a spike)."""
    horizon: int = 20
    """Replays train this many steps past the spike (a state-caused spike may move)."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """What counts as a spike in a replay (``min_step`` is ignored: the window decides)."""

    def __post_init__(self) -> None:
        for name in ("window_before", "window_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"DiagnoseConfig.{name}={getattr(self, name)} must be >= 0")
        if self.horizon < 1:
            raise ValueError(f"DiagnoseConfig.horizon={self.horizon} must be >= 1")


@dataclass
class Replay:
    """One replay from a checkpoint, judged around the spike."""

    label: str
    ckpt_step: int
    skipped: tuple[int, int] | None
    """Half-open range of data positions left out (None: the same data)."""
    loss_at_spike: float
    max_loss: float
    """Largest loss from ``window_before`` steps before the spike to the replay's end."""
    max_logit: float
    """Largest attention logit over the same steps."""
    flagged: list[int]
    """Steps the detector flags in that range."""
    bit_equal: bool | None
    """The loss at the spike's step equals the original's to the last bit (None: no
    original to compare with)."""
    last_step: int
    wall_s: float = 0.0
    detector_from_checkpoint: bool = False
    """The judging detector continued the run's own (its state was in the checkpoint);
    otherwise a fresh one with the configured settings and a shortened warm-up."""

    @property
    def spiked(self) -> bool:
        return bool(self.flagged)


@dataclass
class Verdict:
    """The diagnosis: the cause and the replays it rests on."""

    cause: Cause
    spike_step: int
    ckpt_step: int
    ckpt_path: str
    original_loss: float | None
    """The loss the original run logged at the spike (None: unknown)."""
    same_data: Replay
    other_data: Replay | None
    """None when the spike did not come back with the same data (no point asking)."""
    earlier: Replay | None
    evidence: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- helpers


def callbacks_from_checkpoint(checkpoint: dict[str, Any]) -> list[Callback]:
    """The remedy callbacks whose state a checkpoint holds (``LRScaler``, ``BatchSkipper``,
    ``SkipStep``), rebuilt from it so a replay trains as the original run did. Gradient
    clipping is a Trainer argument: ``clipping_from_checkpoint``."""
    rebuilt: list[Callback] = []
    for key, state in checkpoint.get("callbacks", {}).items():
        if key.startswith("LRScaler{"):
            rebuilt.append(LRScaler(state["factor"], state["start_step"], state["end_step"]))
        elif key.startswith("BatchSkipper{"):
            rebuilt.append(BatchSkipper(positions=state["skip"]))
        elif key.startswith("SkipStep{") and "window" in state:
            rebuilt.append(
                SkipStep(
                    metric=state["metric"],
                    window=state["window"],
                    sigma=state["sigma"],
                    warmup=state["warmup"],
                    start_step=state["start_step"],
                )
            )
    return rebuilt


def logged_losses(run_dir: Path) -> dict[int, float]:
    """The ``train/loss`` a run logged to TensorBoard, by step (the last value of a step
    logged twice); empty when it has no events or no such tag."""
    if not any(run_dir.glob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    if "train/loss" not in accumulator.Tags().get("scalars", []):
        return {}
    return {int(e.step): float(e.value) for e in accumulator.Scalars("train/loss")}


def logged_loss(run_dir: Path, step: int) -> float | None:
    """The ``train/loss`` a run logged to TensorBoard at ``step`` (None: not found)."""
    return logged_losses(run_dir).get(step)


def _detector(config: DetectorConfig, checkpoint: dict[str, Any], steps: int) -> SpikeDetector:
    """An offline detector whose reference continues the original run's when the
    checkpoint holds a detector of the same settings; otherwise one whose warm-up fits
    in the ``steps`` replayed before the judged range."""
    detector = replace(config, min_step=0).build(0)
    state = detector.state_in(checkpoint)
    if state is not None:
        detector.load_state_dict(state)
        detector.spikes = []
        return detector
    return replace(config, min_step=0, warmup=min(config.warmup, max(2, steps))).build(0)


# ----------------------------------------------------------------------------- diagnosis


class _Replayer:
    def __init__(
        self,
        spike_step: int,
        data: DataConfig,
        callbacks: Sequence[Callback] | None,
        trainer_kwargs: dict[str, Any],
        original: float | None,
        config: DiagnoseConfig,
        log_root: Path,
    ) -> None:
        self.spike_step, self.data, self.callbacks = spike_step, data, callbacks
        self.trainer_kwargs, self.original = trainer_kwargs, original
        self.config, self.log_root = config, log_root
        self.incomparable: str | None = None
        """Why a replay here cannot match the original to the bit (another CPU's
        kernels, other versions, a multi-process run): a differing loss then proves
        nothing."""

    def run(
        self,
        label: str,
        ckpt_path: Path,
        skipped: tuple[int, int] | None = None,
        remedies_of: Path | None = None,
    ) -> tuple[Replay, dict[int, dict[str, float]]]:
        """Replay from ``ckpt_path``, with the remedy callbacks ``remedies_of`` holds (by
        default the same file's) unless the caller gave callbacks."""
        checkpoint = load_checkpoint(ckpt_path)
        hparams = checkpoint["hyper_parameters"]
        optim = OptimConfig(**hparams["optim"])
        module = TinyGPTModule(
            gpt=GPTConfig(**hparams["gpt"]),
            optim=optim,
            model_seed=hparams["model_seed"],
            train_seed=hparams["train_seed"],
            num_threads=hparams["num_threads"],
            # Files written before the option existed were trained without flushing.
            flush_denormal=hparams.get("flush_denormal", False),
        )
        k = int(checkpoint["global_step"])
        # Past the schedule's end too: a run (recover's) may train on at its floor LR
        end = self.spike_step + self.config.horizon + 1
        if self.callbacks is not None:
            callbacks = [copy.deepcopy(cb) for cb in self.callbacks]
        else:
            remedies = checkpoint if remedies_of is None else load_checkpoint(remedies_of)
            callbacks = callbacks_from_checkpoint(remedies)
        if skipped is not None:
            callbacks.append(BatchSkipper(ranges=[skipped]))
        spec = RunSpec(
            log_root=self.log_root,
            name=label,
            max_steps=end,
            callbacks=callbacks,
            progress_bar=False,
            trainer_kwargs={"limit_val_batches": 0, **self.trainer_kwargs},
            resume_step=k,
        )
        start = time.perf_counter()
        with quiet_branches():
            spec.trainer().fit(module, datamodule=StepDataModule(self.data), ckpt_path=ckpt_path)
        wall = time.perf_counter() - start
        records = {int(r["step"]): r for r in module.history}
        if self.spike_step not in records:
            raise RuntimeError(
                f"the replay {label} from step {k} never reached spike_step={self.spike_step}"
            )
        first = self.spike_step - self.config.window_before
        detector = _detector(self.config.detector, checkpoint, first - k)
        continued = detector.state_in(checkpoint) is not None
        flagged = []
        for step in sorted(records):
            found = detector.check(step, records[step])
            if step >= first and found:
                flagged.append(step)
        judged = [records[s] for s in sorted(records) if s >= first]
        loss = float(records[self.spike_step]["loss"])
        equal = bit_equal(loss, self.original)
        replay = Replay(
            label=label,
            ckpt_step=k,
            skipped=skipped,
            loss_at_spike=loss,
            max_loss=max(float(r["loss"]) for r in judged),
            max_logit=max(float(r["max_logit"]) for r in judged),
            flagged=flagged,
            bit_equal=None if self.incomparable and not equal else equal,
            last_step=max(records),
            wall_s=wall,
            detector_from_checkpoint=continued,
        )
        return replay, records


def diagnose(
    ckpt_path: str | Path,
    spike_step: int,
    *,
    data: DataConfig | None = None,
    callbacks: Sequence[Callback] | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    original_loss: float | None = None,
    earlier_ckpt: str | Path | None = None,
    config: DiagnoseConfig | None = None,
    log_root: str | Path | None = None,
) -> Verdict:
    """Replay a spike from a checkpoint before it and say what caused it.

    Args:
        ckpt_path: a Lightning checkpoint of the run, written before ``spike_step``.
        spike_step: global step of the spike's onset.
        data: the run's ``DataConfig`` (None: the defaults with the checkpoint's seed).
        callbacks: callbacks the run trained with (None: rebuilt from the checkpoint's
            callback states: ``LRScaler``, ``BatchSkipper``, ``SkipStep``). Each replay
            gets its own copies.
        trainer_kwargs: other Trainer arguments of the run (None: its gradient clipping
            as the checkpoint records it; give ``gradient_clip_val`` to set another, 0 for
            none).
        original_loss: the loss the run logged at ``spike_step`` (None: read from the
            TensorBoard events of the checkpoint's run, ``<ckpt>/../..``).
        earlier_ckpt: a checkpoint before ``ckpt_path`` for replay (c), trained with the
            remedies ``ckpt_path`` holds (a recover branch's parent's file, too).
        config: replay lengths, the other-data window and the detector.
        log_root: where the replays' TensorBoard runs go (None: a temporary directory).

    Raises:
        CheckpointError: a checkpoint that cannot be resumed from.
        ValueError: ``spike_step`` not after the checkpoint, or an earlier checkpoint
            that is not earlier.
    """
    config = config or DiagnoseConfig()
    ckpt_path = Path(ckpt_path)
    checkpoint = load_checkpoint(ckpt_path)
    k = int(checkpoint["global_step"])
    if not k < spike_step:
        raise ValueError(
            f"spike_step={spike_step} must be after the checkpoint's step {k} ({ckpt_path})"
        )
    if earlier_ckpt is not None:
        earlier_step = checkpoint_step(earlier_ckpt)
        if earlier_step >= k:
            raise ValueError(
                f"earlier_ckpt={earlier_ckpt} is at step {earlier_step}, not before the "
                f"checkpoint's step {k}"
            )
        _refuse_another_run(ckpt_path, checkpoint, Path(earlier_ckpt))
    if data is None:
        data = data_config_from_checkpoint(checkpoint)
    trainer_kwargs = dict(trainer_kwargs or {})
    if "gradient_clip_val" not in trainer_kwargs:
        trainer_kwargs |= clipping_from_checkpoint(checkpoint)
    original = original_loss
    if original is None:
        logged = logged_losses(ckpt_path.parent.parent)
        if logged and spike_step > max(logged):
            # a typo (1470 for 147) would replay a thousand steps, then find no spike
            raise ValueError(
                f"spike_step={spike_step} is past the last step the checkpoint's run logged "
                f"({max(logged)}): give a step of that run (or its loss, --spike-loss, for a "
                "step it did not log)"
            )
        original = logged.get(spike_step)
    with tempfile.TemporaryDirectory(prefix="lit-spikes-diagnose-") as temp:
        root = Path(log_root) if log_root is not None else Path(temp)
        replayer = _Replayer(spike_step, data, callbacks, trainer_kwargs, original, config, root)
        replayer.incomparable = _incomparable(checkpoint)
        return _judge(replayer, ckpt_path, k, earlier_ckpt, original)


def _incomparable(checkpoint: dict[str, Any]) -> str | None:
    """Why a replay in this process cannot reproduce the checkpoint's run to the bit
    (None: it can)."""
    saved = checkpoint.get(CHECKPOINT_KEY, {}).get("fingerprint", {})
    here = software_fingerprint()
    differ = [
        f"{key} {saved[key]!r} there, {value!r} here"
        for key, value in here.items()
        if key in saved and saved[key] != value
    ]
    if int(saved.get("world_size", 1)) > 1:
        differ.append(
            f"the run trained on {saved['world_size']} processes: its logged loss is rank 0's "
            "rows', a replay's the whole batch's"
        )
    return "; ".join(differ) or None


def _refuse_another_run(ckpt_path: Path, checkpoint: dict[str, Any], earlier: Path) -> None:
    """An earlier checkpoint of another run (another model, optimizer or seeds) cannot
    replay this one's history: its replay would differ and blame the later state.

    Raises:
        ValueError: naming the settings that differ.
    """
    mine = flat_config(plain_config(checkpoint.get("hyper_parameters", {})))
    theirs = flat_config(plain_config(load_checkpoint(earlier).get("hyper_parameters", {})))
    differ = [
        f"{key}: {theirs[key]!r} there, {mine[key]!r} here"
        for key in sorted(mine.keys() & theirs.keys())  # a key newer code added is no difference
        if mine[key] != theirs[key] and key not in ("num_threads", "flush_denormal")
    ]
    if differ:
        raise ValueError(
            f"earlier_ckpt={earlier} is not of the run of {ckpt_path} ({'; '.join(differ)}): "
            "give an earlier checkpoint of the same run (or of its recover branch's parent)"
        )


def _judge(
    replayer: _Replayer,
    ckpt_path: Path,
    k: int,
    earlier_ckpt: str | Path | None,
    original: float | None,
) -> Verdict:
    spike_step, config = replayer.spike_step, replayer.config
    same, records = replayer.run("replay_same_data", ckpt_path)
    evidence = []
    if original is None:
        compared = "no original loss to compare with (pass original_loss / --spike-loss)"
    elif same.bit_equal:
        compared = f"bit-identical to the original {original!r}"
    elif same.bit_equal is None and replayer.incomparable:
        compared = (
            f"the original was {original:.4f}; bit-equality cannot be told here "
            f"({replayer.incomparable}), so the spike counts as back where it is flagged"
        )
    elif same.bit_equal is None:
        compared = (
            f"the original as given, {original!r} (rounded: bit-equality cannot be told; "
            "TensorBoard's train/loss has every digit)"
        )
    else:
        compared = (
            f"the original was {original:.4f} (differs by {same.loss_at_spike - original:+.2e})"
        )
    evidence.append(
        f"(a) same state, same data, from step {k}: loss at step {spike_step} "
        f"{same.loss_at_spike:.4f}, {compared}; flagged steps {same.flagged or 'none'}."
    )
    if same.bit_equal is not False and spike_step not in same.flagged:
        judge = (
            "the run's own detector, continued from the checkpoint,"
            if same.detector_from_checkpoint
            else "a fresh detector (the checkpoint holds none of these settings: "
            "--window-before or a detector like the run's may judge otherwise)"
        )
        replayed = (
            "replays bit-identically"
            if same.bit_equal
            else "replays (no original loss)"
            if original is None
            else "replays (to the given loss's decimals)"
        )
        evidence.append(
            f"Step {spike_step} {replayed}, but it is no spike: {judge} flags "
            f"{same.flagged or 'no step'} there. Nothing to diagnose at step {spike_step}; "
            "give a flagged step (TensorBoard's spike/loss, or the run's SpikeDetector.spikes)."
        )
        return Verdict(
            "no-spike", spike_step, k, str(ckpt_path), original, same, None, None, evidence
        )
    # Flagged but not the original loss (a fault that only made the spike larger, or a
    # setting unlike the run's) is not the run's spike: only a rounded original is taken
    # as matched by its decimals.
    reproduced = same.bit_equal is not False
    if not reproduced:
        evidence.append(
            "The spike does not come back from the same state and data: the run's own "
            "state and data do not produce it; something outside them did (hardware fault, "
            "bit flip, a process that touched the weights)."
        )
        return Verdict(
            "not-reproducible", spike_step, k, str(ckpt_path), original, same, None, None, evidence
        )
    position = int(records[spike_step]["position"])
    first = int(records[k]["position"]) if k in records else k
    window = (max(first, position - config.window_before), position + config.window_after + 1)
    other, _ = replayer.run("replay_other_data", ckpt_path, window)
    earlier: Replay | None = None
    if earlier_ckpt is not None:
        # Against the run's own full loss where one is known to the bit; else (none given,
        # or one given rounded) the same-data replay's, which matched it
        replayer.original = original if same.bit_equal else same.loss_at_spike
        replayer.incomparable = None  # (c) is held against a replay of this process
        # The run's remedies are the later file's: an earlier one may be the parent's, from
        # before a recover branch started with them (its skip set, its LR scale).
        earlier, _ = replayer.run("replay_earlier_ckpt", Path(earlier_ckpt), remedies_of=ckpt_path)
    evidence.append(
        f"(b) same state, data positions {window[0]}-{window[1] - 1} skipped (the spike's "
        f"position is {position}): max loss {other.max_loss:.4f} from step "
        f"{spike_step - config.window_before} on (same data: {same.max_loss:.4f}); "
        f"flagged steps {other.flagged or 'none'}."
    )
    cause: Cause
    if earlier is not None:
        back = earlier.bit_equal is not False
        evidence.append(
            f"(c) from the earlier step-{earlier.ckpt_step} checkpoint, same data: loss at step "
            f"{spike_step} {earlier.loss_at_spike:.4f}, "
            + ("bit-identical" if earlier.bit_equal else "not bit-identical")
            + (" to the same-data replay" if not same.bit_equal else "")
            + f"; flagged steps {earlier.flagged or 'none'}."
        )
        if not back:
            evidence.append(
                f"The spike comes back from step {k} but not from step {earlier.ckpt_step}: "
                f"the step-{k} state is not what the run's own history produces."
            )
            return Verdict(
                "not-reproducible",
                spike_step,
                k,
                str(ckpt_path),
                original,
                same,
                other,
                earlier,
                evidence,
            )
    if other.spiked:
        cause = "state-caused"
        evidence.append(
            "Without the data around it the run still spikes: the state (weights, optimizer "
            "moments, learning rate) causes it; aim at the cause (lower LR, QK-norm), "
            "skipping data only moves it."
        )
    else:
        cause = "data-caused"
        evidence.append(
            "Without the data around it the spike is gone: those batches cause it; skipping "
            "them (PaLM) removes it."
        )
    return Verdict(cause, spike_step, k, str(ckpt_path), original, same, other, earlier, evidence)


# ----------------------------------------------------------------------------- report


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


def data_from_args(args: argparse.Namespace) -> DataConfig | None:
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
        for key in ("config", "data", "config"):
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
        base = plain_config(asdict(data_config_from_checkpoint(load_checkpoint(args.ckpt))))
    except CheckpointError:
        base = {}
    world = {**base.get("world", {}), **values.get("world", {})}
    try:
        return data_config_from_dict(base | values | ({"world": world} if world else {}))
    except TypeError as error:
        raise ValueError(f"--data-config {args.data_config}: {error}") from None


def given_decimals(value: float) -> int | None:
    """The decimals of ``value`` as typed, when it is a rounded one (``2.7175``: 4; None:
    the shortest form of a float32 logged loss, which has 7 or more significant digits)."""
    text = repr(value)
    if "e" in text or "." not in text or len(text.replace("-", "").replace(".", "")) >= 7:
        return None
    return len(text.split(".")[1])


def bit_equal(loss: float, original: float | None) -> bool | None:
    """Whether a replay's loss is the original's to the bit: None when there is no
    original, or when the original was given rounded (``--spike-loss 2.7175``, as this
    tool prints it) and the loss rounds to it: equality cannot be told. Two NaNs are
    equal (a replayed NaN is the run's NaN)."""
    if original is None:
        return None
    if loss == original or (math.isnan(loss) and math.isnan(original)):
        return True
    decimals = given_decimals(original)
    if decimals is not None and round(loss, decimals) == original:
        return None
    return False


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
        data = data_from_args(args)
        verdict = diagnose(
            args.ckpt,
            args.spike_step,
            data=data,
            trainer_kwargs={"gradient_clip_val": args.clip} if args.clip is not None else None,
            original_loss=args.spike_loss,
            earlier_ckpt=args.earlier_ckpt,
            config=config,
            log_root=args.log_root,
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
