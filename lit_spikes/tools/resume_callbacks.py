"""A fit resume's callbacks from the checkpoint itself: each stateful callback of the run
left its state in ``checkpoint["callbacks"]`` under its state key, which names its class
and its settings (``LRScaler{'factor': 0.5, 'start_step': 5, 'end_step': None}``). A
checkpoint copied or archived away from its run directory keeps that record, where the
run's ``config.yaml`` stays behind.

Only the project's own callbacks (``lit_spikes.callbacks``) are rebuilt, and only where
the rebuilt one has that very state key again: anything else is named, not guessed.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_spikes.tools.run_record import read_record, record_path

CALLBACKS_MODULE = "lit_spikes.callbacks"

CLI_OWN = frozenset(
    {"ModelCheckpoint", "PreemptionCheckpoint", "FinalCheckpoint", "RunDirectoryLock"}
    | {"ValidateAtEnd", "StepProgressBar", "RichProgressBar", "TQDMProgressBar"}
    | {"TrainingCurves"}
)
"""Callbacks ``lit-spikes fit`` adds itself (by class name): the resumed run has its own
ones, with this run's settings (``--checkpoint_every``), so none of them is missing."""

# A key that names a digest of the settings (BatchSkipper's skip set) is rebuilt from the
# state it saved, which holds the whole set.
_FROM_STATE: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "BatchSkipper": lambda state: {"positions": [int(p) for p in state["skip"]]},
}
# Settings a key leaves out (they do not change what the callback judges) that its state
# keeps, taken from it on top of the key's.
_ALSO_FROM_STATE: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "SpikeDetector": lambda state: (
        {"action": state["action"]} if state.get("action") in ("log", "stop") else {}
    ),
}
# Settings a key leaves out that the state restores anyway: not worth a word.
_STATE_HOLDS = {"SkipStep": {"initial"}, "BatchSkipper": {"ranges"}}


@dataclass
class RecordedCallbacks:
    """What a checkpoint's record of callbacks gives a resume."""

    rebuilt: list[dict[str, Any]] = field(default_factory=list)
    """``{"class_path", "init_args"}`` entries, as ``--trainer.callbacks`` takes them."""
    described: list[str] = field(default_factory=list)
    """Each rebuilt one as a call (``LRScaler(factor=0.5, ...)``), with the settings its
    key does not record (their defaults taken), for the one line that says so."""
    keys: list[str] = field(default_factory=list)
    """The state key of each rebuilt one."""
    unrebuilt: list[str] = field(default_factory=list)
    """The state keys no callback of ``lit_spikes.callbacks`` rebuilds exactly."""


def parse_state_key(key: str) -> tuple[str, dict[str, Any]] | None:
    """``(class name, settings)`` of a key made by ``make_state_key`` (``Name{'a': 1}``,
    the form of Lightning's own callbacks too); None for any other (a class's own key)."""
    if not isinstance(key, str) or "{" not in key or not key.endswith("}"):
        return None
    name, _, rest = key.partition("{")
    try:
        settings = ast.literal_eval("{" + rest)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not name.isidentifier() or not isinstance(settings, dict):
        return None
    if not all(isinstance(k, str) for k in settings):
        return None
    return name, settings


def keys_of(callback: Any) -> set[str]:
    """The keys a callback takes its state from: its own, and the older spellings it
    adopts (``SpikeDetector.older_state_keys``)."""
    return {str(callback.state_key), *map(str, getattr(callback, "older_state_keys", ()))}


def _plain(value: Any) -> Any:
    # A tuple (SpikeDetector's monitor) as the list a config file would give.
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def rebuild(key: str, state: Any) -> tuple[Any, dict[str, Any], list[str]] | None:
    """``(callback, init_args, settings not recorded)`` for a key of one of
    ``lit_spikes.callbacks``, rebuilt so that its state key is ``key`` again (or one it
    adopts); None where that cannot be done."""
    parsed = parse_state_key(key)
    if parsed is None:
        return None
    name, settings = parsed
    module = importlib.import_module(CALLBACKS_MODULE)
    klass = getattr(module, name, None)
    if not inspect.isclass(klass) or name not in getattr(module, "__all__", ()):
        return None
    from_state = _FROM_STATE.get(name)
    try:
        init_args = from_state(state) if from_state else {k: _plain(v) for k, v in settings.items()}
        if name in _ALSO_FROM_STATE and isinstance(state, dict):
            init_args |= _ALSO_FROM_STATE[name](state)
        callback = klass(**init_args)
    except (TypeError, ValueError, KeyError, AttributeError):
        return None  # a setting the constructor does not take, or refuses
    if key not in keys_of(callback):
        return None
    parameters = inspect.signature(klass).parameters
    restored = _STATE_HOLDS.get(name, set())
    unrecorded = [p for p in parameters if p not in init_args and p not in restored]
    return callback, init_args, unrecorded


