"""What a replay trains: the run's model, its data and its remedy callbacks, each built
afresh for every replay. Each comes from what the caller gives (a factory, or a class path
with its ``init_args`` as ``lit-spikes fit`` takes it), else from the run's own record:
the ``config.yaml`` that ``lit-spikes fit`` saved beside the checkpoint's run, else the
file itself: a class given without ``init_args`` (or the default, the demo's, by class
path) as its ``load_from_checkpoint`` builds it (Lightning's, from the file's
hyperparameters, or the class's own), the callbacks from their state keys, as a
``lit-spikes fit`` resume does."""

from __future__ import annotations

import copy
import warnings
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
    Callable[[], pl.LightningDataModule | None] | str | ClassPath | Mapping[str, Any] | type
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


def from_file(path: ClassPath, base: type, ckpt_path: Path, **kwargs: Any) -> Callable[[], Any]:
    """A factory of the class at ``path`` as ``Class.load_from_checkpoint(ckpt_path,
    **kwargs)`` builds it: Lightning's, from the file's hyperparameters (a module's
    ``hyper_parameters``, a data module's ``datamodule_hyper_parameters`` and state), or
    the class's own where it overrides it (the demo's data: the config its state holds).
    Built once here, so its error comes before any replay, and copied for each replay
    (the file read once more, not once a replay; the fit restores its state anyway).

    Raises:
        ValueError: a class the file does not build (another module's checkpoint).
    """
    klass = path.klass(base, path.class_path)
    try:
        return loaded_copies(klass, ckpt_path, **kwargs)
    except (TypeError, KeyError, ValueError, RuntimeError) as error:
        said = str(error).splitlines()[0] if str(error) else type(error).__name__
        what = "model" if issubclass(klass, pl.LightningModule) else "data"
        raise ValueError(
            f"{ckpt_path} does not build {klass.__name__} (its load_from_checkpoint: "
            f"{said}): give its {what}, {what}=<factory or class path> (--{what} "
            "CLASS_PATH), or diagnose a file of a run lit-spikes fit saved a config.yaml for"
        ) from None


def loaded_copies(klass: Any, ckpt_path: Path, **kwargs: Any) -> Callable[[], Any]:
    """A factory of copies of ``klass.load_from_checkpoint(ckpt_path, **kwargs)``, loaded
    once. Its warnings (a data module's "other data than the run's") are left to each
    replay's restore, which says them again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = klass.load_from_checkpoint(ckpt_path, map_location="cpu", **kwargs)
    return lambda: copy.deepcopy(built)


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
    a factory, or neither: the demo's)."""
    if model is not None:
        return _spec(model, "model")
    return _spec(saved.get("model"), "config.yaml model")


def model_factory(
    model: ModelSource | None, ckpt_path: Path, saved: dict[str, Any]
) -> Callable[[], pl.LightningModule]:
    """The run's module: ``model`` (a factory or a class path), else the ``model`` of the
    run's ``config.yaml``, else the demo's (``DEMO_MODEL``) as its ``load_from_checkpoint``
    builds it (``from_file``). A class path is built as ``lit-spikes fit`` builds it (no
    ``init_args``: the class's defaults).

    Raises:
        ValueError: a class path that does not import, or is no LightningModule; a file
            the class does not build (no module given for another's checkpoint).
    """
    path = _model_path(model, saved)
    if model is not None and path is None:
        return factory_of(model, pl.LightningModule, "model")
    if path is None:
        return from_file(ClassPath(DEMO_MODEL), pl.LightningModule, ckpt_path)
    return _built(path, pl.LightningModule, "model")


def data_factory(
    data: DataSource | None, ckpt_path: Path, saved: dict[str, Any], own_model: bool
) -> Callable[[], pl.LightningDataModule | None]:
    """The run's data: ``data`` (a factory or a class path), else the ``data`` of the
    run's ``config.yaml``, else the demo's (``DEMO_DATA``) for the demo's module (the
    module's own dataloaders for another); a class whose ``load_from_checkpoint`` is its
    own (its file holds its settings: the demo's) as that builds it (``from_file``), its
    ``init_args`` unused; another as ``lit-spikes fit`` builds it.

    Raises:
        ValueError: a class path that does not import, or is no LightningDataModule.
    """
    if data is not None and _spec(data, "data") is None:
        return factory_of(data, pl.LightningDataModule, "data")
    if data is None and "data" in saved and saved["data"] is None:
        return lambda: None  # fit --data null: the module's own dataloaders
    path = _spec(data, "data") or _spec(saved.get("data"), "config.yaml data")
    if path is None and not own_model:
        return lambda: None
    path = path or ClassPath(DEMO_DATA)
    if _own_loading(path.klass(pl.LightningDataModule, "data")):
        return from_file(path, pl.LightningDataModule, ckpt_path)
    return _built(path, pl.LightningDataModule, "data")


def _own_loading(klass: type) -> bool:
    """Whether ``klass`` overrides Lightning's ``load_from_checkpoint``."""
    own = getattr(klass, "load_from_checkpoint", None)
    lightning = pl.LightningDataModule.load_from_checkpoint
    return getattr(own, "__func__", own) is not getattr(lightning, "__func__", lightning)


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
            given for a checkpoint the demo's module does not load.
    """
    saved = run_config(ckpt_path)
    path = _model_path(model, saved)
    own_model = path.class_path == DEMO_MODEL if path is not None else model is None
    return Subject(
        model_factory(model, ckpt_path, saved),
        data_factory(data, ckpt_path, saved, own_model),
        callbacks,
    )
