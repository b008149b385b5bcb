"""One branch of the loop as a Lightning run: the module, data and callbacks it trains
with, where it (re)starts, and the counts its records add up to when it ends."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import SpikeDetector
from lit_spikes.checkpoints import newest_valid_checkpoint
from lit_spikes.data import StepDataModule
from lit_spikes.module import TinyGPTModule
from lit_spikes.recover.config import RecoverConfig
from lit_spikes.recover.gate import skip_stepped
from lit_spikes.recover.history import HISTORY_NAME, read_history
from lit_spikes.recover.ledger import BranchRecord, dedupe_spikes
from lit_spikes.recover.remedies import remedy_callbacks
from lit_spikes.training import CHECKPOINT_DIRNAME, RunSpec


def branch_run(
    config: RecoverConfig,
    record: BranchRecord,
    callbacks: Sequence[Callback],
    resume_step: int | None,
    progress_bar: bool,
) -> tuple[TinyGPTModule, StepDataModule, RunSpec]:
    """The module, data module and run of ``record``: the loop's ``callbacks`` (detector
    first) with its lineage's remedies after the detector, its model changes, and the
    Trainer arguments of both."""
    remedies, trainer_kwargs = remedy_callbacks(record.remedies)
    gpt = replace(config.gpt, **record.gpt_changes)
    module = TinyGPTModule(gpt=gpt, optim=config.optim, model_seed=config.model_seed)
    detector, *rest = callbacks
    spec = RunSpec(
        log_root=config.log_root,
        name=record.name,
        max_steps=config.steps,
        checkpoint_every=config.checkpoint_every,
        val_every=config.val_every,
        callbacks=[detector, *remedies, *rest],
        progress_bar=progress_bar,
        trainer_kwargs={**config.trainer_kwargs(), **trainer_kwargs},
        resume_step=resume_step,
    )
    return module, StepDataModule(config.data), spec


def own_newest_checkpoint(
    run_dir: Path, record: BranchRecord, steps: int
) -> tuple[str, int] | None:
    """The newest valid checkpoint an interrupted branch wrote itself, after its start
    (None: there is none; it starts over)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step, path, _ = newest_valid_checkpoint(
                run_dir / CHECKPOINT_DIRNAME, steps - 1, refuse_nonfinite=False
            )
    except FileNotFoundError:
        return None
    if path is not None and step > record.start_step:
        return str(path), step
    return None


def summarize(
    record: BranchRecord,
    root: Path,
    detector: SpikeDetector,
    callbacks: Sequence[Callback],
    datamodule: StepDataModule,
) -> None:
    """The branch's counts, from its own records, its callbacks' states and its data
    module's skip set, which hold every session's steps (a resumed run restored them
    from its checkpoint)."""
    records = read_history(root / record.name / HISTORY_NAME)
    steps = [r for r in records if "step" in r]
    vals = [r for r in records if "val_step" in r]
    positions = {int(r["step"]): int(r["position"]) for r in steps}
    record.steps_trained = len(steps)
    record.end_step = int(steps[-1]["step"]) if steps else None
    if steps:
        first, last = steps[0], steps[-1]
        # The offset before the branch's first step: a window the branch skips from
        # that very step on (its start clamped to the checkpoint's position) is already
        # in the first step's position.
        before = int(first["step"]) - 1
        offset = datamodule.position_of_step(before) - before if before >= 0 else 0
        record.batches_skipped = int(last["position"] - last["step"]) - offset
        record.max_logit = max(float(r["max_logit"]) for r in steps)
    record.val_bpc = float(vals[-1]["val_bpc"]) if vals else None
    record.skip_stepped = [s for s in skip_stepped(callbacks) if s >= record.start_step]
    own = [
        {**s, "position": positions.get(int(s["step"]))}
        for s in detector.spikes
        if int(s["step"]) >= record.start_step
    ]
    dropped = set(record.skip_stepped)
    record.absorbed = dedupe_spikes([s for s in own if int(s["step"]) in dropped])
    if record.gate == "log":
        record.unrecovered = dedupe_spikes([s for s in own if int(s["step"]) not in dropped])