def instantiate(entry: Any) -> Any | None:
    """The callback a ``{"class_path", "init_args"}`` entry builds; None where it does not
    (the parse that follows reports what is wrong with it)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("class_path"), str):
        return None
    module_name, _, name = entry["class_path"].rpartition(".")
    try:
        klass = getattr(importlib.import_module(module_name), name)
        return klass(**(entry.get("init_args") or {}))
    except Exception:
        return None


def run_config_callbacks(ckpt_path: Path, checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """``trainer.callbacks`` of the ``config.yaml`` that ``lit-spikes fit`` saved beside
    ``ckpt_path``'s run (``<run>/checkpoints/<file>``): it has every setting, also of the
    callbacks that keep no state (``CheckpointRetention``), which the checkpoint's record
    lacks. A stateful one that left no state in this checkpoint is dropped: that
    config.yaml is another run's (the file was copied into its directory).

    Raises:
        RecordError: a class path in that config.yaml that is not what its entry takes.
    """
    loaded = read_record(record_path(ckpt_path))  # its class paths checked: RecordError
    trainer = loaded.get("trainer")
    entries = trainer.get("callbacks") if isinstance(trainer, dict) else None
    if isinstance(entries, dict):
        entries = [entries]
    recorded = {str(k) for k in (checkpoint.get("callbacks") or {})}
    kept = []
    for entry in entries if isinstance(entries, list) else []:
        callback = instantiate(entry)
        if callback is None or not callback.state_dict() or keys_of(callback) & recorded:
            kept.append(entry)
    return kept


def from_record(
    checkpoint: dict[str, Any], present: Iterable[Any], provided: Iterable[str] = ()
) -> RecordedCallbacks:
    """The callbacks a resume from ``checkpoint`` needs beyond the ``present`` ones (the
    callbacks the run's config.yaml or the command line already give) and those of the
    ``provided`` class names (the resume adds them itself): rebuilt from their state
    keys, or named where they cannot be."""
    states = checkpoint.get("callbacks") or {}
    covered: set[str] = set()
    for callback in present:
        covered |= keys_of(callback)
    result = RecordedCallbacks()
    for key, state in states.items():
        parsed = parse_state_key(str(key))
        if str(key) in covered or (parsed is not None and parsed[0] in {*CLI_OWN, *provided}):
            continue
        built = rebuild(str(key), state)
        if built is None:
            result.unrebuilt.append(str(key))
            continue
        callback, init_args, unrecorded = built
        if callback.state_key in covered:  # the same one, its key spelt as before
            continue
        covered |= keys_of(callback)
        result.keys.append(str(callback.state_key))
        result.rebuilt.append(
            {"class_path": f"{CALLBACKS_MODULE}.{type(callback).__name__}", "init_args": init_args}
        )
        call = ", ".join(f"{k}={v!r}" for k, v in init_args.items())
        note = f" ({', '.join(unrecorded)}: not in the record, defaults)" if unrecorded else ""
        result.described.append(f"{type(callback).__name__}({call}){note}")
    return result


def entries_to_resume(
    ckpt_path: Path | None, checkpoint: dict[str, Any], provided: Iterable[str] = ()
) -> tuple[list[dict[str, Any]], RecordedCallbacks]:
    """The ``{"class_path", "init_args"}`` entries of the callbacks a resume from
    ``checkpoint`` trains with, and the record they were rebuilt from (its ``unrebuilt``
    keys): those of the ``config.yaml`` beside ``ckpt_path``'s run (none for None), then
    each stateful one the file's own record names that those lack, from its state key,
    but those of the ``provided`` class names."""
    entries = run_config_callbacks(ckpt_path, checkpoint) if ckpt_path is not None else []
    present = [callback for callback in map(instantiate, entries) if callback is not None]
    record = from_record(checkpoint, present, provided)
    return [*entries, *record.rebuilt], record


def callbacks_to_resume(
    ckpt_path: Path | None, checkpoint: dict[str, Any]
) -> tuple[list[Any], RecordedCallbacks]:
    """``entries_to_resume``'s callbacks, built (as ``lit-spikes fit`` resumes)."""
    entries, record = entries_to_resume(ckpt_path, checkpoint)
    return [c for c in map(instantiate, entries) if c is not None], record


def with_exact_resume(callbacks: Iterable[Any], exact_resume: bool = True) -> list[Any]:
    """``callbacks`` with an ``ExactResume()`` added unless one is there or ``exact_resume``
    is False: what the tools give a user's module without being asked. A module's own one
    (``configure_callbacks``) still wins: Lightning replaces a Trainer callback of a type the
    module returns."""
    from lit_spikes.callbacks import ExactResume

    kept = list(callbacks)
    if exact_resume and not any(isinstance(c, ExactResume) for c in kept):
        kept.append(ExactResume())
    return kept
