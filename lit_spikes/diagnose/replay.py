"""One replay of a spike: a Lightning run resumed from a real checkpoint with the module,
data and remedy callbacks of the original (``subject``), trained past the spike with a
recorder of each step's numbers, then judged by a detector that continues the run's own
where the checkpoint holds it."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks import BatchSkipper, SpikeDetector
from lit_spikes.checkpoints import load_checkpoint
from lit_spikes.detector_config import DetectorConfig
from lit_spikes.diagnose.config import DiagnoseConfig
from lit_spikes.diagnose.subject import Subject
from lit_spikes.diagnose.verdict import Replay, bit_equal
from lit_spikes.loader import positioned
from lit_spikes.training import RunSpec, quiet_branches

LOSS_TAGS = ("train/loss", "loss")
"""The TensorBoard tags a run's loss is looked for under, in order (TinyGPTModule logs
``train/loss``; a module's ``self.log("loss", ...)`` is ``loss``), after the detector's
monitor."""


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
    if not any(run_dir.glob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    held = accumulator.Tags().get("scalars", [])
    for tag in tags:
        if tag in held:
            return {int(e.step): float(e.value) for e in accumulator.Scalars(tag)}
    return {}


def logged_loss(run_dir: Path, step: int, tags: Sequence[str] = LOSS_TAGS) -> float | None:
    """The loss a run logged to TensorBoard at ``step`` (None: not found)."""
    return logged_losses(run_dir, tags).get(step)


class StepRecorder(Callback):
    """Each step's numbers as plain floats, by step: ``loss`` (what ``training_step``
    returned), ``position`` (the data position the step trained on: its step where the
    data is not positioned), the ``names`` the detector watches (``grad_norm`` before any
    clipping; others from ``callback_metrics``), and whatever the module's own record of
    the step holds (TinyGPTModule's ``history``: its ``max_logit``). First among the
    callbacks: it measures the gradients before a remedy drops them."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names = tuple(names)
        self.records: dict[int, dict[str, float]] = {}
        self._step = 0
        self._grad_norm = math.nan

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step, self._grad_norm = trainer.global_step, math.nan

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


def judging_detector(
    config: DetectorConfig, checkpoint: dict[str, Any], steps: int
) -> SpikeDetector:
    """An offline detector whose reference continues the original run's when the
    checkpoint holds a detector of the same settings; otherwise one whose warm-up fits
    in the ``steps`` replayed before the judged range."""
    detector = replace(config, min_step=0).build(0)
    state = detector.state_in(checkpoint)
    if state is not None:
        detector.load_state_dict(copy.deepcopy(state))  # the checkpoint is shared
        detector.spikes.clear()
        detector.num_spikes = 0
        return detector
    return replace(config, min_step=0, warmup=min(config.warmup, max(2, steps))).build(0)


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
    incomparable: str | None = None
    """Why a replay here cannot match the original to the bit (another CPU's kernels,
    other versions, a multi-process run): a differing loss then proves nothing."""

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
        recorder = StepRecorder(self.config.detector.monitor)
        callbacks = [recorder, *self.subject.callbacks_for(self.reads(remedies), remedies)]
        if skipped is not None:
            callbacks.append(BatchSkipper(ranges=[skipped]))
        spec = RunSpec(
            log_root=self.log_root,
            name=label,
            # Past the schedule's end too: a run (recover's) may train on at its floor LR
            max_steps=self.spike_step + self.config.horizon + 1,
            callbacks=callbacks,
            progress_bar=False,
            trainer_kwargs={"limit_val_batches": 0, **self.trainer_kwargs},
            resume_step=k,
        )
        module, datamodule = self.subject.model(), self.subject.data()
        start = time.perf_counter()
        with quiet_branches():
            spec.trainer().fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        wall = time.perf_counter() - start
        records = recorder.records
        if self.spike_step not in records:
            raise RuntimeError(
                f"the replay {label} from step {k} never reached spike_step={self.spike_step}"
            )
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
        detector = judging_detector(self.config.detector, checkpoint, first - k)
        continued = detector.state_in(checkpoint) is not None
        flagged = []
        for step in sorted(records):
            found = detector.check(step, records[step])
            if step >= first and found:
                flagged.append(step)
        judged = [records[s] for s in sorted(records) if s >= first]
        loss = float(records[self.spike_step]["loss"])
        equal = bit_equal(loss, self.original)
        return Replay(
            label=label,
            ckpt_step=k,
            skipped=skipped,
            loss_at_spike=loss,
            max_loss=max(float(r["loss"]) for r in judged),
            max_logit=max(
                (float(r["max_logit"]) for r in judged if "max_logit" in r), default=None
            ),
            flagged=flagged,
            bit_equal=None if self.incomparable and not equal else equal,
            last_step=max(records),
            detector_from_checkpoint=continued,
        )
