"""``lit-spikes fit`` on a user's own module (tests/modules/fit_modules.py), in-process through
``lit_spikes.tools.cli.main``: killed and resumed it is the uninterrupted run bit for bit, two
identical commands train identical weights, ``--ckpt_path`` alone rebuilds the run from
its config.yaml, a usage error exits 2 and writes nothing, ``--exact_resume false`` opts
out. The decisions themselves (``lit_spikes.tools.fit_defaults``) are tested as functions."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ProgressBar

from lit_spikes.callbacks import ExactResume
from lit_spikes.shared.progress import StepProgressBar
from lit_spikes.tools.cli import main
from lit_spikes.tools.fit_defaults import (
    adds_exact_resume,
    length_problem,
    recorded_run_config,
    seed_for,
    threads_for,
)
from tests.conftest import load_ckpt, tb_scalars

NET, OWN_EXACT, DATA = (
    f"tests.modules.fit_modules.{n}" for n in ("DropoutNet", "OwnExactNet", "StepData")
)
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
STEPS, KILLED_AT = 12, 6
USER_RUN = ["--model", NET, "--data", DATA, "--trainer.max_steps", str(STEPS)]
USER_RUN += ["--checkpoint_every", str(KILLED_AT)]


def fit(root: Path, *args: str) -> Any:
    return main(["fit", *args, *QUIET, "--trainer.default_root_dir", str(root)])


def assert_tensors_equal(a: Any, b: Any, where: str = "checkpoint") -> None:
    """Every tensor of two checkpoints (weights, AdamW state, callbacks' states) equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_tensors_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tensors_equal(x, y, f"{where}[{index}]")


def final_state(root: Path) -> dict[str, Any]:
    checkpoint = load_ckpt(root / "checkpoints" / f"step={STEPS}.ckpt")
    return {k: checkpoint[k] for k in ("state_dict", "optimizer_states", "global_step")}


def killed_copy(run: Path, to: Path) -> Path:
    """``run`` as a run killed after its step-``KILLED_AT`` checkpoint left it: that file
    and the run's config.yaml."""
    (to / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", to / "config.yaml")
    name = f"step={KILLED_AT}.ckpt"
    return Path(shutil.copy(run / "checkpoints" / name, to / "checkpoints" / name))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fit_own") / "uninterrupted"
    fit(root, *USER_RUN)
    return root


def test_a_users_run_killed_and_resumed_is_the_uninterrupted_one(
    uninterrupted: Path, tmp_path: Path
) -> None:
    ckpt = killed_copy(uninterrupted, tmp_path / "resumed")
    torch.manual_seed(1234)  # what this process drew since: a resume must not depend on it
    fit(tmp_path / "resumed", *USER_RUN, "--ckpt_path", str(ckpt))
    assert_tensors_equal(final_state(uninterrupted), final_state(tmp_path / "resumed"))


def test_two_identical_commands_train_identical_weights(
    uninterrupted: Path, tmp_path: Path
) -> None:
    torch.manual_seed(99)
    fit(tmp_path / "again", *USER_RUN)
    assert_tensors_equal(final_state(uninterrupted), final_state(tmp_path / "again"))


DRAWING = ["--model", "tests.modules.drawing_runs.DrawingNet", "--data",
           "tests.modules.drawing_runs.DrawingData", "--trainer.max_steps", str(STEPS),
           "--trainer.gradient_clip_val", "0.5"]  # fmt: skip
"""A module that draws everywhere (dropout, augmentation, a validation that draws)."""


def test_fit_trains_one_run_whatever_watches_it(tmp_path: Path) -> None:
    """Issue 53 through the command line: files every 4 steps and no validation, or files
    every 5 (and the final one) and a validation every 3 steps, end in one run."""
    fit(tmp_path / "a", *DRAWING, "--checkpoint_every", "4", "--trainer.limit_val_batches", "0")
    fit(tmp_path / "b", *DRAWING, "--checkpoint_every", "5", "--trainer.val_check_interval", "3",
        "--trainer.check_val_every_n_epoch", "null")  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == [
        "step=10.ckpt", "step=12.ckpt", "step=5.ckpt"
    ]  # fmt: skip
    assert_tensors_equal(final_state(tmp_path / "a"), final_state(tmp_path / "b"))


@pytest.mark.parametrize("how", ["latest", "file"])
def test_ckpt_path_alone_rebuilds_a_users_run_from_its_record(
    uninterrupted: Path, tmp_path: Path, how: str
) -> None:
    ckpt = killed_copy(uninterrupted, tmp_path / "resumed")
    torch.manual_seed(7)
    cli = fit(tmp_path / "resumed", "--ckpt_path", "latest" if how == "latest" else str(ckpt))
    assert type(cli.model).__name__ == "DropoutNet" and cli.trainer.max_steps == STEPS
    # the plan, found once: the file ("latest" resolved), its step, its callbacks' record
    assert cli.plan.path == str(ckpt) and cli.plan.step == KILLED_AT
    assert cli.plan.checkpoint is not None and cli.plan.record is not None
    assert_tensors_equal(final_state(uninterrupted), final_state(tmp_path / "resumed"))


def test_ckpt_path_last_alone_restarts_a_users_run_killed_before_its_first_file(
    uninterrupted: Path, tmp_path: Path
) -> None:
    (tmp_path / "requeued").mkdir()  # config.yaml is written at the fit's start
    shutil.copy(uninterrupted / "config.yaml", tmp_path / "requeued" / "config.yaml")
    cli = fit(tmp_path / "requeued", "--ckpt_path", "last")
    assert type(cli.model).__name__ == "DropoutNet"
    assert_tensors_equal(final_state(uninterrupted), final_state(tmp_path / "requeued"))


@pytest.mark.parametrize(
    "args",
    [
        ["--model", NET, "--data", DATA],  # the README's line as it was: no length
        ["--model", NET, "--data", DATA, "--trainer.max_steps", "4", "--num_threads", "0"],
        ["--trainer.max_steps", "4", "--num_threads", "2"],  # TinyGPT: --model.num_threads
        ["--model", NET, "--data", DATA, "--trainer.max_steps", "4", "--exact_resume", "maybe"],
        ["--model", NET, "--data", DATA, "--trainer.max_steps", "4", "--checkpoint_every", "-1"],
        ["--model", NET, "--data", DATA, "--trainer.max_epochs", "1", "--trainer.max_steps", "0"],
    ],
)
def test_a_usage_error_exits_2_and_leaves_no_run_directory(
    tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path / "run", *args)
    assert exit_info.value.code == 2
    assert not (tmp_path / "run").exists()
    assert "Traceback" not in capsys.readouterr().err


def test_a_users_file_without_its_record_names_the_classes_to_give(
    uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "copy" / "checkpoints").mkdir(parents=True)
    ckpt = shutil.copy(
        uninterrupted / "checkpoints" / "step=6.ckpt", tmp_path / "copy" / "checkpoints"
    )
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path / "copy", "--ckpt_path", str(ckpt))
    assert exit_info.value.code == 2
    assert "--model CLASS_PATH and --data CLASS_PATH" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "copy").rglob("*")) == ["checkpoints", "step=6.ckpt"]


