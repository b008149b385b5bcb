"""The parser every ``lit-spikes`` command outside the LightningCLI is built with: its
options are the fields of the command's config dataclass (each with its docstring as help,
nested dataclasses as ``--section.field``), ``--config`` takes a YAML of them,
``--print_config`` writes one back, ``--model``/``--data`` take class paths as ``lit-spikes
fit`` does, and a mistake gets two lines: the usage and the error, with the closest option
to a misspelt one."""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from typing import Any, NoReturn

import jsonargparse
from jsonargparse import ArgumentParser, DefaultHelpFormatter, Namespace
from typing_extensions import override

from lit_spikes.tools.class_paths import first_problem, given_class_paths, options_listing
from lit_spikes.tools.factories import import_class


@contextmanager
def _attribute_docstrings() -> Iterator[None]:
    """Field docstrings (a string under the field, as the configs write them) become the
    help, while a command parser is built or parses. jsonargparse's setting is global and
    costs every other parser a parse of its classes' source (LightningCLI's of the whole
    Trainer, about a second a ``lit-spikes fit`` in a process that imported this), so it
    goes back to jsonargparse's default after."""
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        yield
    finally:
        jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=False)


_UNKNOWN = re.compile(r"(?:unrecognized arguments|Unrecognized arguments): (.*)")


