"""One replay of a spike: a Lightning run resumed from a real checkpoint with the module,
data and remedy callbacks of the original (``subject``), trained past the spike with a
recorder of each step's numbers, then judged by a detector that continues the run's own
where the checkpoint holds it."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks import BatchSkipper, SpikeDetector
from lit_spikes.callbacks.exact_resume import STATE_KEY
from lit_spikes.checkpoints import load_checkpoint
from lit_spikes.loader import positioned
from lit_spikes.shared.training import RunSpec, quiet_branches
from lit_spikes.tool_facts import Column, ToolFacts
from lit_spikes.tools.detector_config import DetectorConfig
from lit_spikes.tools.diagnose.config import DiagnoseConfig
from lit_spikes.tools.diagnose.subject import Subject
from lit_spikes.tools.diagnose.unlike import settings_unlike_the_run
from lit_spikes.tools.diagnose.verdict import Replay, bit_equal
from lit_spikes.tools.judgement import Rise, rise_in
from lit_spikes.tools.resume_callbacks import parse_state_key, rebuild, with_exact_resume

LOSS_TAGS = ("train/loss", "loss", "train_loss", "train_loss_step", "loss_step")
"""The TensorBoard tags a run's loss is looked for under, in order (TinyGPTModule logs
``train/loss``; a module's ``self.log("loss", ...)`` is ``loss``, ``"train_loss"`` the
common name, ``_step`` where it is logged on_epoch too), after the detector's monitor."""


class CheckpointReads:
    """Each checkpoint file a diagnosis uses, loaded (and its checks run) once: the
    step checks, the remedies, the data config and every replay of one file share it.
    Callers copy what they change (a callback's state, a detector's)."""

    def __init__(self) -> None:
        self._loaded: dict[Path, dict[str, Any]] = {}

    def __call__(self, path: str | Path) -> dict[str, Any]:
        """The checkpoint at ``path``.

        Raises:
            CheckpointError: as ``load_checkpoint``.
        """
        key = Path(path).resolve()
        if key not in self._loaded:
            self._loaded[key] = load_checkpoint(path)
        return self._loaded[key]


def logged_losses(run_dir: Path, tags: Sequence[str] = LOSS_TAGS) -> dict[int, float]:
    """The loss a run logged to TensorBoard, by step (the last value of a step logged
    twice), under the first of ``tags`` its events hold; empty when it has no events or
    none of them."""
    return logged_curve(run_dir, tags)[1]


