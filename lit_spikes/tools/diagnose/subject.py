"""What a replay trains: the run's model, its data and its remedy callbacks, each built
afresh for every replay. Each comes from what the caller gives (a factory, or a class path
with its ``init_args`` as ``lit-spikes fit`` takes it), else from the run's own record:
the ``config.yaml`` that ``lit-spikes fit`` saved beside the checkpoint's run, else the
file itself (``TinyGPTModule`` and ``StepDataModule`` are rebuilt from the settings it
holds, the callbacks from their state keys, as a ``lit-spikes fit`` resume does)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar

from lit_spikes.callbacks import (
    CheckpointRetention,
    FinalCheckpoint,
    PreemptionCheckpoint,
    RollbackRestore,
    RunDirectoryLock,
    SpikeDetector,
)
from lit_spikes.tools.defaults import DEMO_DATA, DEMO_MODEL
from lit_spikes.tools.demo_seam import (
    DataConfig,
    GPTConfig,
    OptimConfig,
    StepDataModule,
    TinyGPTModule,
    data_config_from_checkpoint,
)
from lit_spikes.tools.factories import ClassPath, Instantiate, factory_of
from lit_spikes.tools.resume_callbacks import callbacks_to_resume
from lit_spikes.tools.run_record import read_record, record_path

NOT_REPLAYED = (
    SpikeDetector,  # the replays are judged offline (replay.Judge); a stop would end one
    RollbackRestore,
    ModelCheckpoint,
    CheckpointRetention,
    PreemptionCheckpoint,
    FinalCheckpoint,
    RunDirectoryLock,
    ProgressBar,
)
"""Callbacks of the run that a replay leaves out: they watch it or write its files, and
change none of its numbers (a replay has its own directory, lock and logger)."""

ModelSource = Callable[[], pl.LightningModule] | str | ClassPath | Mapping[str, Any] | type
DataSource = (
    Callable[[], pl.LightningDataModule | None]
    | DataConfig
    | str
    | ClassPath
    | Mapping[str, Any]
    | type
)
CallbacksSource = Sequence[Callback] | Callable[[], Sequence[Callback]]


def run_config(ckpt_path: Path) -> dict[str, Any]:
    """The ``config.yaml`` that ``lit-spikes fit`` saved in the checkpoint's run directory
    (``<run>/checkpoints/<file>``); ``{}`` where there is none (a file copied away, a run
    of another script).

    Raises:
        RecordError: a class path in it that is not what its entry takes (``run_record``).
    """
    return read_record(record_path(ckpt_path))  # its class paths checked: RecordError


def module_from_checkpoint(checkpoint: dict[str, Any]) -> TinyGPTModule:
    """A fresh TinyGPTModule of the checkpoint's settings (the fit then restores its state).

    Raises:
        ValueError: a checkpoint of another module (no TinyGPT settings in it).
    """
    hparams = checkpoint.get("hyper_parameters") or {}
    if not all(key in hparams for key in ("gpt", "optim", "model_seed", "train_seed")):
        raise ValueError(
            "the checkpoint is not of lit-spikes' TinyGPTModule (its hyper_parameters hold "
            f"{sorted(hparams) or 'nothing'}): give its module, model=<factory or class path> "
            "(--model CLASS_PATH), or diagnose a file of a run lit-spikes fit saved a "
            "config.yaml for"
        )
    return TinyGPTModule(
        gpt=GPTConfig(**hparams["gpt"]),
        optim=OptimConfig(**hparams["optim"]),
        model_seed=hparams["model_seed"],
        train_seed=hparams["train_seed"],
        num_threads=hparams["num_threads"],
        # Files written before the option existed were trained without flushing.
        flush_denormal=hparams.get("flush_denormal", False),
    )


def _spec(value: Any, what: str) -> ClassPath | None:
    """``value`` as a class path (None: a factory, or nothing given)."""
    if value is None or (callable(value) and not isinstance(value, type)):
        return None
    return ClassPath.of(value, what)


def _built(path: ClassPath, base: type, what: str) -> Callable[[], Any]:
    """A factory of ``path``: jsonargparse builds it as ``lit-spikes fit`` did (nested
    dataclasses and class paths among its ``init_args`` too)."""

    path.klass(base, what)  # a bad path fails here, before any replay
    if not path.init_args:
        return factory_of(path, base, what)
    return Instantiate(base, path.to_dict())


def _model_path(model: ModelSource | None, saved: dict[str, Any]) -> ClassPath | None:
    """The class path of the run's module: ``model``'s, else its ``config.yaml``'s (None:
    a factory, or neither: TinyGPTModule)."""
    if model is not None:
        return _spec(model, "model")
    return _spec(saved.get("model"), "config.yaml model")


def model_factory(
    model: ModelSource | None, checkpoint: dict[str, Any], saved: dict[str, Any]
) -> Callable[[], pl.LightningModule]:
    """The run's module: ``model`` (a factory or a class path), else the ``model`` of the
    run's ``config.yaml``, else TinyGPTModule; TinyGPTModule from the checkpoint's settings.

    Raises:
        ValueError: a class path that does not import, or is no LightningModule; no module
            given for a checkpoint of another.
    """
    path = _model_path(model, saved)
    if model is not None and path is None:
        return factory_of(model, pl.LightningModule, "model")
    if path is None or path.class_path == DEMO_MODEL:
        module_from_checkpoint(checkpoint)  # its error now, before anything trains
        return lambda: module_from_checkpoint(checkpoint)
    return _built(path, pl.LightningModule, "model")


def data_factory(
    data: DataSource | None, checkpoint: dict[str, Any], saved: dict[str, Any], own_model: bool
) -> Callable[[], pl.LightningDataModule | None]:
    """The run's data: ``data`` (a factory, a class path, or a ``DataConfig`` of
    StepDataModule's), else the ``data`` of the run's ``config.yaml``, else StepDataModule
    for TinyGPTModule (the module's own dataloaders for another); StepDataModule of the
    data config the checkpoint holds unless given a ``DataConfig`` (its class path's
    ``init_args`` are not used: the file holds its settings, as it holds TinyGPT's).

    Raises:
        ValueError: a class path that does not import, or is no LightningDataModule.
    """
    if isinstance(data, DataConfig):
        config = data
        return lambda: StepDataModule(config)
    if data is not None and _spec(data, "data") is None:
        return factory_of(data, pl.LightningDataModule, "data")
    if data is None and "data" in saved and saved["data"] is None:
        return lambda: None  # fit --data null: the module's own dataloaders
    path = _spec(data, "data") or _spec(saved.get("data"), "config.yaml data")
    if path is None and not own_model:
        return lambda: None
    if path is None or path.class_path == DEMO_DATA:  # another config: give a DataConfig
        config = data_config_from_checkpoint(checkpoint)
        return lambda: StepDataModule(config)
    return _built(path, pl.LightningDataModule, "data")


def callbacks_from_checkpoint(
    checkpoint: dict[str, Any], ckpt_path: str | Path | None = None
) -> list[Callback]:
    """The callbacks a replay from ``checkpoint`` trains with, built as a ``lit-spikes
    fit`` resume builds them (``resume_callbacks``): those of the run's ``config.yaml``
    beside ``ckpt_path``, then each the file's own record names (``LRScaler``,
    ``BatchSkipper``, ``SkipStep``, ``ExactResume``, ...), rebuilt from its state key;
    less the ones that only watch the run or write its files (``NOT_REPLAYED``).
    Gradient clipping is a Trainer argument: ``clipping_from_checkpoint``."""
    built, _ = callbacks_to_resume(None if ckpt_path is None else Path(ckpt_path), checkpoint)
    return [cb for cb in built if not isinstance(cb, NOT_REPLAYED)]


@dataclass
class Subject:
    """What each replay builds afresh: its module, data and callbacks."""

    model: Callable[[], pl.LightningModule]
    data: Callable[[], pl.LightningDataModule | None]
    callbacks: CallbacksSource | None
    """The caller's (copied for each replay); None: rebuilt from the replayed file."""

    def callbacks_for(self, checkpoint: dict[str, Any], ckpt_path: Path) -> list[Callback]:
        """The callbacks of a replay whose remedies are those of ``ckpt_path``."""
        if self.callbacks is None:
            return callbacks_from_checkpoint(checkpoint, ckpt_path)
        if callable(self.callbacks):
            return list(self.callbacks())
        return [copy.deepcopy(cb) for cb in self.callbacks]


def subject_of(
    ckpt_path: Path,
    checkpoint: dict[str, Any],
    model: ModelSource | None,
    data: DataSource | None,
    callbacks: CallbacksSource | None,
) -> Subject:
    """The replays' module, data and callbacks, from what the caller gave and the run's
    record (see the module's docstring).

    Raises:
        ValueError: a class path that does not import or is of the wrong kind; no module
            given for a checkpoint of another than TinyGPTModule.
    """
    saved = run_config(ckpt_path)
    path = _model_path(model, saved)
    own_model = path.class_path == DEMO_MODEL if path is not None else model is None
    return Subject(
        model_factory(model, checkpoint, saved),
        data_factory(data, checkpoint, saved, own_model),
        callbacks,
    )
