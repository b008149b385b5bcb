"""One branch of the loop as a Lightning run: the module, data and callbacks it trains
with, where it (re)starts, and the counts its records add up to when it ends."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import SpikeDetector, TrainingCurves
from lit_spikes.checkpoints import newest_valid_checkpoint
from lit_spikes.loader import PositionedData
from lit_spikes.shared.training import CHECKPOINT_DIRNAME, RunSpec
from lit_spikes.tool_facts import ToolFacts, facts_of
from lit_spikes.tools.factories import ClassPath, Factory, Instantiate, factory_of
from lit_spikes.tools.recover.config import FACTORY, RecoverConfig
from lit_spikes.tools.recover.gate import skip_stepped
from lit_spikes.tools.recover.history import HISTORY_NAME, read_history
from lit_spikes.tools.recover.ledger import BranchRecord, Intervention, dedupe_spikes
from lit_spikes.tools.recover.remedies import SpikeContext, remedy_callbacks
from lit_spikes.tools.resume_callbacks import with_exact_resume


@dataclass(frozen=True)
class Builders:
    """What every branch trains: the model and the data, each a factory called once per
    branch (a new object built the same way each time)."""

    model: Factory
    data: Factory
    config: RecoverConfig

    @classmethod
    def of(cls, config: RecoverConfig, model: Any = None, data: Any = None) -> Builders:
        """The config's model and data, or the factories (or class paths) given instead.

        Raises:
            ValueError: a class path that cannot be imported or is not a LightningModule
                (a LightningDataModule), or a config that names a factory none is given for.
        """
        return cls(
            _factory(model, config.model, pl.LightningModule, "model"),
            _factory(data, config.data, pl.LightningDataModule, "data"),
            config,
        )

    def module(self, record: BranchRecord) -> pl.LightningModule:
        """The branch's module: the config's, with a variant's ``model_changes`` merged
        over its ``init_args`` (a comparison row; ``ToolFacts.variants``)."""
        if not record.model_changes:
            built: pl.LightningModule = self.model()
            return built
        init_args = merged(self.config.model.get("init_args", {}), record.model_changes)
        path = ClassPath(self.config.model["class_path"], init_args)
        changed: pl.LightningModule = path.build(pl.LightningModule, "model")
        return changed

    def facts(self) -> ToolFacts:
        """What the module states of its run, read from one built for it."""
        return facts_of(self.model())

    def datamodule(self) -> pl.LightningDataModule:
        built: pl.LightningDataModule = self.data()
        return built


def merged(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` over it, a mapping into a mapping key by key."""
    result = dict(base)
    for key, value in changes.items():
        inner = result.get(key)
        if isinstance(value, Mapping) and isinstance(inner, Mapping):
            result[key] = merged(inner, value)
        else:
            result[key] = value
    return result


def _factory(given: Any, configured: dict[str, Any], base: type, what: str) -> Factory:
    if given is not None:
        return factory_of(given, base, what)
    if FACTORY in configured:
        raise ValueError(
            f"RecoverConfig.{what} names the factory {configured[FACTORY]!r}: give it again "
            f"({what}=...) to continue this run"
        )
    # Built as the command line builds it (jsonargparse), so an argument typed as a
    # dataclass gets one, not the dict the config holds

    factory_of(configured, base, what)  # a bad class path fails here, named
    built: Factory = Instantiate(base, configured)
    return built


def branch_run(
    builders: Builders,
    record: BranchRecord,
    callbacks: Sequence[Callback],
    resume_step: int | None,
    progress_bar: bool,
) -> tuple[pl.LightningModule, pl.LightningDataModule, RunSpec]:
    """The module, data module and run of ``record``: the loop's ``callbacks`` (detector
    first) with its lineage's remedies after the detector, ``TrainingCurves`` (``lr`` and
    ``grad_norm``, as ``fit`` logs them) and ``ExactResume`` unless the
    config opts out (a module's own replaces it), its model changes, and the Trainer
    arguments of the loop's processes; the module and data built after the config's
    seed."""
    config = builders.config
    remedies = remedy_callbacks(record.remedies)
    detector, *rest = callbacks
    spec = RunSpec(
        log_root=config.log_root,
        name=record.name,
        max_steps=config.steps,
        checkpoint_every=config.checkpoint_every,
        val_every=config.val_every,
        callbacks=with_exact_resume(
            [detector, *remedies, *rest, TrainingCurves()], config.exact_resume
        ),
        progress_bar=progress_bar,
        trainer_kwargs=config.trainer_kwargs(),
        resume_step=resume_step,
    )
    if config.seed is not None:  # every session builds and trains a branch alike
        seed_everything(config.seed, verbose=False)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    return builders.module(record), builders.datamodule(), spec


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
    data: PositionedData | None,
) -> None:
    """The branch's counts, from its own records, its callbacks' states and its data
    module's skip set, which hold every session's steps (a resumed run restored them
    from its checkpoint)."""
    records = read_history(root / record.name / HISTORY_NAME)
    steps = [r for r in records if "step" in r]
    positions = {int(r["step"]): int(r["position"]) for r in steps}
    record.steps_trained = len(steps)
    record.end_step = int(steps[-1]["step"]) if steps else None
    if steps:
        first, last = steps[0], steps[-1]
        # The offset before the branch's first step: a window the branch skips from
        # that very step on (its start clamped to the checkpoint's position) is already
        # in the first step's position.
        before = int(first["step"]) - 1
        offset = 0
        if before >= 0 and data is not None:
            offset = data.position_of_step(before) - before
        record.batches_skipped = int(last["position"] - last["step"]) - offset
    record.skip_stepped = [s for s in skip_stepped(callbacks) if s >= record.start_step]
    record.charts = detector.charts or record.charts  # a branch resumed past its spikes too
    own = [
        s.replace(position=positions.get(s.step))
        for s in detector.spikes
        if s.step >= record.start_step
    ]
    dropped = set(record.skip_stepped)
    record.absorbed = dedupe_spikes([s for s in own if s.step in dropped])
    if record.gate == "log":
        record.unrecovered = dedupe_spikes([s for s in own if s.step not in dropped])


def spike_context(
    intervention: Intervention, spiked: BranchRecord, records: Sequence[dict[str, Any]]
) -> SpikeContext:
    """What a rung learns of the spike: ``records`` are the spiked lineage's."""
    k = intervention.ckpt_step
    positions = {r["step"]: r for r in records if "step" in r}
    losses = [
        float(r["loss"])
        for r in records
        if "step" in r and r["step"] < k and math.isfinite(r["loss"])
    ]
    return SpikeContext(
        spike=intervention.spike,
        ckpt_step=k,
        ckpt_position=int(positions[k]["position"]) if k in positions else k,
        losses=losses,
        inherited=list(spiked.remedies),
    )


def _named(value: Any, what: str) -> tuple[Any, Any]:
    """``(what the config records, the factory or None)`` of a given model or data."""
    if callable(value) and not isinstance(value, type):
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        module = getattr(value, "__module__", None) or type(value).__module__
        return {FACTORY: f"{module}.{name}"}, value
    return ClassPath.of(value, what).to_dict(), None


def with_given(config: RecoverConfig, model: Any, data: Any) -> tuple[RecoverConfig, Any, Any]:
    """The config naming the model and data given (a class path replaces the config's; a
    factory is recorded by its name) and the factories to call (None: the config's)."""
    changes: dict[str, Any] = {}
    factories: list[Any] = []
    for key, value in (("model", model), ("data", data)):
        factory = None
        if value is not None:
            changes[key], factory = _named(value, key)
        factories.append(factory)
    return replace(config, **changes), factories[0], factories[1]