def _exact_resumes(cli: Any) -> list[Any]:
    return [c for c in cli.trainer.callbacks if isinstance(c, ExactResume)]


def test_exact_resume_is_added_once_and_can_be_turned_off(tmp_path: Path) -> None:
    one = ["--trainer.max_steps", "1", "--checkpoint_every", "0", "--data", DATA]
    torch.set_num_threads(2)
    try:
        assert len(_exact_resumes(fit(tmp_path / "a", "--model", NET, *one))) == 1
        assert torch.get_num_threads() == 1  # as the demo's module sets them
    finally:
        torch.set_num_threads(1)
    assert (
        _exact_resumes(fit(tmp_path / "b", "--model", NET, *one, "--exact_resume", "false")) == []
    )
    # the module's own (configure_callbacks) or the config's: that one only
    own = fit(tmp_path / "c", "--model", OWN_EXACT, *one)
    assert len(_exact_resumes(own)) == 1
    given = ["--trainer.callbacks+=lit_spikes.callbacks.ExactResume"]
    assert len(_exact_resumes(fit(tmp_path / "d", "--model", NET, *one, *given))) == 1


def test_a_users_run_bounded_by_epochs_trains_with_lightnings_bar(tmp_path: Path) -> None:
    args = ["fit", "--model", NET, "--data", DATA, "--trainer.max_epochs", "1"]
    cli = main([*args, "--checkpoint_every", "0", "--trainer.default_root_dir", str(tmp_path)])
    bars = [c for c in cli.trainer.callbacks if isinstance(c, ProgressBar)]
    assert bars and not any(isinstance(b, StepProgressBar) for b in bars)
    assert cli.trainer.global_step == 12  # one data epoch of StepData


