"""What one run of a resume check records: a cheap digest per step, the whole state twice.

At every global step the ``Recorder`` keeps a digest of the batch, of each RNG stream, the
learning rates and a digest of the step's output; at the resume step (before it runs) and at
the end of training it captures the whole state: parameters, optimizer and scheduler state,
loop counters, each callback's state, the precision plugin's, the module's plain attributes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, ProgressBar, Timer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from typing_extensions import override

from lit_spikes.randomness import KINDS, generator_kind, generator_state, module_generators

Snapshot = dict[str, dict[str, dict[str, Any]]]
"""component -> owner (what holds the state) -> item -> value (a CPU tensor or a primitive)."""

PARAMETERS = "parameters"
OPTIMIZER = "optimizer state"
SCHEDULER = "LR scheduler"
RNG = "RNG"
DATA = "data"
LOOPS = "loop counters"
CALLBACKS = "callbacks"
PRECISION = "precision and grad scaler"
MODULE = "module state"

_LONG_REPR = 200  # a plain value with a longer repr is kept as its digest


@dataclass
class Record:
    """One run's record; plain data, so it crosses processes with ``torch.save``."""

    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    at_resume: Snapshot | None = None
    final: Snapshot | None = None
    final_step: int = -1
    hints: dict[str, str] = field(default_factory=dict)
    """owner -> the likely fix when that owner's state differs (set where it is known)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Record:
        return cls(**data)


def digest(value: Any) -> str:
    """A short hash of a batch or output: every tensor's dtype, shape and bytes, in order."""
    hasher = hashlib.blake2b(digest_size=12)
    for leaf in _leaves(value):
        if isinstance(leaf, torch.Tensor):
            flat = leaf.detach().cpu().contiguous().reshape(-1)
            hasher.update(f"{flat.dtype}{tuple(leaf.shape)}".encode())
            hasher.update(flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(leaf, np.ndarray):
            hasher.update(f"{leaf.dtype}{leaf.shape}".encode())
            hasher.update(np.ascontiguousarray(leaf).tobytes())
        else:
            hasher.update(repr(leaf).encode())
    return hasher.hexdigest()


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for key in value:
            yield key
            yield from _leaves(value[key])
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _bytes_digest(*parts: Any) -> str:
    hasher = hashlib.blake2b(digest_size=12)
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def rng_digests() -> dict[str, str]:
    """A digest of each RNG stream a step may draw from (CUDA only once it is in use).
    This runs every step: each stream is hashed as one buffer (about 40 us in all)."""
    numpy_state: Any = np.random.get_state(legacy=False)
    mt = numpy_state["state"]
    numpy_rest = repr((mt["pos"], numpy_state["has_gauss"], numpy_state["gauss"])).encode()
    version, internal, gauss = random.getstate()
    # Python's hash of a tuple of ints is the same in every process (PYTHONHASHSEED salts
    # str and bytes; None hashes by address before 3.12, so gauss goes in by its repr).
    python = hash((version, internal)) & (2**64 - 1)
    streams = {
        "rng.torch CPU": _bytes_digest(torch.get_rng_state().numpy()),
        "rng.Python random": f"{python:016x} {gauss!r}",
        "rng.NumPy": _bytes_digest(mt["key"], numpy_rest),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        streams["rng.torch CUDA"] = digest(torch.cuda.get_rng_state_all())
    return streams


def _plain(value: Any) -> Any:
    """A comparable copy: CPU tensors cloned, primitives kept, anything else by its repr."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    text = repr(value)
    return text if len(text) <= _LONG_REPR else f"<{type(value).__name__} {digest(text)}>"


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state_dict as ``{"a.b[0]": leaf}`` with comparable leaves; a generator
    held in it left out (its stream is compared as an RNG, by its path)."""
    if isinstance(state, KINDS):
        return {}
    if isinstance(state, Mapping):
        items: dict[str, Any] = {}
        for key, value in state.items():
            items.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return items
    if isinstance(state, list | tuple) and any(
        isinstance(v, (Mapping, list, tuple, torch.Tensor, *KINDS)) for v in state
    ):
        items = {}
        for index, value in enumerate(state):
            items.update(flatten(value, f"{prefix}[{index}]"))
        return items
    return {prefix: _plain(list(state) if isinstance(state, tuple) else state)}


def _overrides(obj: object, name: str, base: type) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name)


def plain_attributes(obj: object, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """An object's public instance attributes that hold data (not modules, optimizers,
    callables or other objects): the state a checkpoint misses if nothing saves it."""
    kept = {}
    for name, value in vars(obj).items():
        if name.startswith("_") or name in skip:
            continue
        if isinstance(value, torch.Tensor | bool | int | float | str | list | tuple | dict):
            kept[name] = value
    return flatten(kept)


def _bare_module_attributes() -> frozenset[str]:
    return frozenset(vars(pl.LightningModule()))


_BARE_MODULE = _bare_module_attributes()


def _parameter_names(module: pl.LightningModule) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _optimizer_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    names = _parameter_names(module)
    owners: dict[str, Any] = {}
    for i, optimizer in enumerate(trainer.optimizers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = optimizer.state_dict()
        items: dict[str, Any] = {}
        for index, per_param in state["state"].items():
            name = names.get(id(params[index]), f"param {index}")
            items.update(flatten(per_param, f"state of `{name}`"))
        for g, group in enumerate(state["param_groups"]):
            items.update(flatten({k: v for k, v in group.items() if k != "params"}, f"group {g}"))
        owners[f"optimizer {i} ({type(optimizer).__name__})"] = items
    return owners


def _schedulers(trainer: pl.Trainer, module: pl.LightningModule, hints: dict[str, str]) -> Any:
    owners: dict[str, Any] = {}
    known = []
    for i, config in enumerate(trainer.lr_scheduler_configs):
        known.append(config.scheduler)
        owner = f"scheduler {i} ({type(config.scheduler).__name__})"
        owners[owner] = flatten(config.scheduler.state_dict())
        if config.reduce_on_plateau:
            # Returned from configure_optimizers as asked, and still not resumed exactly
            # by Lightning alone: it steps after the checkpoint, a resume skips that step.
            hints[owner] = hints["learning rate"] = _plateau_fix(config.interval, config.monitor)
    for name, value in vars(module).items():
        held = isinstance(value, LRScheduler | ReduceLROnPlateau)
        if held and not any(value is k for k in known):
            owner = f"`self.{name}` ({type(value).__name__})"
            owners[owner] = flatten(value.state_dict())
            hints[owner] = (
                f"return the scheduler `self.{name}` from configure_optimizers "
                "({'optimizer': ..., 'lr_scheduler': {'scheduler': ..., 'interval': 'step'}}) "
                "instead of stepping it by hand: Lightning saves and restores only the "
                "schedulers configure_optimizers returns"
            )
    return owners


def _plateau_fix(interval: str, monitor: str | None) -> str:
    return (
        f"ReduceLROnPlateau(interval={interval!r}, monitor={monitor!r}) is not resumed exactly "
        f"by Lightning: it steps on {monitor!r} after the checkpoint of its {interval} is "
        "written and a resume skips that step (an epoch one: the first epoch's end after "
        "it too), with no logged metric saved; add ExactResume (from lit_spikes.callbacks "
        "import ExactResume), which replays those updates on the metrics its file holds. "
        "A metric aggregated over the epoch (self.log(..., on_epoch=True)) is in no file: "
        "monitor a validation metric or a per-step one"
    )


_NOT_TRAINING_STATE = (Checkpoint, ProgressBar, Timer)
"""Callbacks whose state is about files, display or wall time, not about training: a
checkpoint callback's paths differ between the checker's runs by design."""


def _callbacks(
    trainer: pl.Trainer, own: tuple[Callback, ...], hints: dict[str, str], skip: frozenset[str]
) -> Any:
    owners: dict[str, Any] = {}
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if any(callback is c for c in own) or isinstance(callback, _NOT_TRAINING_STATE):
            continue
        name = type(callback).__name__
        if _overrides(callback, "state_dict", Callback):
            owner = f"{name} (state_dict)"
            owners[owner] = flatten(callback.state_dict())
            hints[owner] = (
                f"the callback {name}'s state_dict/load_state_dict does not restore all of "
                "its state: make load_state_dict restore what state_dict saves, and save "
                "everything that changes during training"
            )
        else:
            owner = f"{name} (no state_dict)"
            owners[owner] = plain_attributes(callback, skip)
            hints[owner] = (
                f"the callback {name} keeps state but has no state_dict: add "
                "state_dict()/load_state_dict() to it so Lightning saves that state in the "
                "checkpoint"
            )
    return owners


def _loop_counters(trainer: pl.Trainer) -> dict[str, Any]:
    epoch_loop = trainer.fit_loop.epoch_loop
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "batch_idx": epoch_loop.batch_idx,
        **flatten(epoch_loop.batch_progress.total.state_dict(), "batches"),
        **flatten(epoch_loop.automatic_optimization.optim_progress.state_dict(), "optimizer"),
    }


def snapshot(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    own: tuple[Callback, ...],
    hints: Any,
    skip: frozenset[str] = frozenset(),
) -> Snapshot:
    """The whole training state, as comparable leaves (see ``Snapshot``); ``skip``: plain
    attributes (of the module and of callbacks without a state_dict) to leave out."""
    attributes = plain_attributes(module, skip=_BARE_MODULE | skip)
    hints["module attributes"] = (
        "the module keeps state in plain attributes the checkpoint does not hold: register "
        "it as a buffer (register_buffer) or save it in on_save_checkpoint and restore it in "
        "on_load_checkpoint (an attribute that is no training state, a log say, can be "
        "named in ignore_attributes)"
    )
    return {
        PARAMETERS: {"module.state_dict()": flatten(module.state_dict())},
        OPTIMIZER: _optimizer_state(trainer, module),
        SCHEDULER: _schedulers(trainer, module, hints),
        LOOPS: {"Trainer": _loop_counters(trainer)},
        CALLBACKS: _callbacks(trainer, own, hints, skip),
        PRECISION: {
            type(trainer.precision_plugin).__name__: flatten(trainer.precision_plugin.state_dict())
        },
        MODULE: {"module attributes": attributes},
    }


class Recorder(Callback):
    """Records one run for the resume check (``Record``); ``capture_at``: the global step
    whose entering state is captured whole (None: only the final state); ``ignore``: the
    check's own callbacks; ``ignore_attributes``: plain attributes that are no training
    state (see ``snapshot``)."""

    def __init__(
        self,
        capture_at: int | None,
        ignore: tuple[Callback, ...] = (),
        ignore_attributes: tuple[str, ...] = (),
    ) -> None:
        self.record = Record()
        self.capture_at = capture_at
        self._ignore = ignore
        self._skip = frozenset(ignore_attributes)
        self._step = -1

    def _own(self) -> tuple[Callback, ...]:
        return (self, *self._ignore)

    def _fields(self, step: int) -> dict[str, Any]:
        return self.record.steps.setdefault(step, {})

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning puts the module's configure_callbacks after the Trainer's: the recorder
        # goes after every callback but the checkpoints (Lightning runs those last), so it
        # records what a step starts from once ExactResume and the others have set it up,
        # and reads no callback's state before that callback's own hook ran.
        callbacks = [c for c in trainer.callbacks if c is not self]  # type: ignore[attr-defined]
        at = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), None)
        callbacks.insert(len(callbacks) if at is None else at, self)
        trainer.callbacks = callbacks  # type: ignore[attr-defined]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = step = trainer.global_step
        if step == self.capture_at and self.record.at_resume is None:
            hints = self.record.hints
            self.record.at_resume = snapshot(trainer, pl_module, self._own(), hints, self._skip)
        fields = self._fields(step)
        # With gradient accumulation several batches make one step: chain their digests.
        fields["data"] = digest([fields.get("data", ""), batch])
        fields["loop.epoch"] = trainer.current_epoch
        fields["loop.batch_idx"] = batch_idx
        fields.update(rng_digests())
        for path, generator in module_generators(pl_module).items():  # named, not "output"
            name = f"rng.{generator_kind(generator)} '{path}' of the module"
            fields[name] = digest(generator_state(generator))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        index = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), "?")
        fields = self._fields(trainer.global_step)
        for g, group in enumerate(optimizer.param_groups):
            fields[f"lr.optimizer {index} group {g}"] = float(group["lr"])

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        fields = self._fields(self._step)
        fields["output"] = digest([fields.get("output", ""), outputs])

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hints = self.record.hints
        self.record.final = snapshot(trainer, pl_module, self._own(), hints, self._skip)
        self.record.final_step = trainer.global_step
