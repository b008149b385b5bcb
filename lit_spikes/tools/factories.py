"""What to train, named the way LightningCLI takes it (a class path and its ``init_args``)
or given as a factory: the model, the data and the remedies of ``recover`` and
``diagnose``. A factory is called once per run, so every branch or replay starts from a
new object built the same way."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any

from jsonargparse import ArgumentParser

Factory = Callable[[], Any]
"""A callable with no arguments that builds a new object each call."""


def import_class(path: str, base: type, what: str) -> type:
    """The class ``path`` names (``package.module.Class``), checked to be a ``base``.

    Raises:
        ValueError: ``path`` is not a dotted name, its module or class does not exist, or
            the class is not a ``base``; the message names ``what`` (e.g. ``--model``).
    """
    module_name, _, name = path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{what}={path!r} is not a class path (package.module.Class)")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an import runs the module's code: anything may fail there
        raise ValueError(f"{what}={path!r}: cannot import {module_name!r} ({error})") from None
    klass = getattr(module, name, None)
    if not isinstance(klass, type):
        raise ValueError(f"{what}={path!r}: {module_name!r} has no class {name!r}")
    if not issubclass(klass, base):
        raise ValueError(f"{what}={path!r} is not a {base.__name__}")
    return klass


@dataclass(frozen=True)
class ClassPath:
    """A class by its import path and the keyword arguments it is built with, as
    LightningCLI's ``class_path``/``init_args`` (and a YAML config) write it.

    Example:
        >>> ClassPath("lit_spikes.callbacks.LRScaler", {"factor": 0.5}).build()
    """

    class_path: str
    """``package.module.Class``."""
    init_args: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of its ``__init__``."""

    @classmethod
    def of(cls, value: Any, what: str) -> ClassPath:
        """A ``ClassPath`` from a class path string, a ``{"class_path", "init_args"}``
        mapping, a class, or a ``ClassPath``.

        Raises:
            ValueError: anything else, or a mapping with other keys (named by ``what``).
        """
        if isinstance(value, ClassPath):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, type):
            return cls(f"{value.__module__}.{value.__qualname__}")
        if isinstance(value, Mapping) and isinstance(value.get("class_path"), str):
            unknown = sorted(set(value) - {"class_path", "init_args"})
            if unknown:
                raise ValueError(f"{what}: unknown keys {unknown}; give class_path and init_args")
            init_args = value.get("init_args") or {}
            if not isinstance(init_args, Mapping):
                raise ValueError(f"{what}.init_args={init_args!r} is not a mapping")
            return cls(value["class_path"], dict(init_args))
        raise ValueError(
            f"{what}={value!r} is neither a class path nor a mapping of class_path and init_args"
        )

    def klass(self, base: type = object, what: str = "class_path") -> type:
        """The class, imported and checked (see ``import_class``)."""
        return import_class(self.class_path, base, what)

    def build(self, base: type = object, what: str = "class_path", **overrides: Any) -> Any:
        """A new instance: ``init_args`` with ``overrides`` on top.

        Raises:
            ValueError: the class cannot be imported or is not a ``base``.
            TypeError: an argument its ``__init__`` does not take (named, with ``what``).
        """
        klass = self.klass(base, what)
        try:
            return klass(**{**self.init_args, **overrides})
        except TypeError as error:
            raise TypeError(f"{what}={self.class_path}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data, as a YAML config or a ledger holds it."""
        return {"class_path": self.class_path, "init_args": dict(self.init_args)}


def factory_of(value: Any, base: type, what: str) -> Factory:
    """A factory from a factory (a callable that is not a class) or anything
    ``ClassPath.of`` takes; the class is imported and checked at once.

    Raises:
        ValueError: see ``ClassPath.of`` and ``import_class``.
    """
    if callable(value) and not isinstance(value, type):
        factory: Factory = value
        return factory
    path = ClassPath.of(value, what)
    path.klass(base, what)  # a bad path fails here, before any run starts
    return lambda: path.build(base, what)


@dataclass(frozen=True)
class Instantiate:
    """A picklable factory: a fresh object from a jsonargparse class spec at each call (each
    of the check's runs builds its own; a new process rebuilds it from the spec)."""

    base: Any
    spec: Any

    def __call__(self) -> Any:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_argument("--value", type=self.base)
        return instantiate(parser, parser.parse_object({"value": self.spec})).value


def instantiate(parser: ArgumentParser, config: Any) -> Any:
    """``parser.instantiate`` (jsonargparse 4.49+; the older name is deprecated there)."""
    method = getattr(parser, "instantiate", None) or parser.instantiate_classes
    return method(config)


def stated_facts(spec: Mapping[str, Any], base: type, what: str) -> Any:
    """The ``lit_spikes.ToolFacts`` of the module ``spec`` (``{"class_path",
    "init_args"}``) builds: the defaults where its class states none (nothing is built),
    else read from one instance built as the command line builds it, the process's RNG
    states kept (a module that draws its weights leaves a run's draws alone).

    Raises:
        ValueError: a class path that does not import or is no ``base``; anything the
            module's own constructor raises.
    """
    from lit_spikes.randomness import kept_rng_states  # torch: not for a light --help
    from lit_spikes.tool_facts import ToolFacts, facts_of, states_facts

    if not states_facts(ClassPath.of(spec, what).klass(base, what)):
        return ToolFacts()
    with kept_rng_states():
        return facts_of(Instantiate(base, dict(spec))())


def complete_args(klass: type, given: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``given`` with the defaults of ``klass``'s other plain arguments, as the command
    line fills them in, and each argument whose default is a dataclass as the complete
    plain dict of its fields (given as a partial mapping, or left out): one run, one
    spelling in a ledger.

    Raises:
        ValueError: a dataclass argument given as other than a mapping, named as
            ``<what>.init_args.<name>``.
        TypeError: a field its dataclass does not have.
    """
    filled = dict(given)
    for name, parameter in inspect.signature(klass).parameters.items():
        default = parameter.default
        if name == "self" or default is inspect.Parameter.empty:
            continue
        if _instance_of_dataclass(default):
            value = filled.get(name, default)
            filled[name] = asdict(dataclass_of(type(default), value, f"{what}.init_args.{name}"))
        elif name not in filled and _plain(default):
            filled[name] = default
    return filled


def dataclass_of(cls: type, value: Any, what: str) -> Any:
    """``value`` as a ``cls`` (a dataclass): itself, the defaults (None: a YAML key left
    empty), or built from a mapping of its fields, nested dataclasses and tuples too
    (as a ledger's or a checkpoint's plain data holds them).

    Raises:
        ValueError: ``value`` is no mapping (named by ``what``).
    """
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if not isinstance(value, Mapping):  # a list, a scalar
        raise ValueError(
            f"{what}: {value!r} is not a mapping of its fields; leave it out for the defaults"
        )
    defaults = {f.name: _field_default(f) for f in fields(cls)}
    values = {}
    for key, item in value.items():
        default = defaults.get(key)
        if _instance_of_dataclass(default) and (item is None or isinstance(item, Mapping)):
            item = dataclass_of(type(default), item, f"{what}.{key}")
        elif isinstance(default, tuple) and isinstance(item, list):
            item = tuple(item)
        values[key] = item
    return cls(**values)


def _field_default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def _instance_of_dataclass(value: Any) -> bool:
    return is_dataclass(value) and not isinstance(value, type)


def _plain(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, bool | int | float | str)