def test_the_decisions_for_a_users_module() -> None:
    assert seed_for(None, own_model=False) == 0 and seed_for(None, own_model=True) is False
    assert seed_for(7, own_model=False) == 7 and seed_for(False, own_model=False) is False
    assert threads_for(None, own_model=False) == (1, None)
    assert threads_for(3, own_model=False) == (3, None)
    assert threads_for(None, own_model=True) == (None, None)
    assert "--model.num_threads 2" in str(threads_for(2, own_model=True)[1])
    assert "must be >= 1" in str(threads_for(0, own_model=False)[1])
    assert "--trainer.max_steps" in str(length_problem("m.Net", {"max_steps": -1}))
    for bound in ({"max_steps": 5}, {"max_epochs": 2}, {"max_time": "00:01:00:00"}):
        assert length_problem("m.Net", {"max_steps": -1, **bound}) is None
    mine = {"model": {"class_path": NET}, "exact_resume": True}
    assert adds_exact_resume(mine, configured=[])
    assert not adds_exact_resume(mine | {"exact_resume": False}, configured=[])
    assert not adds_exact_resume(mine, configured=[ExactResume()])
    demo = {"model": {"class_path": "lit_spikes.demo.module.TinyGPTModule"}, "exact_resume": True}
    assert not adds_exact_resume(demo, configured=[])


def test_a_users_record_gives_model_data_length_and_numerics() -> None:
    model = {"class_path": NET, "init_args": {"hidden": 8}}
    record = {
        "model": model,
        "data": {"class_path": DATA},
        "seed_everything": 0,
        "num_threads": 1,
        "exact_resume": True,
        "trainer": {"max_steps": 30, "default_root_dir": "runs/x", "callbacks": [], "devices": 1},
    }
    saved = recorded_run_config(record)
    assert saved["model"] == model and saved["data"] == {"class_path": DATA}
    assert saved["trainer.max_steps"] == 30 and saved["trainer.devices"] == 1
    assert saved["seed_everything"] == 0 and saved["num_threads"] == 1
    assert "trainer.default_root_dir" not in saved and "trainer.callbacks" not in saved
    # The project's module's record too: a requeue of the demo dropped its settings
    own = {"model": {"class_path": "lit_spikes.demo.module.TinyGPTModule"}, "checkpoint_every": 10}
    assert recorded_run_config(own)["checkpoint_every"] == 10
    assert recorded_run_config({}) == {}


def test_fit_shows_lr_and_grad_norm_for_a_users_module(uninterrupted: Path) -> None:
    # The module logs neither: fit's TrainingCurves draws both at Lightning's logging steps.
    scalars = tb_scalars(uninterrupted)
    for tag in ("lr", "grad_norm"):
        assert scalars.get(tag), f"no {tag!r} curve in {sorted(scalars)}"
        assert all(math.isfinite(value) and value > 0 for _, value in scalars[tag]), tag


