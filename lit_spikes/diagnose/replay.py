"""One replay of a spike: a Lightning run resumed from a real checkpoint with the remedy
callbacks and the data of the original, trained past the spike, then judged by a
detector that continues the run's own where the checkpoint holds it."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import BatchSkipper, LRScaler, SkipStep, SpikeDetector
from lit_spikes.checkpoints import load_checkpoint
from lit_spikes.data import DataConfig, StepDataModule
from lit_spikes.diagnose.config import DiagnoseConfig
from lit_spikes.diagnose.verdict import Replay, bit_equal
from lit_spikes.model import GPTConfig
from lit_spikes.module import OptimConfig, TinyGPTModule
from lit_spikes.recover.config import DetectorConfig
from lit_spikes.training import RunSpec, quiet_branches


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


def callbacks_from_checkpoint(checkpoint: dict[str, Any]) -> list[Callback]:
    """The remedy callbacks whose state a checkpoint holds (``LRScaler``, ``BatchSkipper``,
    ``SkipStep``), rebuilt from it so a replay trains as the original run did. Gradient
    clipping is a Trainer argument: ``clipping_from_checkpoint``."""
    rebuilt: list[Callback] = []
    # Copies: the checkpoint is shared by the diagnosis's replays (CheckpointReads).
    for key, state in copy.deepcopy(checkpoint.get("callbacks", {})).items():
        if key.startswith("LRScaler{"):
            rebuilt.append(LRScaler(state["factor"], state["start_step"], state["end_step"]))
        elif key.startswith("BatchSkipper{"):
            rebuilt.append(BatchSkipper(positions=state["skip"]))
        elif key.startswith("SkipStep{") and "window" in state:
            rebuilt.append(
                SkipStep(
                    monitor=state["monitor"],
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


def module_from_checkpoint(checkpoint: dict[str, Any]) -> TinyGPTModule:
    """A fresh module of the checkpoint's settings (the fit then restores its state)."""
    hparams = checkpoint["hyper_parameters"]
    return TinyGPTModule(
        gpt=GPTConfig(**hparams["gpt"]),
        optim=OptimConfig(**hparams["optim"]),
        model_seed=hparams["model_seed"],
        train_seed=hparams["train_seed"],
        num_threads=hparams["num_threads"],
        # Files written before the option existed were trained without flushing.
        flush_denormal=hparams.get("flush_denormal", False),
    )


@dataclass
class Replayer:
    """Replays of one spike, each from a checkpoint, with the run's data, callbacks and
    Trainer arguments; ``reads`` loads each file once."""

    spike_step: int
    data: DataConfig
    callbacks: Sequence[Callback] | None
    trainer_kwargs: dict[str, Any]
    original: float | None
    config: DiagnoseConfig
    log_root: Path
    reads: CheckpointReads
    incomparable: str | None = None
    """Why a replay here cannot match the original to the bit (another CPU's kernels,
    other versions, a multi-process run): a differing loss then proves nothing."""

    def _callbacks(self, checkpoint: dict[str, Any], remedies_of: Path | None) -> list[Callback]:
        if self.callbacks is not None:
            return [copy.deepcopy(cb) for cb in self.callbacks]
        return callbacks_from_checkpoint(
            checkpoint if remedies_of is None else self.reads(remedies_of)
        )

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
        module = module_from_checkpoint(checkpoint)
        k = int(checkpoint["global_step"])
        callbacks = self._callbacks(checkpoint, remedies_of)
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
        start = time.perf_counter()
        with quiet_branches():
            spec.trainer().fit(module, datamodule=StepDataModule(self.data), ckpt_path=ckpt_path)
        wall = time.perf_counter() - start
        records = {int(r["step"]): r for r in module.history}
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
            max_logit=max(float(r["max_logit"]) for r in judged),
            flagged=flagged,
            bit_equal=None if self.incomparable and not equal else equal,
            last_step=max(records),
            detector_from_checkpoint=continued,
        )