class ListingFormatter(DefaultHelpFormatter):
    """jsonargparse's help, but a section's list of a class's options one a line (as
    ``options_listing`` writes it), not reflowed into a paragraph."""

    @override
    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # argparse's hook for a description's layout, the one RawDescriptionHelpFormatter
        # (public) overrides for every description: here only for the options' lists
        if "\n  --" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class CommandParser(ArgumentParser):
    """A jsonargparse parser whose errors are two lines (usage, error) and name the option
    closest to an unknown one (``--checkpoint-every``: did you mean
    ``--checkpoint_every``?)."""

    command = "lit-spikes"
    """The command's name in its errors (nested parsers of ``--model`` share it)."""

    @override
    def add_class_arguments(self, *args: Any, **kwargs: Any) -> Any:
        with _attribute_docstrings():
            return super().add_class_arguments(*args, **kwargs)

    @override
    def add_subclass_arguments(
        self, baseclass: Any, nested_key: str, *args: Any, **kwargs: Any
    ) -> Any:
        self.class_keys = {**getattr(self, "class_keys", {}), nested_key: baseclass}
        with _attribute_docstrings():
            return super().add_subclass_arguments(baseclass, nested_key, *args, **kwargs)

    @override
    def parse_args(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        self._check_class_paths(argv)
        # a class path's options (--model.init_args.NAME, --model.help) are added here
        with _attribute_docstrings():
            return super().parse_args(args, *rest, **kwargs)

    def _check_class_paths(self, argv: list[str]) -> None:
        """A ``--model``/``--data`` class path with a typo is an error naming the closest;
        with ``--help``, that class's options head its section."""
        keys: dict[str, Any] = getattr(self, "class_keys", {})
        problem = first_problem(argv, keys)
        if problem is not None:
            self.error(problem)
        for key, path in given_class_paths(argv, list(keys)).items():
            group = (self.groups or {}).get(key)
            if group is not None and ("--help" in argv or "-h" in argv):
                klass = import_class(path, keys[key], f"--{key}")
                group.description = options_listing(key, klass, "Given", init_args=True)

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        first = message.strip().splitlines()[0] if message.strip() else "invalid arguments"
        unknown = _UNKNOWN.search(first)
        if unknown:
            known = [f"--{key}" for key in self.get_defaults().keys()]  # noqa: SIM118 (nested keys)
            for word in unknown[1].split():
                option = word.partition("=")[0]
                close = difflib.get_close_matches(option.replace("-", "_"), known, n=1, cutoff=0.7)
                if option.startswith("--") and close:
                    first += f" (did you mean {close[0]}?)"
        elif len(message.strip().splitlines()) > 1:
            first = _condensed(message)
        print(f"usage: {self.command} [options] (--help lists them)", file=sys.stderr)
        print(f"{self.command}: error: {first}", file=sys.stderr)
        raise SystemExit(2)


def _condensed(message: str) -> str:
    """jsonargparse's many-line account of a bad value cut to its key and innermost cause."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    key = re.match(r'Parser key "([^"]+)"', lines[0])
    causes = [
        line.lstrip("- ")
        for line in lines[1:]
        if not line.startswith(("Subtypes", "Errors", "Given value", "- Expected a <class 'None"))
        and not line.startswith("- Does not validate")
    ]
    cause = causes[-1] if causes else lines[-1]
    return f"--{key[1]}: {cause}" if key else f"{lines[0]} {cause}"


def command_parser(
    prog: str, description: str, config_class: type, skip: set[str] | None = None
) -> CommandParser:
    """A parser of ``config_class``'s fields at the top level (but ``skip``: fields the
    command adds its own way, e.g. class paths), with ``--config``."""
    CommandParser.command = prog
    # No abbreviations: an old spelling (--ckpt for --ckpt_path) is an error, not a guess.
    parser = CommandParser(
        prog=prog,
        description=description,
        exit_on_error=True,
        allow_abbrev=False,
        formatter_class=ListingFormatter,
    )
    # jsonargparse's documented config action (not in its __all__, so mypy wants the attribute)
    config_action = jsonargparse.ActionConfigFile  # type: ignore[attr-defined]
    parser.add_argument("--config", action=config_action, help="a YAML file of these options")
    parser.add_class_arguments(config_class, nested_key=None, fail_untyped=False, skip=skip)
    return parser


def add_class_path(
    parser: ArgumentParser, key: str, base: type, default: dict[str, Any] | None = None
) -> None:
    """``--<key> CLASS_PATH`` (and ``--<key>.init_args.NAME``) for a subclass of ``base``,
    ``default`` (``{"class_path", "init_args"}``; None: not given) when left out."""
    parser.add_subclass_arguments(base, key, required=False, fail_untyped=False)
    if default is not None:
        parser.set_defaults({key: default})


def as_plain(value: Any) -> Any:
    """A parsed value as plain data (a ``Namespace`` as a dict, recursively)."""
    if isinstance(value, Namespace):
        return {k: as_plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: as_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_plain(v) for v in value]
    return value


def config_of(config_class: type, parsed: Namespace) -> Any:
    """``config_class`` built from the parsed values of its fields (the others ignored).

    Raises:
        ValueError: a value its ``__post_init__`` refuses.
    """
    assert is_dataclass(config_class)
    plain = as_plain(parsed)
    values = {f.name: plain[f.name] for f in fields(config_class) if f.name in plain}
    return config_class(**{k: _built(config_class, k, v) for k, v in values.items()})


def parse_config(parser: ArgumentParser, config_class: type, argv: Any) -> tuple[Any, Namespace]:
    """The command's config and all parsed values; a value the config refuses is a usage
    error (two lines, as any other)."""
    parsed = parser.parse_args(argv)
    try:
        return config_of(config_class, parsed), parsed
    except (ValueError, TypeError) as error:
        parser.error(str(error))


def _built(config_class: type, name: str, value: Any) -> Any:
    """A nested dataclass field's value built from its dict (jsonargparse gives dicts)."""
    kind = {f.name: f.type for f in fields(config_class)}[name]
    nested = kind if isinstance(kind, type) else None
    if isinstance(kind, str):  # postponed annotations: look the class up by name
        module = sys.modules[config_class.__module__]
        nested = getattr(module, kind, None)
    if isinstance(value, dict) and nested is not None and is_dataclass(nested):
        return config_of(nested, Namespace(**value))  # type: ignore[no-untyped-call]
    return value
