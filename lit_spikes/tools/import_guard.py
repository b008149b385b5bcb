"""What a file the user did not name may make lit-spikes import. A run's ``config.yaml``
and a recover ledger name classes by import path, and importing a module runs its code;
a run directory handed over by someone else (or a file in a shared folder) must not be a
way to run code. So a class path from such a file is located before anything of it is
imported, by Python's own path finder walked one package at a time (``PathFinder``
runs nothing; ``importlib.util.find_spec`` of a dotted name imports its parents), and
refused where its code would come from:

- the run directory of the file that names it (``evil.py`` beside its ``config.yaml``);
- the working directory or the script's directory, which Python puts on ``sys.path``
  itself (``python -m`` does), unless the user listed it in ``PYTHONPATH``;
- the standard library (``this`` prints the Zen of Python when imported): no run's class.

A module already imported, or one whose class path the user gave on this command line
(or in a ``--config`` file they named), is the user's choice and is taken. Rationale and
limits: docs/survives.md ("A handed-over run").
"""

from __future__ import annotations

import contextvars
import importlib.machinery
import importlib.util
import os
import re
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_NAMED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "lit_spikes_named_modules", default=frozenset()
)
"""The modules of the class paths the user gave this command (a context, not a global:
an in-process caller's next command starts with none)."""


@contextmanager
def named_by_user(args: Sequence[str]) -> Iterator[frozenset[str]]:
    """Within it, the modules of every class path in ``args`` (a command line) and in the
    ``--config``/``-c`` files it names count as the user's own."""
    token = _NAMED.set(frozenset(_modules_named(args)))
    try:
        yield _NAMED.get()
    finally:
        _NAMED.reset(token)


def _modules_named(args: Sequence[str]) -> set[str]:
    values: list[Any] = []
    for index, arg in enumerate(args):
        option, equals, value = arg.partition("=")
        value = value if equals and option.startswith("-") else arg
        values.append(value)
        if value[:1] in "{[":  # an inline class spec: --trainer.callbacks='{"class_path": ..}'
            values.append(_safe_yaml(value))
        config = value if option in ("-c", "--config") and equals else None
        if arg in ("-c", "--config") and index + 1 < len(args):
            config = args[index + 1]
        if config is not None:
            values.append(_safe_yaml(_text_of(config)))
    return {path.rpartition(".")[0] for path in _dotted_strings(values)}


