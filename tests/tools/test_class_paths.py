"""``--model``/``--data`` as a user types them, on every command: ``--help`` after a class
path lists that class's options (not the demo's), and a class path with a typo is refused
with the closest module or class, as an option's typo is."""

from __future__ import annotations

import pytest

from lit_spikes.tools.class_paths import class_path_problem, given_class_paths
from lit_spikes.tools.cli import main

FACTS = "tests.modules.spiky_modules.FactRegressor"
COMMANDS = ("fit", "recover", "diagnose", "check-resume")


def exit_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The command's exit status (check-resume's ``main`` returns it), out and err."""
    try:
        code = main(argv)
    except SystemExit as done:
        code = done.code
    assert isinstance(code, int | None), code  # an exit status, not a run's result
    captured = capsys.readouterr()
    return int(code or 0), captured.out, captured.err


@pytest.mark.parametrize("command", COMMANDS)
def test_help_after_a_class_path_lists_that_classs_options(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = exit_of([command, "--model", FACTS, "--help"], capsys)
    assert code == 0
    assert f"Given: {FACTS}, whose options are:" in out
    prefix = "--model." if command == "fit" else "--model.init_args."
    lines = [line.strip() for line in out.splitlines()]
    assert f"{prefix}warmup_steps (default: 12)" in lines  # one a line, not reflowed
    assert f"{prefix}jump_step (default: None)" in lines
    assert "gpt.n_layer" not in out and "TinyGPTModule, whose options" not in out


def test_fit_help_without_a_class_path_lists_the_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = exit_of(["fit", "--help"], capsys)
    assert code == 0 and "Default: lit_spikes.demo.module.TinyGPTModule, whose" in out
    data = "tests.modules.spiky_modules.StepRegressionData"
    code, out, _ = exit_of(["fit", "--data", data, "--help"], capsys)
    assert "Default: lit_spikes.demo.module.TinyGPTModule, whose" in out
    assert f"Given: {data}, whose options are:" in out and "--data.poison (default" in out


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("key", "typo", "meant"),
    [
        ("model", "tests.modules.spiky_modules.FactRegresor", FACTS),
        ("model", "tests.modules.spiky_modulez.FactRegressor", "tests.modules.spiky_modules"),
        (
            "data",
            "tests.modules.spiky_modules.StepRegresionData",
            "tests.modules.spiky_modules.StepRegressionData",
        ),
    ],
)
def test_a_class_path_with_a_typo_is_refused_naming_the_closest(
    command: str, key: str, typo: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    other = [] if key == "model" else ["--model", FACTS]
    code, out, err = exit_of([command, *other, f"--{key}", typo, "--max_steps", "3"], capsys)
    assert code == 2 and not out
    assert f"--{key} {typo}" in err and f"(did you mean {meant}?)" in err
    assert "Given value type" not in err  # not jsonargparse's account of a Union


def test_a_class_of_another_kind_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    rows = "tests.modules.spiky_modules.RegressionRows"
    for command in COMMANDS:
        code, _, err = exit_of([command, "--model", rows], capsys)
        assert code == 2 and f"--model {rows} is not a LightningModule" in err, err


def test_the_class_paths_given_are_read_as_a_parser_reads_them() -> None:
    argv = ["--model", "a.B", "--data=c.D", "--model.init_args.x", "1", "--model", "e.F"]
    assert given_class_paths(argv, ["model", "data"]) == {"model": "e.F", "data": "c.D"}
    config = ["--model", '{"class_path": "a.B"}', "--data", "Short", "--model"]
    assert given_class_paths(config, ["model", "data"]) == {}


def test_the_closest_class_is_one_of_the_kind_asked_for() -> None:
    """A typo's suggestion is a class of the option's kind: a module's data class is no
    answer to ``--model``."""
    from lightning.pytorch import LightningDataModule, LightningModule

    module = "tests.modules.spiky_modules"
    found = class_path_problem(f"{module}.JumpRegresor", LightningModule)
    assert found is not None and found.endswith(f"(did you mean {module}.JumpRegressor?)")
    found = class_path_problem(f"{module}.StepRegressionDat", LightningDataModule)
    assert found is not None and f"(did you mean {module}.StepRegressionData?)" in found
    found = class_path_problem(f"{module}.StepRegressionDat", LightningModule)
    assert found is not None and "StepRegressionData" not in found
    assert class_path_problem(f"{module}.JumpRegressor", LightningModule) is None


def test_recovers_help_lists_the_given_datas_options(capsys: pytest.CaptureFixture[str]) -> None:
    data = "tests.modules.spiky_modules.StepRegressionData"
    code, out, _ = exit_of(["recover", "--data", data, "--help"], capsys)
    assert code == 0 and f"Given: {data}, whose options are:" in out
    lines = [line.strip() for line in out.splitlines()]
    assert any(line.startswith("--data.init_args.poison (default: ") for line in lines)
