"""Every ``lit-spikes ...`` command line of README.md and docs/*.md goes through the parser
(in-process, nothing trained): a misspelt option in the docs fails here. A concrete line
is parsed with ``--print_config``, a ``fit`` line without a checkpoint also through the
checks that come before anything is built; a synopsis (``--steps N [--seed S]``) has its
option names looked up in the command's ``--help``."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from lit_spikes.tools.cli import main
from lit_spikes.tools.fit_cli import LitSpikesCLI

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMANDS = ("fit", "validate", "recover", "diagnose", "check-resume")
USER_CLASSES = {
    "my_pkg.MyModule": "tests.modules.fit_modules.DropoutNet",
    "my_package.MyModule": "tests.modules.fit_modules.DropoutNet",
    "my_pkg.MyData": "tests.modules.fit_modules.StepData",
    "my_package.MyData": "tests.modules.fit_modules.StepData",
}
"""The docs' stand-ins for a user's classes, and a user's classes to parse them with."""
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|\[|\]|^\.\.\.$|CLASS_PATH|\.[A-Z]+$")
_VARIABLE = re.compile(r'^(\w+)="([^"]*)"$')


def _logical_lines(text: str) -> Iterator[str]:
    """The lines of fenced blocks (continuations joined, ``$VAR`` of a ``VAR="..."`` line
    above substituted) and the inline code spans."""
    variables: dict[str, str] = {}
    block, pending = False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            block, pending = not block, ""
            continue
        if not block:
            continue
        pending += line.rstrip("\\") + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        joined, pending = pending.strip(), ""
        assignment = _VARIABLE.match(joined)
        if assignment:
            variables[assignment[1]] = assignment[2]
        for name, value in variables.items():
            joined = joined.replace(f"${name}", value)
        yield joined
    for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL)):
        yield " ".join(span.split())


def command_lines() -> list[tuple[str, tuple[str, ...]]]:
    """``(where, argv after lit-spikes)`` of each distinct command line in the docs."""
    found: dict[tuple[str, ...], str] = {}
    for doc in DOCS:
        for line in _logical_lines(doc.read_text()):
            if line.startswith("#"):
                continue  # a comment's sketch of a launcher line
            try:
                words = shlex.split(line.removeprefix("$ "), comments=True)
            except ValueError:
                continue  # prose in backticks
            starts = [
                i for i, w in enumerate(words) if w == "lit-spikes" or w.endswith("/lit-spikes")
            ]
            if not starts or any("=" not in w for w in words[: starts[0]]):
                continue  # lit-spikes is not the command run (an argument, prose)
            words = words[starts[0] + 1 :]
            cut = [i for i, w in enumerate(words) if w in (">", "|", "&&", ";")]
            argv = tuple(USER_CLASSES.get(w, w) for w in words[: cut[0] if cut else None])
            found.setdefault(argv, f"{doc.name}: {line[:60]}")
    return [(where, argv) for argv, where in found.items()]


def test_the_docs_have_command_lines_to_check() -> None:
    argvs = [argv for _, argv in command_lines()]
    assert len(argvs) > 20
    assert any(argv[:1] == ("check-resume",) and "--resume_at" in argv for argv in argvs)


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main([command, "--help"])  # check-resume returns its status
    except SystemExit as exit_info:
        code = exit_info.code
    assert code in (0, None), command
    return capsys.readouterr().out


class _Parsed(Exception):
    """Raised where the classes would be built: every check before them passed."""


@pytest.mark.slow
def test_every_command_line_in_the_docs_parses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # the docs' runs/... directories: none here, none written

    def parsed(self: LitSpikesCLI) -> None:
        raise _Parsed

    monkeypatch.setattr(LitSpikesCLI, "instantiate_classes", parsed)
    helps: dict[str, str] = {}
    failures = []
    for where, argv in command_lines():
        if not argv or argv[0] not in COMMANDS:
            continue  # lit-spikes --help, {fit,validate,...}: the top level
        argv = tuple(str(REPO / w) if w.startswith("configs/") else w for w in argv)
        last = argv[-1]  # an option without its value: prose naming it (`fit --config`)
        sketch = len(argv) == 1 or (
            last.startswith("--") and "=" not in last and last not in ("--help", "--print_config")
        )
        if sketch or any(_PLACEHOLDER.search(w) for w in argv):
            # a synopsis: its option names, as the command's help spells them
            if argv[0] not in helps:
                helps[argv[0]] = _help(argv[0], capsys)
            options = {w.partition("=")[0].rstrip("+") for w in argv if w.startswith("--")}
            unknown = [o for o in options if not _PLACEHOLDER.search(o) and o not in helps[argv[0]]]
            if unknown:
                failures.append(f"{where}: {unknown} not in `{argv[0]} --help`")
            continue
        check = [*argv, "--print_config"]
        if argv[0] == "fit" and "--ckpt_path" not in argv and "--help" not in argv:
            check = list(argv)  # the parse, then the checks before anything is built
        try:
            result = main(check)
            code: object = result if isinstance(result, int) else "no exit"
        except SystemExit as exit_info:
            code = exit_info.code
        except _Parsed:
            code = 0
        err = capsys.readouterr().err
        if code not in (0, None):
            failures.append(f"{where}: {' '.join(check)} exits {code}: {err[-300:]}")
    assert not failures, "\n".join(failures)
    assert not any(tmp_path.iterdir()), "a parse wrote files"
