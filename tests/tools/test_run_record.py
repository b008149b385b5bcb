"""A run's ``config.yaml`` handed over with its checkpoints runs no code: ``fit --ckpt_path``
and ``diagnose`` check every class path in it against what its entry takes before any is
called, refuse one that is not (naming the entry and the file), and say which file they
read their settings from (lit_spikes/tools/run_record.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from lit_spikes.tools.cli import main
from lit_spikes.tools.run_record import RecordError, check_record

NET, DATA = (f"tests.modules.fit_modules.{n}" for n in ("DropoutNet", "StepData"))
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
STEPS, SAVED = 8, 4
DETECTOR = "lit_spikes.callbacks.SpikeDetector"


def payload(sentinel: Path) -> dict[str, Any]:
    """What a hostile record would hold: a class whose construction runs a command."""
    return {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(sentinel)]}}


@pytest.fixture(scope="module")
def their_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's run of ``lit-spikes fit``, with a SpikeDetector: step=4.ckpt, step=8.ckpt."""
    root = tmp_path_factory.mktemp("theirs") / "run"
    main(["fit", "--model", NET, "--data", DATA, "--trainer.max_steps", str(STEPS),
          "--checkpoint_every", str(SAVED), f"--trainer.callbacks+={DETECTOR}",
          *QUIET, "--trainer.default_root_dir", str(root)])  # fmt: skip
    return root


def _set(place: str, value: Any) -> Callable[[dict[str, Any]], str]:
    """An edit of a parsed record putting ``value`` at ``place``; returns the entry's name."""

    def edit(record: dict[str, Any]) -> str:
        if place == "callbacks":
            record["trainer"]["callbacks"].append(value)
            return f"trainer.callbacks[{len(record['trainer']['callbacks']) - 1}]"
        if place in ("logger", "profiler"):
            record["trainer"][place] = value
            return f"trainer.{place}"
        if place == "plugins":
            record["trainer"]["plugins"] = [value]
            return "trainer.plugins[0]"
        if place == "nested":  # inside the model's own arguments
            record["model"]["init_args"]["hidden"] = value
            return "model.init_args.hidden"
        record[place] = value  # model, data
        return place

    return edit


PLACES = ["callbacks", "logger", "plugins", "profiler", "model", "data", "nested"]


def _handed_over(their_run: Path, tmp_path: Path, place: str) -> tuple[Path, Path, str]:
    """Their run copied here with the payload at ``place``: (the step=4 file, the
    sentinel the payload would create, the entry's name)."""
    theirs, sentinel = tmp_path / "theirs", tmp_path / "PAYLOAD_RAN"
    shutil.copytree(their_run, theirs)
    record = yaml.safe_load((theirs / "config.yaml").read_text())
    where = _set(place, payload(sentinel))(record)
    (theirs / "config.yaml").write_text(yaml.safe_dump(record))
    return theirs / "checkpoints" / f"step={SAVED}.ckpt", sentinel, where


@pytest.mark.parametrize("place", PLACES)
def test_a_class_path_of_the_wrong_kind_in_a_handed_over_record_never_runs(
    their_run: Path, tmp_path: Path, place: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, sentinel, where = _handed_over(their_run, tmp_path, place)
    record = ckpt.parent.parent / "config.yaml"
    for command, err in _refusals(ckpt, tmp_path / "mine", capsys):
        assert f"{record}: entry {where} has class_path 'subprocess.Popen'" in err, command
        assert not sentinel.exists(), f"{command} ran the record's payload"


def _refusals(ckpt: Path, mine: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple[str, str]]:
    """``(command, its error on one line)`` of ``fit --ckpt_path`` and ``diagnose`` on
    ``ckpt``, each checked to exit 2 and to write nothing (``mine``: fit's directory)."""
    errors = []
    for argv in (
        ["fit", "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(mine), *QUIET],
        ["diagnose", "--ckpt_path", str(ckpt), "--spike_step", str(SAVED + 1)],
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv[0]
        assert not mine.exists(), f"{argv[0]} wrote files before refusing"
        errors.append((argv[0], " ".join(capsys.readouterr().err.split())))  # one line
    return errors


def test_a_class_path_given_as_a_string_is_checked_too(tmp_path: Path) -> None:
    record = {"trainer": {"callbacks": ["subprocess.Popen"], "strategy": "auto"}}
    with pytest.raises(RecordError, match=r"entry trainer.callbacks\[0\].*takes a Callback"):
        check_record(record, tmp_path / "config.yaml")


@pytest.mark.parametrize(
    "record",
    [
        {
            "trainer": {
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs"},
                }
            }
        },
        {
            "trainer": {
                "strategy": {"class_path": "lightning.pytorch.strategies.SingleDeviceStrategy"}
            }
        },
        {
            "trainer": {
                "callbacks": [
                    {
                        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                        "init_args": {"dirpath": "runs.x", "monitor": "loss"},
                    }
                ]
            }
        },
        {
            "model": {"class_path": NET, "init_args": {"hidden": 4}},
            "data": None,
            "ckpt_path": "a.b",
        },
    ],
    ids=["logger", "strategy", "checkpoint", "model"],
)
def test_a_record_of_the_right_kinds_passes(tmp_path: Path, record: dict[str, Any]) -> None:
    check_record(record, tmp_path / "config.yaml")


@pytest.mark.parametrize(
    ("class_path", "why"),
    [
        ("os.system", "'os' has no class 'system'"),
        ("no_such_module_xyz.Thing", "cannot import 'no_such_module_xyz'"),
        ("Popen", "is not a class path"),
        ("subprocess.Popen", "a Popen"),
    ],
)
def test_what_is_not_a_class_is_refused_naming_why(
    tmp_path: Path, class_path: str, why: str
) -> None:
    record = {"data": {"class_path": class_path}}
    with pytest.raises(RecordError) as caught:
        check_record(record, tmp_path / "config.yaml")
    message = str(caught.value)
    assert f"entry data has class_path '{class_path}' (" in message and why in message
    assert "that entry takes a LightningDataModule" in message


def test_the_resume_says_which_file_it_read_its_settings_from(
    their_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    theirs = tmp_path / "theirs"
    shutil.copytree(their_run, theirs)
    capsys.readouterr()
    cli = main(["fit", "--ckpt_path", str(theirs / "checkpoints" / f"step={SAVED}.ckpt"),
                "--trainer.default_root_dir", str(tmp_path / "mine"), *QUIET])  # fmt: skip
    assert cli is not None and cli.trainer.global_step == STEPS
    err = capsys.readouterr().err
    assert f"lit-spikes: the run's settings from {theirs / 'config.yaml'}" in err


@pytest.mark.parametrize(
    ("text", "why"),
    [("trainer: {max_steps: 8\n", "does not parse as YAML"), ("- 1\n- 2\n", "holds a list")],
    ids=["truncated", "a-list"],
)
def test_a_record_that_does_not_parse_is_named_not_taken_for_missing(
    their_run: Path, tmp_path: Path, text: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hand-edited config.yaml that does not parse was reported as 'no config.yaml of its
    run is at <path>': the file is there."""
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    shutil.copytree(their_run, theirs)
    (theirs / "config.yaml").write_text(text)
    ckpt = theirs / "checkpoints" / f"step={SAVED}.ckpt"
    for command, err in _refusals(ckpt, mine, capsys):
        assert f"{theirs / 'config.yaml'}, the run's record" in err, command
        assert why in err and "no config.yaml" not in err, command
