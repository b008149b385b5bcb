"""``--model`` and ``--data`` as a person types them: a class path with a typo is refused
with the closest module or class (as an option's typo is), and ``--help`` after a class
path lists that class's options, not the default's."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jsonargparse import ArgumentParser

from lit_spikes.tools.factories import import_class

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def given_class_paths(argv: Sequence[str], keys: Sequence[str]) -> dict[str, str]:
    """The class path given to each ``--<key>`` in ``argv`` (``--model X`` or
    ``--model=X``; the last one, as a parser takes it); a config or a short name is not
    one."""
    found: dict[str, str] = {}
    for index, word in enumerate(argv):
        for key in keys:
            if word == f"--{key}" and index + 1 < len(argv):
                value = argv[index + 1]
            elif word.startswith(f"--{key}="):
                value = word.partition("=")[2]
            else:
                continue
            if _DOTTED.fullmatch(value):
                found[key] = value
    return found


def class_path_problem(path: str, base: type) -> str | None:
    """Why ``path`` names no ``base`` subclass, with the closest module or class where
    one is close (None: it names one)."""
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if not module_name.startswith(missing):  # the module itself imports a missing one
            return f"{path}: cannot import {module_name!r} ({error})"
        return f"{path}: there is no module {missing!r}{_close_module(missing)}"
    except Exception as error:  # an import runs the module's code: anything may fail there
        return f"{path}: cannot import {module_name!r} ({error})"
    klass = getattr(module, name, None)
    if klass is None:
        classes = [
            n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, base)
        ]
        close = difflib.get_close_matches(name, classes, n=1)
        hint = f" (did you mean {module_name}.{close[0]}?)" if close else ""
        return f"{path}: module {module_name!r} has no class {name!r}{hint}"
    if not (isinstance(klass, type) and issubclass(klass, base)):
        return f"{path} is not a {base.__name__}"
    return None


def first_problem(argv: Sequence[str], bases: Mapping[str, type]) -> str | None:
    """``--<key> <why>`` for the first class path in ``argv`` that names no subclass of
    its key's base (``{"model": LightningModule, ...}``), else None."""
    for key, path in given_class_paths(argv, list(bases)).items():
        problem = class_path_problem(path, bases[key])
        if problem is not None:
            return f"--{key} {problem}"
    return None


def help_classes(
    argv: Sequence[str], bases: Mapping[str, type], defaults: Mapping[str, str]
) -> dict[str, tuple[str, type]]:
    """Each key's class whose options ``--help`` lists, with ``"Given"`` (named in
    ``argv``) or ``"Default"`` (``defaults``' class path; a bad one given: the parse says
    why)."""
    given = given_class_paths(argv, list(bases))
    classes = {}
    for key, default in defaults.items():
        path = given.get(key)
        if path is not None and class_path_problem(path, bases[key]) is not None:
            path = None
        heading = "Default" if path is None else "Given"
        classes[key] = (heading, import_class(path or default, bases[key], f"--{key}"))
    return classes


def _close_module(missing: str) -> str:
    """`` (did you mean <a module beside it>?)``, or nothing where none is close."""
    parent, _, leaf = missing.rpartition(".")
    try:
        where = importlib.import_module(parent).__path__ if parent else None
    except (ImportError, AttributeError):
        return ""
    names = [m.name for m in pkgutil.iter_modules(where)]
    close = difflib.get_close_matches(leaf, names, n=1)
    return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""


def class_defaults(klass: type, key: str) -> dict[str, Any]:
    """``klass``'s init arguments as the command line takes them (``<key>.NAME``: those
    its ``**kwargs`` hand to a parent class too), with their defaults."""
    probe = ArgumentParser()
    probe.add_class_arguments(klass, key, fail_untyped=False)
    return dict(probe.get_defaults().items())


def options_listing(key: str, klass: type, heading: str, init_args: bool = False) -> str:
    """``heading``, then ``klass``'s options as ``--<key>.NAME`` (``init_args``:
    ``--<key>.init_args.NAME``), one a line with its default."""
    lines = []
    for name, value in class_defaults(klass, key).items():
        if name.startswith(f"{key}."):
            option = f"{key}.init_args.{name[len(key) + 1 :]}" if init_args else name
            lines.append(f"  --{option} (default: {'[]' if value == () else value})")
    path = f"{klass.__module__}.{klass.__qualname__}"
    listed = "\n".join(lines) if lines else "  (none)"
    return f"{heading}: {path}, whose options are:\n{listed}"
