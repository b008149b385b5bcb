"""`lit-spikes fit --model CLASS_PATH --data CLASS_PATH`: any LightningModule and
LightningDataModule, written as users write them, trains and resumes bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

from lit_spikes import StepLoader
from lit_spikes.tools.cli import build_cli, main
from tests.conftest import REPO, assert_states_equal, load_ckpt
from tests.modules.user_modules import regression_data


class RegressionData(pl.LightningDataModule):
    """A user's DataModule: a dataset and a ``StepLoader`` over it, nothing else."""

    def __init__(self, batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.seed = batch_size, seed

    def train_dataloader(self) -> StepLoader:
        return StepLoader(regression_data(), batch_size=self.batch_size, seed=self.seed)


USER_RUN = [
    "fit",
    "--model",
    "tests.modules.user_modules.DropoutRegressor",
    "--model.init_args.hidden",
    "8",
    "--data",
    "tests.tools.test_cli_models.RegressionData",
    "--data.batch_size",
    "4",
    "--trainer.callbacks+=lit_spikes.callbacks.SpikeDetector",
    "--trainer.callbacks+=lit_spikes.callbacks.ExactResume",
    "--checkpoint_every",
    "5",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
]
"""A user's module and data (a StepLoader of 24 steps an epoch) with the callbacks."""


def _fit_in_a_process(args: list[str]) -> None:
    script = "import sys; from lit_spikes.tools.cli import main; sys.exit(main())"
    # importable wherever: jsonargparse imports a --config file's classes from its folder
    # The process settings of the run it resumes (this one's): a user's module sets none.
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_users_module_and_data_resume_in_another_process_bit_exactly(tmp_path: Path) -> None:
    """30 steps straight, and 17 then, in another process, the same command with
    --ckpt_path latest (what a preempted run prints): from step=17.ckpt, off the interval,
    the same parameters, AdamW and LR schedule, bit for bit; the module trained with none
    of TinyGPT's steps (30 is over an epoch)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    cli = main([*USER_RUN, "--trainer.max_steps", "30", "--trainer.default_root_dir", str(full)])
    assert cli is not None and cli.trainer.global_step == 30
    assert type(cli.model).__name__ == "DropoutRegressor" and cli.model.hparams["hidden"] == 8
    main([*USER_RUN, "--trainer.max_steps", "17", "--trainer.default_root_dir", str(cut)])
    files = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert files == ["step=10.ckpt", "step=15.ckpt", "step=17.ckpt", "step=5.ckpt"]
    # the run's config.yaml names the classes, as --config takes them again
    saved = yaml.safe_load((cut / "config.yaml").read_text())
    assert saved["model"]["class_path"] == "tests.modules.user_modules.DropoutRegressor"
    assert saved["data"]["init_args"] == {"batch_size": 4, "seed": 0}
    # its callbacks listed there and given again by the command: each once
    resume = ["--trainer.max_steps", "30", "--trainer.default_root_dir", str(cut)]
    _fit_in_a_process([*USER_RUN, *resume, "--ckpt_path", "latest"])
    straight, resumed = (load_ckpt(root / "checkpoints" / "step=30.ckpt") for root in (full, cut))
    assert_states_equal(straight, resumed)  # torch.equal on every parameter and state
    assert straight["callbacks"].keys() == resumed["callbacks"].keys()
    given = [key for key in straight["callbacks"] if str(key).startswith(("Spike", "Exact"))]
    assert len(given) == 2
    for key in given:  # the detector's history went on, once; the RNG states the same
        a, b = (dict(run["callbacks"][key]) for run in (straight, resumed))
        # The fingerprint is the process's (this one's settings, earlier tests' included),
        # not the run's state: the resume warns where it differs.
        a.pop("fingerprint", None), b.pop("fingerprint", None)
        assert _same(a, b), key


def _same(a: Any, b: Any) -> bool:
    """Bit-equal, tensors (torch.equal) and containers of them included."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_a_users_module_gets_none_of_the_tiny_gpts_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """max_steps -1 stays Lightning's (no schedule to end with), no FLOPs input of
    TinyGPT's, --data null leaves the module's own dataloaders, and an error of the
    user's class is one line naming it."""
    parsed = build_cli([*USER_RUN[1:], "--trainer.max_epochs", "2"], run=False)
    assert parsed.trainer.max_steps == -1 and parsed.trainer.max_epochs == 2
    assert parsed.model.example_input_array is None  # no TinyGPT FLOPs input
    assert build_cli([*USER_RUN[1:], "--data", "null"], run=False).datamodule is None
    with pytest.raises(SystemExit) as exit_info:
        main([*USER_RUN, "--model.init_args.hiden", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--model tests.modules.user_modules.DropoutRegressor: Option 'hiden' is not accepted" in err
    )
    assert "(did you mean --model.hidden?)" in err and "NoneType" not in err


@pytest.mark.parametrize("spelling", ["short", "init_args", "config"])
def test_the_default_model_keeps_every_spelling(
    tmp_path: Path, spelling: str, tiny: dict[str, Any]
) -> None:
    """TinyGPTModule and StepDataModule stay the defaults: --model.gpt.n_layer, the
    subclass form --model.init_args.gpt.n_layer and a --config of either form."""
    args = {
        "short": ["--model.gpt.n_layer", "2", "--data.config.seed", "5"],
        "init_args": ["--model.init_args.gpt.n_layer", "2", "--data.init_args.config.seed", "5"],
    }.get(spelling)
    if args is None:
        model = {"class_path": "lit_spikes.demo.module.TinyGPTModule"}
        model["init_args"] = {"gpt": {"n_layer": 2}}  # type: ignore[assignment]
        config = {"model": model, "data": {"config": {"seed": 5}}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
        args = ["--config", str(tmp_path / "c.yaml")]
    parsed = build_cli(args, run=False)
    assert parsed.model.model_config.n_layer == 2 and parsed.datamodule.config.seed == 5
    assert parsed.trainer.max_steps == 400  # the schedule's end, as before


def test_a_config_file_names_a_users_classes(tmp_path: Path) -> None:
    model = {
        "class_path": "tests.modules.user_modules.DropoutRegressor",
        "init_args": {"hidden": 4},
    }
    data = {"class_path": "tests.tools.test_cli_models.RegressionData", "init_args": {"seed": 2}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": model, "data": data}))
    parsed = build_cli(["--config", str(tmp_path / "c.yaml")], run=False)
    assert parsed.model.hparams["hidden"] == 4 and parsed.datamodule.seed == 2