def logged_curve(
    run_dir: Path, tags: Sequence[str] = LOSS_TAGS
) -> tuple[str | None, dict[int, float]]:
    """``logged_losses`` and the tag it read (None: none)."""
    if not any(run_dir.glob("events.out.tfevents.*")):
        return None, {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    held = accumulator.Tags().get("scalars", [])
    for tag in tags:
        if tag in held:
            return tag, {int(e.step): float(e.value) for e in accumulator.Scalars(tag)}
    return None, {}


def logged_loss(run_dir: Path, step: int, tags: Sequence[str] = LOSS_TAGS) -> float | None:
    """The loss a run logged to TensorBoard at ``step`` (None: not found)."""
    return logged_losses(run_dir, tags).get(step)


class StepRecorder(Callback):
    """Each step's numbers as plain floats, by step: ``loss`` (what ``training_step``
    returned), ``position`` (the data position the step trained on: its step where the
    data is not positioned), ``lr`` (the first optimizer's as the step began), the
    ``names`` the detector watches and the module's columns (``grad_norm`` before any
    clipping; others as the module logs them, ``callback_metrics``), and whatever the
    module's own record of the step holds (its ``history``: the demo's ``max_logit``).
    First among the callbacks: it measures the gradients before a remedy drops them."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names = tuple(names)
        self.records: dict[int, dict[str, float]] = {}
        self.drew = False
        """A step after the first drew from torch's RNG (dropout): where the checkpoint
        holds no RNG states, a replay's draws are not the run's."""
        self._step = 0
        self._grad_norm = self._lr = math.nan
        self._rng: torch.Tensor | None = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step, self._grad_norm = trainer.global_step, math.nan
        # The LR as the step begins, as recover's history records it (a column's key)
        groups = trainer.optimizers[0].param_groups if trainer.optimizers else []
        self._lr = float(groups[0]["lr"]) if groups else math.nan

    def mark_step_start(self) -> None:
        """The RNG state the step's own draws start from (``StepStart`` calls it after
        every other callback's batch start: ExactResume seeds each step there). Not in the
        first step: a file without RNG states is resumed there."""
        self._rng = torch.random.get_rng_state() if self.records else None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if "grad_norm" in self.names:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            if grads:
                self._grad_norm = float(torch.nn.utils.get_total_norm(grads))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        step = self._step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        data = positioned(trainer)
        row: dict[str, float] = {
            "step": step,
            "loss": float(loss) if isinstance(loss, torch.Tensor) else math.nan,
            "position": data.position_of_step(step) if data is not None else step,
            "lr": self._lr,
        }
        for name in (n for n in self.names if n != "loss"):
            value = trainer.callback_metrics.get(name)
            if name == "grad_norm":
                row[name] = self._grad_norm
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                row[name] = float(value)
        history = getattr(pl_module, "history", None)
        own = history[-1] if isinstance(history, list) and history else None
        if isinstance(own, dict) and own.get("step") == step:  # the module's record of it
            row |= own
        self.records[step] = row
        if self._rng is not None and not torch.equal(self._rng, torch.random.get_rng_state()):
            self.drew = True


class StepStart(Callback):
    """Last among the callbacks: tells ``recorder`` where the step's own draws start."""

    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        self.recorder.mark_step_start()


class StopAfter(Callback):
    """Stops a replay after global step ``step``: the replay trains the run's own length
    (``max_steps``, which a module's schedule may read), and stops where it has seen
    enough."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@dataclass(frozen=True)
class Judge:
    """The settings of the detector that judges every replay, and whose they are."""

    settings: dict[str, Any]
    """``SpikeDetector``'s arguments (``min_step`` aside: the window decides)."""
    source: str
    """Whose settings these are, for the evidence."""

    @property
    def monitors(self) -> tuple[str, ...]:
        return self.detector().monitors

    def detector(self, warmup: int | None = None) -> SpikeDetector:
        changes = {} if warmup is None else {"warmup": warmup}
        return SpikeDetector(**{**self.settings, **changes, "min_step": 0})


def judge_of(
    config: DetectorConfig | None,
    checkpoint: dict[str, Any],
    facts: Callable[[], ToolFacts] = ToolFacts,
) -> Judge:
    """``config``'s detector, with the module's rule (``facts``, read only if needed)
    where it sets none; None: the run's own, the first ``SpikeDetector`` whose state the
    checkpoint holds, rebuilt from its state key (which names its settings), else the
    default settings."""
    if config is not None:
        detector = config.build(facts())
        settings = {"monitor": list(detector.monitors), "window": detector.window}
        settings |= {"warmup": detector.warmup, "ratio": detector.ratio}
        settings |= {"z_score": detector.z_score, "robust_z": detector.robust_z}
        settings |= {"action": "log"}
        return Judge(settings, "DiagnoseConfig.detector (--detector.*)")
    for key, state in (checkpoint.get("callbacks") or {}).items():
        parsed = parse_state_key(str(key))
        built = rebuild(str(key), state) if parsed and parsed[0] == "SpikeDetector" else None
        if built is not None:
            _, init_args, _ = built
            call = ", ".join(f"{k}={v!r}" for k, v in init_args.items() if k != "action")
            return Judge(init_args, f"the run's SpikeDetector({call})")
    return judge_of(DetectorConfig(), checkpoint, facts)


def judging_detector(judge: Judge, checkpoint: dict[str, Any], steps: int) -> SpikeDetector:
    """An offline detector whose reference continues the original run's when the
    checkpoint holds a detector of the same settings; otherwise one whose warm-up fits
    in the ``steps`` replayed before the judged range."""
    detector = judge.detector()
    state = detector.state_in(checkpoint)
    if state is not None:
        detector.load_state_dict(copy.deepcopy(state))  # the checkpoint is shared
        detector.spikes.clear()
        detector.num_spikes = 0
        return detector
    return judge.detector(warmup=min(detector.warmup, max(2, steps)))


@dataclass
class Replayer:
    """Replays of one spike, each from a checkpoint, with the run's module, data,
    callbacks and Trainer arguments; ``reads`` loads each file once."""

    spike_step: int
    subject: Subject
    trainer_kwargs: dict[str, Any]
    original: float | None
    config: DiagnoseConfig
    log_root: Path
    reads: CheckpointReads
    judge: Judge = field(default_factory=lambda: judge_of(DetectorConfig(), {}))
    end_step: int | None = None
    """The run's end (its ``max_steps``): no replay trains past it (None: not known)."""
    incomparable: str | None = None
    """Why a replay here cannot match the original to the bit (another CPU's kernels,
    other versions, a multi-process run): a differing loss then proves nothing."""
    drew_without_states: bool = False
    """A replay drew random numbers that the checkpoint holds no RNG states for."""
    logged: dict[int, float] = field(default_factory=dict)
    """The run's logged loss by step: a replay's first steps are checked against it."""
    unlike: list[str] = field(default_factory=list)
    """The last replay's settings that the checkpoint records otherwise (``unlike``)."""
    columns: tuple[Column, ...] = ()
    """The module's extra columns (``ToolFacts.columns``): each replay's largest value."""
    instruments: list[Callback] = field(default_factory=list)
    """Callbacks every replay also trains with, after the recorder (they must change
    nothing the run computes: the forensics replay's per-layer instruments)."""

    def settings(self) -> str:
        """What the replays train with that the run's record decides: its length and
        Trainer settings, said where they are not known."""
        length = (
            f"max_steps={self.end_step}"
            if self.end_step is not None
            else "max_steps at the horizon's end (the run's is not known: no config.yaml "
            "records it)"
        )
        trainer = ", ".join(f"{k}={v!r}" for k, v in sorted(self.trainer_kwargs.items()))
        return f"{length}; Trainer settings: {trainer or 'none recorded (the defaults)'}"

    def run(
        self,
        label: str,
        ckpt_path: Path,
        skipped: tuple[int, int] | None = None,
        remedies_of: Path | None = None,
    ) -> tuple[Replay, dict[int, dict[str, float]]]:
        """Replay from ``ckpt_path``, with the remedy callbacks ``remedies_of`` holds (by
        default the same file's) unless the caller gave callbacks."""
        checkpoint = self.reads(ckpt_path)
        k = int(checkpoint["global_step"])
        remedies = ckpt_path if remedies_of is None else remedies_of
        # the detector's names and the module's columns, each read as it logs them
        names = dict.fromkeys([*self.judge.monitors, *(c.key for c in self.columns)])
        recorder = StepRecorder(tuple(names))
        callbacks = [
            recorder,
            *self.instruments,
            *self.subject.callbacks_for(self.reads(remedies), remedies),
        ]
        callbacks = with_exact_resume(callbacks, self.config.exact_resume)
        if skipped is not None:
            callbacks.append(BatchSkipper(ranges=[skipped]))
        # Past the LR schedule's end too (a run, recover's, may train on at its floor LR),
        # but not past the run's: a OneCycleLR raises there. The run's own max_steps where
        # its record says it (a cosine over trainer.max_steps reads it), stopped early.
        end = self.spike_step + self.config.horizon + 1
        if self.end_step is not None:
            end = min(end, self.end_step)
            callbacks.append(StopAfter(end))
        callbacks.append(StepStart(recorder))
        spec = RunSpec(
            log_root=self.log_root,
            name=label,
            max_steps=end if self.end_step is None else self.end_step,
            callbacks=callbacks,
            progress_bar=False,
            trainer_kwargs={"limit_val_batches": 0, **self.trainer_kwargs},
            resume_step=k,
        )
        if self.config.seed is not None:  # every replay draws what the one before drew
            seed_everything(self.config.seed, verbose=False)
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        module, datamodule = self.subject.model(), self.subject.data()
        start = time.perf_counter()
        trainer = spec.trainer()
        with quiet_branches():
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        wall = time.perf_counter() - start
        known = self.end_step is not None
        self.unlike = settings_unlike_the_run(checkpoint, trainer, module, datamodule, known)
        records = recorder.records
        if self.spike_step not in records:
            raise RuntimeError(
                f"the replay {label} from step {k} never reached spike_step={self.spike_step}"
            )
        if recorder.drew and not has_rng_states(checkpoint):
            self.drew_without_states = True
        replay = self._judge(label, checkpoint, records, skipped)
        replay.wall_s = wall
        return replay, records

    def _judge(
        self,
        label: str,
        checkpoint: dict[str, Any],
        records: dict[int, dict[str, float]],
        skipped: tuple[int, int] | None,
    ) -> Replay:
        """The replay's numbers around the spike, as the judging detector sees them."""
        k = int(checkpoint["global_step"])
        first = self.spike_step - self.config.window_before
        detector = judging_detector(self.judge, checkpoint, first - k)
        continued = detector.state_in(checkpoint) is not None
        flagged: list[int] = []
        at_spike: dict[str, float] = {}
        for step in sorted(records):
            found = detector.check(step, records[step])
            if step >= first and found:
                flagged.append(step)
            if step == self.spike_step:
                at_spike = {spike.metric: spike.rise for spike in found}
        judged = [records[s] for s in sorted(records) if s >= first]
        rises, at_step = self._rises(checkpoint, records, first, detector.window)
        loss = float(records[self.spike_step]["loss"])
        equal = bit_equal(loss, self.original)
        return Replay(
            label=label,
            ckpt_step=k,
            skipped=skipped,
            loss_at_spike=loss,
            max_loss=max(float(r["loss"]) for r in judged),
            extra={
                c.key: max((float(r[c.key]) for r in judged if c.key in r), default=None)
                for c in self.columns
            },
            flagged=flagged,
            bit_equal=None if self.incomparable and not equal else equal,
            last_step=max(records),
            detector_from_checkpoint=continued,
            spike_excess=at_spike,
            rises=rises,
            spike_rises=at_step,
        )

    def _rises(
        self,
        checkpoint: dict[str, Any],
        records: dict[int, dict[str, float]],
        first: int,
        window: int,
    ) -> tuple[dict[str, Rise], dict[str, Rise]]:
        """Each monitored name's highest rise from step ``first`` on, and its rise at the
        spike's step, each over the median of the detector's window before the step: the
        values before the checkpoint are the run's detector's (its state in the file),
        else the run's logged loss."""
        k = int(checkpoint["global_step"])
        recent = (self.judge.detector().state_in(checkpoint) or {}).get("recent") or {}
        logged = [v for step, v in sorted(self.logged.items()) if step < k]
        rises: dict[str, Rise] = {}
        at_spike: dict[str, Rise] = {}
        for name in self.judge.monitors:
            curve = {s: float(r[name]) for s, r in records.items() if name in r}
            prior = (recent.get(name) or (logged if name in LOSS_TAGS else []))[-window:]
            for found, start, end in (
                (rises, first, max(records)),
                (at_spike, self.spike_step, self.spike_step),
            ):
                rise = rise_in(curve, start, end, window, prior)
                if rise is not None:
                    found[name] = rise
        return rises, at_spike


def has_rng_states(checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` holds ExactResume's RNG states (the run's draws)."""
    return STATE_KEY in (checkpoint.get("callbacks") or {})
