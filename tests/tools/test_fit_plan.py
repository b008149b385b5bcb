"""The fit CLI's checks as functions of a parsed configuration, its resume step and the run
directory (``lit_spikes.tools.fit_plan``): milliseconds each, no LightningCLI built. The
CLI tests check that a problem found here is a usage error that writes nothing."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from lit_spikes.demo.module import OptimConfig
from lit_spikes.tools.defaults import DEMO_DATA, DEMO_MODEL
from lit_spikes.tools.fit_plan import (
    ckpt_keyword_problem,
    config_problem,
    history_problem,
    run_length,
)

USER_MODEL = "tests.user_modules.LoggingRegressor"


def parsed(**changes: Any) -> dict[str, Any]:
    """A parsed ``fit`` section as LightningCLI hands it over (the dotted ``changes`` set)."""
    config: dict[str, Any] = {
        "checkpoint_every": 5,
        "num_threads": None,
        "model": {
            "class_path": DEMO_MODEL,
            "init_args": {"optim": OptimConfig(warmup_steps=4, max_steps=20)},
        },
        "data": {"class_path": DEMO_DATA, "init_args": {"config": {"batch_size": 4}}},
        "trainer": {
            "max_steps": -1,
            "enable_checkpointing": None,
            "default_root_dir": "",
            "devices": 1,
            "num_nodes": 1,
            "gradient_clip_val": None,
            "val_check_interval": 100,
        },
    }
    config = copy.deepcopy(config)
    for key, value in changes.items():
        *parents, last = key.split("__")
        section = config
        for parent in parents:
            section = section[parent]
        section[last] = value
    return config


@pytest.fixture
def root(tmp_path: Path) -> str:
    return str(tmp_path / "run")


@pytest.mark.parametrize(
    ("changes", "resume", "message"),
    [
        ({"checkpoint_every": -1}, None, "--checkpoint_every=-1 must be >= 0"),
        ({"trainer__max_steps": 0}, None, "--trainer.max_steps=0 must be positive"),
        ({"trainer__max_steps": -7}, None, "--trainer.max_steps=-7 must be positive"),
        ({}, 20, "--ckpt_path is at step 20, not before --trainer.max_steps=20"),
        ({"trainer__max_steps": 30}, 30, "is at step 30, not before --trainer.max_steps=30"),
        ({"trainer__enable_checkpointing": False}, None, "enable_checkpointing=false"),
        ({"trainer__val_check_interval": 0}, None, "val_check_interval=0 must be >= 1"),
        ({"trainer__gradient_clip_val": -1.0}, None, "gradient_clip_val=-1.0 must be"),
    ],
)
def test_a_bad_setting_is_named_with_its_value(
    root: str, changes: dict[str, Any], resume: int | None, message: str
) -> None:
    config = parsed(trainer__default_root_dir=root, **changes)
    problem = config_problem(config, "fit", resume)
    assert problem is not None and message in problem


@pytest.mark.parametrize(
    ("changes", "subcommand", "resume"),
    [
        ({}, "fit", None),
        ({}, "fit", 19),  # one step left
        ({}, "validate", 20),  # evaluates the final file: nothing to train
        ({"checkpoint_every": 0, "trainer__enable_checkpointing": False}, "fit", None),
        ({"trainer__devices": "2"}, "fit", None),  # batch 4 shards over 2
        ({"trainer__devices": "3", "data__class_path": "tests.user_modules.X"}, "fit", None),
        ({"model__class_path": USER_MODEL, "trainer__max_steps": None}, "fit", 10_000),
    ],
)
def test_a_good_configuration_passes(
    root: str, changes: dict[str, Any], subcommand: str, resume: int | None
) -> None:
    config = parsed(trainer__default_root_dir=root, **changes)
    assert config_problem(config, subcommand, resume) is None


def test_directories_that_cannot_take_the_runs_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    config = parsed(trainer__default_root_dir=str(tmp_path / "file" / "run"))
    assert "cannot be created" in str(config_problem(config, "fit", None))
    root = tmp_path / "run"
    root.mkdir()
    (root / "checkpoints").write_text("a file where the directory goes")
    config = parsed(trainer__default_root_dir=str(root))
    assert f"{root / 'checkpoints'} cannot be created" in str(config_problem(config, "fit", None))
    # validate writes no checkpoint, and neither does a fit without them
    assert config_problem(config, "validate", None) is None
    assert (
        config_problem(parsed(trainer__default_root_dir=str(root), checkpoint_every=0), "fit", None)
        is None
    )
    # the checks create nothing: a refused run leaves no directory behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run"]
    assert [p.name for p in root.iterdir()] == ["checkpoints"]


def test_the_run_length_is_the_schedules_for_the_demo_only() -> None:
    assert run_length(parsed()) == 20  # TinyGPT's schedule
    assert run_length(parsed(trainer__max_steps=7)) == 7
    assert run_length(parsed(model__class_path=USER_MODEL)) == -1
    assert run_length(parsed(model__class_path=USER_MODEL, trainer__max_steps=None)) == -1


@pytest.mark.parametrize("keyword", ["best", "hpc", "registry"])
def test_lightnings_keywords_for_files_never_written_are_refused(keyword: str) -> None:
    assert f"--ckpt_path {keyword}: Lightning's keyword" in str(ckpt_keyword_problem(keyword))


@pytest.mark.parametrize("path", [None, "latest", "last", "runs/fit/checkpoints/step=5.ckpt"])
def test_other_ckpt_paths_are_left_to_the_plan(path: str | None) -> None:
    assert ckpt_keyword_problem(path) is None


def write_run(root: Path, steps: list[int], events: bool) -> Path:
    directory = root / "checkpoints"
    directory.mkdir(parents=True)
    for step in steps:
        (directory / f"step={step}.ckpt").write_bytes(b"any")  # named, not read
    if events:
        (root / "events.out.tfevents.1.host").write_bytes(b"")
    return directory


def test_a_new_run_into_another_runs_directory_is_refused(tmp_path: Path) -> None:
    assert history_problem(tmp_path / "empty", None, None) is None
    write_run(tmp_path / "events", [], events=True)
    problem = history_problem(tmp_path / "events", None, None)
    assert "holds the TensorBoard events of a run (events.out.tfevents.1.host)" in str(problem)
    assert history_problem(tmp_path / "events", None, None, restart=True) is None
    write_run(tmp_path / "files", [5, 10], events=True)
    problem = history_problem(tmp_path / "files", None, None)
    assert "holds the checkpoints of a run (step=5 to step=10)" in str(problem)
    assert "--ckpt_path latest" in str(problem)
    # --ckpt_path last finding checkpoints resumes the newest, never restarts over them
    assert history_problem(tmp_path / "files", None, None, restart=True) is not None


def test_a_resume_must_continue_the_newest_file_of_its_directory(tmp_path: Path) -> None:
    directory = write_run(tmp_path / "run", [5, 10], events=True)
    assert history_problem(tmp_path / "run", str(directory / "step=10.ckpt"), 10) is None
    problem = history_problem(tmp_path / "run", str(directory / "step=5.ckpt"), 5)
    assert "is at step 5, but" in str(problem) and "later ones included" in str(problem)
    elsewhere = tmp_path / "copy" / "step=10.ckpt"
    assert "is not one of them" in str(history_problem(tmp_path / "run", str(elsewhere), 10))
    # a file from elsewhere into a directory of no run: a resume of that run, nothing mixed
    assert history_problem(tmp_path / "fresh", str(elsewhere), 10) is None
