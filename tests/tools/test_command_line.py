"""The parser of the commands outside the LightningCLI (``lit_spikes.tools.command_line``):
options from a config dataclass with their docstrings, one spelling, two-line errors
with the option a typo meant, ``--print_config`` that ``--config`` reads back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lit_spikes.tools.command_line import command_parser, parse_config


@dataclass(frozen=True)
class Inner:
    """A nested section."""

    ratio: float = 1.5
    """How much above the mean."""


@dataclass(frozen=True)
class Settings:
    """A command's settings."""

    checkpoint_every: int = 50
    """Write a checkpoint every this many steps."""
    inner: Inner = field(default_factory=Inner)
    """The nested section."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 1:
            raise ValueError(f"Settings.checkpoint_every={self.checkpoint_every} must be >= 1")


def _parse(argv: list[str]) -> Settings:
    settings, _ = parse_config(
        command_parser("lit-spikes demo", "a demo", Settings), Settings, argv
    )
    assert isinstance(settings, Settings)
    return settings


def test_fields_and_nested_sections_parse_into_the_dataclass() -> None:
    assert _parse(["--checkpoint_every", "7", "--inner.ratio", "3"]) == Settings(7, Inner(3.0))
    assert _parse([]) == Settings()


def test_help_lists_every_field_with_its_docstring(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--checkpoint_every" in text and "Write a checkpoint every this many steps." in text
    assert "--inner.ratio" in text and "How much above the mean." in text


def test_other_parsers_of_the_process_read_no_attribute_docstrings() -> None:
    """jsonargparse's setting is global: left on, every LightningCLI of a process that
    built a command parser (the test suite) parsed the Trainer's source, a second a call."""
    from jsonargparse import ArgumentParser

    _parse([])
    other = ArgumentParser()
    other.add_class_arguments(Settings, nested_key=None)
    assert "--checkpoint_every" in other.format_help()
    assert "Write a checkpoint every" not in other.format_help()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--checkpoint-every", "10"], "did you mean --checkpoint_every?"),
        (["--checkpoint_every", "x"], "--checkpoint_every"),
        (["--checkpoint_every", "0"], "Settings.checkpoint_every=0 must be >= 1"),
    ],
    ids=["typo", "not-an-int", "refused-by-the-dataclass"],
)
def test_a_mistake_gets_two_lines(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        _parse(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("usage: lit-spikes demo")
    assert lines[1].startswith("lit-spikes demo: error:") and said in lines[1]


def test_print_config_round_trips_through_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parse(["--checkpoint_every", "9", "--inner.ratio", "2.5", "--print_config"])
    path = tmp_path / "settings.yaml"
    path.write_text(capsys.readouterr().out)
    assert _parse(["--config", str(path)]) == Settings(9, Inner(2.5))


def test_check_resume_takes_one_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    from lit_spikes.tools.check_resume import main

    status = main(
        [
            "--model",
            "tests.modules.user_modules.DropoutRegressor",
            "--steps",
            "4",
            "--resume-at",
            "2",
        ]
    )
    assert status == 2
    assert "did you mean --resume_at?" in capsys.readouterr().err


def test_an_abbreviation_is_not_taken_for_an_option(capsys: pytest.CaptureFixture[str]) -> None:
    """``--checkpoint`` was read as ``--checkpoint_every`` (argparse's prefix matching):
    an old spelling must fail, not be guessed."""
    with pytest.raises(SystemExit):
        _parse(["--checkpoint", "7"])
    assert "unrecognized arguments: --checkpoint 7" in capsys.readouterr().err