def test_a_users_module_given_no_data_is_refused_before_any_file(tmp_path: Path) -> None:
    """``--model`` of the user's without ``--data`` trained on the project's text and
    crashed in the module's ``training_step`` ("too many values to unpack"), its files
    written. In a new process, as a user types it."""
    import subprocess
    import sys

    from tests.conftest import REPO

    root = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "lit_spikes.tools.cli", "fit", "--model", NET,
         "--trainer.max_steps", "3", "--trainer.default_root_dir", str(root)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--model {NET} has no train_dataloader and no --data was given" in done.stderr
    assert "too many values" not in done.stderr and not root.exists()


def test_a_users_module_with_its_own_loader_needs_no_data(tmp_path: Path) -> None:
    """Its own ``train_dataloader`` (``--data null`` is not needed), recorded as such: the
    requeue with ``--ckpt_path`` alone trains on it too."""
    own = "tests.modules.fit_modules.SelfFedNet"
    run = [*QUIET, "--model", own, "--trainer.max_steps", "6", "--checkpoint_every", "3"]
    whole = main(["fit", *run, "--trainer.default_root_dir", str(tmp_path / "whole")])
    assert whole is not None and whole.datamodule is None and whole.trainer.global_step == 6
    main(["fit", *run, "--trainer.max_steps", "3", "--trainer.default_root_dir",
          str(tmp_path / "cut")])  # fmt: skip
    ckpt = tmp_path / "cut" / "checkpoints" / "step=3.ckpt"
    resumed = main(["fit", *QUIET, "--trainer.max_steps", "6", "--ckpt_path", str(ckpt),
                    "--trainer.default_root_dir", str(tmp_path / "resumed")])  # fmt: skip
    assert resumed is not None and resumed.datamodule is None
    whole_file = load_ckpt(tmp_path / "whole" / "checkpoints" / "step=6.ckpt")
    assert_tensors_equal(whole_file["state_dict"], final_file(tmp_path / "resumed"))


def final_file(root: Path) -> Any:
    return load_ckpt(root / "checkpoints" / "step=6.ckpt")["state_dict"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "tests.modules.fit_modules.SelfFedNet"],
         "--model tests.modules.fit_modules.SelfFedNet, but the checkpoint's run trained "
         f"{NET}"),
        (["--model.hidden", "8"],
         "holds the weights of another module than DropoutNet of these settings "
         "(net.0.bias: (16,) in the file, (8,) here"),
    ],
    ids=["another-class-same-shapes", "other-shapes"],
)  # fmt: skip
def test_a_file_of_another_module_is_refused_before_any_file(
    uninterrupted: Path, tmp_path: Path, args: list[str], message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Another class of the same shapes resumed without a word; other shapes gave
    load_state_dict's traceback after the run's files were written."""
    ckpt = uninterrupted / "checkpoints" / f"step={KILLED_AT}.ckpt"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path / "other", *args, "--ckpt_path", str(ckpt))
    assert exit_info.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "other").exists()


def test_accumulation_with_a_step_loader_is_refused_before_any_file(tmp_path: Path) -> None:
    """It was ExactResume's error at the first step, after config.yaml, the events and
    hparams.yaml were written (and a requeue then read the bad value back from that
    config.yaml). A plain DataLoader accumulates as Lightning does."""
    accumulate = ["--trainer.accumulate_grad_batches", "2", "--trainer.max_steps", "3"]
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path / "step", "--model", NET, "--data", DATA, *accumulate)
    assert exit_info.value.code == 2 and not (tmp_path / "step").exists()
    plain = ["--model", "lit_spikes.testing.examples.Regressor", "--data",
             "lit_spikes.testing.examples.ShuffledData"]  # fmt: skip
    cli = fit(tmp_path / "plain", *plain, *accumulate)
    assert cli.trainer.global_step == 3 and cli.trainer.accumulate_grad_batches == 2