def _text_of(path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return ""  # the parse that follows reports a config it cannot read


def _safe_yaml(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def _dotted_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        if _DOTTED.match(value):
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _dotted_strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _dotted_strings(item)


def refusal(class_path: str, run_dir: Path) -> str | None:
    """Why the module of ``class_path``, named by a file in ``run_dir`` that the user did
    not name, is not to be imported (None: it may be). Imports and runs nothing."""
    module_name = class_path.rpartition(".")[0]
    if not module_name or module_name in sys.modules or module_name in _NAMED.get():
        return None
    parts = module_name.split(".")
    locations: list[str] | None = None
    judge_entry = True  # a regular package's children come from where it came from
    for depth in range(len(parts)):
        name = ".".join(parts[: depth + 1])
        imported = sys.modules.get(name)
        if imported is not None:  # its code ran already: search its children where it does
            locations = list(getattr(imported, "__path__", None) or [])
            judge_entry = getattr(imported, "__file__", None) is None
            continue
        if depth == 0:
            spec = importlib.util.find_spec(name)  # a top-level name: imports nothing
        else:
            spec = importlib.machinery.PathFinder.find_spec(name, locations or [])
        if spec is None:
            return None  # nothing to run: the import fails, and says so, at once
        why = _untrusted(spec, depth, run_dir, judge_entry)
        if why is not None:
            return f"{name!r} would be imported from {why}"
        locations = list(spec.submodule_search_locations or [])
        judge_entry = not spec.has_location  # a namespace package spans sys.path entries
    return None


def _untrusted(
    spec: importlib.machinery.ModuleSpec, depth: int, run_dir: Path, judge_entry: bool
) -> str | None:
    """Where ``spec`` (a module ``depth`` packages deep) comes from, if that is nowhere the
    user put on their path themselves; None where it is. ``judge_entry``: whether the
    ``sys.path`` entry it is found in decides (not for a regular package's children)."""
    if spec.origin in ("built-in", "frozen"):
        return "the standard library (no class of a run is there)"
    files = [Path(spec.origin)] if spec.has_location and spec.origin else []
    files += [Path(p) for p in spec.submodule_search_locations or [] if not files]
    for file in (f.resolve() for f in files):
        if _under(file, run_dir.resolve()):
            return f"{file}, inside the run directory {run_dir}"
        if _in_stdlib(file):
            return f"{file}, in the standard library (no class of a run is there)"
        if not judge_entry:
            continue
        entry = _entry_of(file, depth, package=bool(spec.submodule_search_locations))
        if entry in _implicit_entries() and entry not in _pythonpath():
            if depth == 0 and _found_elsewhere(spec):
                continue  # an installed package (an editable install's own finder)
            return (
                f"{file}, in {entry}: the working directory or the script's directory, "
                "which Python put on sys.path itself, not you"
            )
    return None


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _entry_of(file: Path, depth: int, package: bool) -> Path:
    """The ``sys.path`` entry a module ``depth`` packages deep was found in: the folder
    above its top-level package (a package's origin is its ``__init__.py``)."""
    return file.parents[depth + 1] if package and file.is_file() else file.parents[depth]


def _implicit_entries() -> set[Path]:
    """What Python puts first on ``sys.path`` without being asked: the working directory
    (``python -m``, ``-c``, the REPL) or the script's own directory."""
    entries = {Path.cwd().resolve()}
    script = sys.argv[0] if sys.argv else ""
    if script not in ("", "-c", "-m"):
        entries.add(Path(script).resolve().parent)
    return entries


def _pythonpath() -> set[Path]:
    """The folders the user listed in ``PYTHONPATH`` ('.' included: they asked for it)."""
    listed = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return {Path(p).resolve() for p in listed if p}


def _in_stdlib(file: Path) -> bool:
    paths = sysconfig.get_paths()
    stdlib = {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib")}
    sites = {Path(paths[k]).resolve() for k in ("purelib", "platlib")}
    sites |= {Path(p).resolve() for p in sys.path if "-packages" in Path(p).name}
    in_site = any(_under(file, site) for site in sites)
    return not in_site and any(_under(file, lib) for lib in stdlib)


def _found_elsewhere(spec: importlib.machinery.ModuleSpec) -> bool:
    """True where a finder other than the ``sys.path`` one (an editable install's) finds the
    same top-level module: the user installed it, wherever it lies."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if finder is importlib.machinery.PathFinder or find is None:
            continue
        try:
            other = find(spec.name, None)
        except Exception:  # a third-party finder's own failure: it does not vouch for it
            continue
        if other is not None and other.origin == spec.origin and other.origin is not None:
            return True
    return False


def how_to_accept(where: str, class_path: str) -> str:
    """The flag that takes ``class_path`` for the entry ``where`` of a run's record."""
    flags = {"model": "--model", "data": "--data"}
    if where in flags:
        return f"give {flags[where]} {class_path} yourself"
    if where.startswith("trainer.callbacks"):
        return f"give --trainer.callbacks+={class_path} (with its settings) yourself"
    return f"name {class_path} yourself, on the command line or in a --config file you give"


def first_refusal(data: Any, source: Path, plain_keys: Sequence[str] = ()) -> str | None:
    """The refusal (``refusal``) of the first class path in ``data``, read from ``source``
    (a file the user did not name): each ``class_path`` value, and each string (or list of
    strings) under a top-level key of ``plain_keys``; None where none is refused."""
    paths: list[str] = []
    if isinstance(data, dict):
        for key in plain_keys:
            value = data.get(key)
            paths += [v for v in (value if isinstance(value, list | tuple) else [value])
                      if isinstance(v, str)]  # fmt: skip
    paths += list(_class_paths(data))
    for path in paths:
        refused = refusal_of(path, source)
        if refused is not None:
            return refused
    return None


def refusal_of(class_path: str, source: Path, where: str = "") -> str | None:
    """The whole refusal of ``class_path``, the entry ``where`` of ``source`` (a file the
    user did not name): what, from which file, where its module lies, and the flag that
    takes it; None where its module may be imported (``refusal``)."""
    why = refusal(class_path, source.parent)
    if why is None:
        return None
    entry = f": entry {where}" if where else ""
    return (
        f"{source}{entry} names {class_path!r}, whose module {why}. lit-spikes imports no "
        "code that a file you did not name asks for; nothing was run or written. To run it, "
        f"{how_to_accept(where, class_path)}, or install its package or put its folder on "
        "PYTHONPATH"
    )


def _class_paths(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        if isinstance(value.get("class_path"), str):
            yield value["class_path"]
        for item in value.values():
            yield from _class_paths(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _class_paths(item)
