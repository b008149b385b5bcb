"""A run's record, the ``config.yaml`` that ``lit-spikes fit`` saved beside its checkpoints,
read as data: a resume (``fit --ckpt_path``) and ``diagnose`` take their settings from it,
but the user named only the checkpoint. Checkpoints load ``weights_only=True``; the file
beside one must not be a way around that. So every class path in it is resolved and
checked, before anything of it is called, to be what its entry takes: a ``Callback`` for
``trainer.callbacks``, a ``Logger`` for ``trainer.logger``, a ``LightningModule`` for
``model``, and for any other entry the classes its annotation names (the Trainer's or the
class's own ``__init__``). A record with one that is not is refused as a whole, naming
the entry and the file (docs/survives.md).
"""

from __future__ import annotations

import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import yaml

from lit_spikes.shared.training import CHECKPOINT_DIRNAME
from lit_spikes.tools.factories import import_class
from lit_spikes.tools.import_guard import refusal_of

RECORD_NAME = "config.yaml"

_PLAIN = frozenset({object, str, bytes, int, float, bool, type(None), dict, list, tuple, set})
"""Annotations that name no class a class path could be checked against."""
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


class RecordError(ValueError):
    """A run record holding a class path that is not what its entry takes (or cannot be
    resolved); the message names the file, the entry and the fix."""


def record_path(ckpt_path: str | Path) -> Path | None:
    """The run's record of a ``<run>/checkpoints/<file>``: ``<run>/config.yaml``. None for
    a file anywhere else: its grandparent is no run directory (``/tmp/a/x.ckpt`` would
    read ``/tmp/config.yaml``, which any user of the machine can write)."""
    folder = Path(ckpt_path).resolve().parent
    return folder.parent / RECORD_NAME if folder.name == CHECKPOINT_DIRNAME else None


def read_record(path: Path | None) -> dict[str, Any]:
    """The record at ``path``, parsed and checked ({} where there is none, or no path).

    Raises:
        RecordError: a file there that does not parse or holds no mapping (a hand edit, a
            write cut short), or a class path in it that is not what its entry takes.
    """
    if path is None:
        return {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as error:
        raise _unreadable(path, f"cannot be read ({error})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        one_line = " ".join(str(error).split())
        raise _unreadable(path, f"does not parse as YAML ({one_line})") from None
    if not isinstance(loaded, dict):
        raise _unreadable(path, f"holds a {type(loaded).__name__}, not a mapping of settings")
    check_record(loaded, path)
    return loaded


def _unreadable(path: Path, why: str) -> RecordError:
    return RecordError(
        f"{path}, the run's record that lit-spikes takes the run's settings from, {why}: "
        "mend it (lit-spikes fit wrote it), or move it away and give the run's settings "
        "on the command line; nothing was run or written"
    )


def announce(path: Path) -> None:
    """One line on stderr: the settings come from ``path`` (a file the user did not name)."""
    print(f"lit-spikes: the run's settings from {path}", file=sys.stderr)


def check_record(record: Mapping[str, Any], path: Path) -> None:
    """Raises ``RecordError`` for the first class path of ``record`` (read from ``path``)
    that is not what its entry takes; calls nothing."""
    for key, value in record.items():
        _check(value, str(key), _top_level_bases(str(key)), path, top=True)
    trainer = record.get("trainer")
    if isinstance(trainer, Mapping):
        hints = _hints(_trainer_class())
        for key, value in trainer.items():
            bases = _classes_in(hints.get(str(key)))
            _check(value, f"trainer.{key}", bases, path, top=True)


def _top_level_bases(key: str) -> tuple[type, ...]:
    import lightning.pytorch as pl
    import torch

    return {
        "model": (pl.LightningModule,),
        "data": (pl.LightningDataModule,),
        "optimizer": (torch.optim.Optimizer,),
        "lr_scheduler": (
            torch.optim.lr_scheduler.LRScheduler,
            torch.optim.lr_scheduler.ReduceLROnPlateau,
        ),
    }.get(key, ())


def _trainer_class() -> type:
    import lightning.pytorch as pl

    return pl.Trainer


def _check(value: Any, where: str, bases: tuple[type, ...], path: Path, top: bool) -> None:
    """``value`` at entry ``where``, whose annotation names ``bases`` (() for none)."""
    if where == "trainer" and top:
        return  # its entries are checked one by one, against the Trainer's annotations
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check(item, f"{where}[{index}]", bases, path, top)
    elif isinstance(value, Mapping) and "class_path" in value:
        klass = _resolved(value["class_path"], where, bases, path)
        hints = _hints(klass)
        init_args = value.get("init_args")
        for name, arg in (init_args if isinstance(init_args, Mapping) else {}).items():
            _check(arg, f"{where}.init_args.{name}", _classes_in(hints.get(str(name))), path, False)
        for key in set(value) - {"class_path", "init_args"}:
            _check(value[key], f"{where}.{key}", (), path, False)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check(item, f"{where}.{key}", (), path, False)
    elif isinstance(value, str) and top and bases and _DOTTED.match(value):
        _resolved(value, where, bases, path)  # a class path given as a plain string


def _resolved(class_path: Any, where: str, bases: tuple[type, ...], path: Path) -> type:
    """The class ``class_path`` names (imported, never called), if it is a subclass of one
    of ``bases``; its module is located first, and not imported where the user did not
    put it (``import_guard``)."""
    if isinstance(class_path, str) and (refused := refusal_of(class_path, path, where)):
        raise RecordError(refused)
    try:
        if not isinstance(class_path, str):
            raise ValueError("it is no class path (package.module.Class)")
        klass = import_class(class_path, object, "class_path")
        if bases and issubclass(klass, bases):
            return klass
        reason = f"a {klass.__qualname__}"
    except ValueError as error:
        reason = str(error)
    takes = " or ".join(b.__qualname__ for b in bases) if bases else "no class"
    raise RecordError(
        f"{path}: entry {where} has class_path {class_path!r} ({reason}), but that entry "
        f"takes {'a ' if bases else ''}{takes}. lit-spikes calls no class path of a run's "
        "record (a file you did not name) that is not what its entry takes; nothing was "
        f"run or written. Remove that entry from {path.name}, or give the run's settings on "
        "the command line (--model, --data, --trainer.callbacks) from a run directory "
        "without it"
    )


def _hints(klass: type) -> dict[str, Any]:
    """The annotations of ``klass.__init__`` ({} where they cannot be resolved)."""
    try:
        return typing.get_type_hints(_init_of(klass))
    except Exception:  # a forward reference the module cannot resolve at run time
        return {}


def _init_of(klass: type) -> Any:
    """``klass``'s ``__init__``, its own or its nearest base's (read from the class, not
    an instance)."""
    for base in klass.__mro__:
        if "__init__" in vars(base):
            return vars(base)["__init__"]
    return object.__init__


def _classes_in(hint: Any) -> tuple[type, ...]:
    """The classes an annotation names (``Optional[list[Callback] | Callback]``: Callback),
    less the plain ones (str, int, Path, ...)."""
    if hint is None:
        return ()
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return ()
    if origin is not None:
        found: list[type] = []
        for arg in typing.get_args(hint):
            found += [c for c in _classes_in(arg) if c not in found]
        return tuple(found)
    if isinstance(hint, type) and hint not in _PLAIN and not issubclass(hint, PurePath):
        return (hint,)
    return ()
