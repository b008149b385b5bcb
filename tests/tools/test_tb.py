"""TensorBoard: the module logs through Lightning's self.log to any logger; RunLogger is
Lightning's TensorBoardLogger less the constant ``epoch`` and ``hp_metric`` tags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from lit_spikes.demo.data import StepDataModule
from lit_spikes.demo.module import LOGGED_AS, STEP_SCALARS, TinyGPTModule
from lit_spikes.demo.tensorboard import HPARAM_METRIC
from lit_spikes.shared.tb import RunLogger, flat_hparams
from tests.conftest import TINY_DATA, TINY_GPT, TINY_OPTIM, fit, tb_marks, tb_scalars

STEP_TAGS = {"train/loss", "train/max_logit", "lr", "grad_norm", "data/position"}


def _fit(logger: Logger | None, steps: int = 6, **trainer_kwargs: Any) -> TinyGPTModule:
    module = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    kwargs: dict[str, Any] = {
        "max_steps": steps,
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
    }
    trainer = pl.Trainer(logger=logger, **(kwargs | trainer_kwargs))
    trainer.fit(module, datamodule=StepDataModule(TINY_DATA))
    return module


def test_every_step_scalar_is_the_history_value_at_its_step(tmp_path: Path) -> None:
    """The TensorBoard tags of the demos' views, each step's value the one in ``history``
    (as TensorBoard stores it, a float32), and no ``epoch`` or ``hp_metric`` tag."""
    run = fit(tmp_path, "run", 6)
    scalars = tb_scalars(run.spec.run_dir)
    assert scalars.keys() == STEP_TAGS
    for key in STEP_SCALARS:
        expected = [(int(r["step"]), float(np.float32(r[key]))) for r in run.module.history]
        assert scalars[LOGGED_AS.get(key, key)] == expected, key


def test_lightnings_own_logger_adds_the_epoch_tag_run_logger_drops(tmp_path: Path) -> None:
    """Why RunLogger exists: TensorBoardLogger gets Lightning's ``hp_metric`` (-1) and,
    with each value Lightning logs (val/bpc), its ``epoch`` (always 0 here); the module
    logs the same step tags to either."""
    _fit(TensorBoardLogger(str(tmp_path), name="lightning", version=""))
    _fit(RunLogger(str(tmp_path), name="run", version=""))
    lightning = tb_scalars(tmp_path / "lightning")
    assert lightning.keys() >= STEP_TAGS | {"hp_metric"}
    assert tb_scalars(tmp_path / "run") == {k: v for k, v in lightning.items() if k in STEP_TAGS}


def test_a_prefix_goes_on_every_tag_as_lightnings_own_logger_puts_it(tmp_path: Path) -> None:
    """RunLogger applies ``prefix`` itself (Lightning's logger keeps its own private):
    the same prefixed step tags as TensorBoardLogger's, written as one event a step."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    _fit(TensorBoardLogger(str(tmp_path), name="lightning", version="", prefix="p"))
    logger = RunLogger(str(tmp_path), name="run", version="", prefix="p")
    assert logger.prefix == "p"
    _fit(logger)
    lightning = tb_scalars(tmp_path / "lightning")
    prefixed = {f"p-{tag}" for tag in STEP_TAGS}
    assert lightning.keys() == prefixed | {"p-hp_metric"}
    assert tb_scalars(tmp_path / "run") == {k: v for k, v in lightning.items() if k in prefixed}
    (events,) = (tmp_path / "run").glob("events.out.tfevents.*")
    steps = [e.step for e in EventFileLoader(str(events)).Load() if e.summary.value]
    assert steps == list(range(6))


def test_the_module_logs_to_any_lightning_logger(tmp_path: Path) -> None:
    """No logger class of this project is needed: a CSVLogger gets every step's tags."""
    import csv

    logger = CSVLogger(str(tmp_path), name="csv", version="")
    module = _fit(logger)
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["step"]) for row in rows] == [int(r["step"]) for r in module.history]
    assert rows[0].keys() >= STEP_TAGS


@pytest.mark.parametrize(("bar", "every"), [(True, 5), (False, 5), (True, 1), (False, 1)])
def test_every_step_scalar_follows_log_every_n_steps_with_or_without_a_bar(
    tmp_path: Path, bar: bool, every: int
) -> None:
    """Every per-step tag at the steps Lightning logs self.log values, with a progress
    bar or without (the bar shows train/loss, which callbacks find in callback_metrics)."""
    module = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    trainer = pl.Trainer(
        max_steps=12,
        logger=RunLogger(str(tmp_path), name="run", version=""),
        log_every_n_steps=every,
        enable_progress_bar=bar,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=StepDataModule(TINY_DATA))
    scalars = tb_scalars(tmp_path / "run")
    expected = [step for step in range(12) if (step + 1) % every == 0]
    for tag in STEP_TAGS:
        assert [step for step, _ in scalars[tag]] == expected, tag
    assert float(trainer.callback_metrics["train/loss"]) == module.history[-1]["loss"]


def test_a_cli_run_records_its_final_val_bpc_as_the_hparams_metric(tmp_path: Path) -> None:
    """RunLogger (as the CLI builds it): the HPARAMS view's metric is ``hp/val_bpc``, the
    last validation's value at its step, as in the demos' rows; no ``hp_metric = -1``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = RunLogger(str(tmp_path), name="run", version="", hparams_metric="val/bpc")
    _fit(logger, steps=6, limit_val_batches=1, val_check_interval=3, check_val_every_n_epoch=None)
    scalars = tb_scalars(tmp_path / "run")
    assert "hp_metric" not in scalars and "epoch" not in scalars
    assert [step for step, _ in scalars["val/bpc"]] == [2, 5]
    assert scalars[HPARAM_METRIC] == [scalars["val/bpc"][-1]]
    accumulator = EventAccumulator(str(tmp_path / "run"))
    accumulator.Reload()
    (plugin,) = (
        accumulator.PluginTagToContent("hparams").keys()
        - {"_hparams_/experiment"}
        - {"_hparams_/session_end_info"}
    )
    assert plugin == "_hparams_/session_start_info"


def test_no_hparams_metric_where_the_caller_records_its_own(tmp_path: Path) -> None:
    """RunSpec's logger (the demos' branch runner writes each row's own hparams)."""
    run = fit(tmp_path, "run", 6, val_every=3, limit_val_batches=1)
    assert HPARAM_METRIC not in tb_scalars(run.spec.run_dir)
    assert [step for step, _ in tb_scalars(run.spec.run_dir)["val/bpc"]] == [2, 5]


def test_flat_hparams_are_scalars_tensorboard_takes() -> None:
    params = {"gpt": {"n_layer": 2, "dropout": 0.0}, "flag": True, "seq": [1, 2], "x": None}
    flat = flat_hparams(params)
    assert flat == {"gpt/n_layer": 2, "gpt/dropout": 0.0, "flag": True, "seq": "[1, 2]"} | {
        "x": "None"
    }


def test_a_runs_final_metric_survives_the_purge_of_a_file_named_after_it(tmp_path: Path) -> None:
    """TensorBoard reads a run's files in name order; a resumed run's file starts with a
    purge of the steps it repeats. The hparams file, written last, must be read last,
    even when its name would sort first (files of one second differ in a counter only,
    compared as text: it once made the main job's hp/val_bpc vanish in tiny runs)."""
    from torch.utils.tensorboard import SummaryWriter

    from lit_spikes.shared.tb import write_hparams

    with SummaryWriter(log_dir=str(tmp_path), purge_step=20) as resumed:  # purges >= 20
        resumed.add_scalar("train/loss", 1.0, 20)
    (purging,) = tmp_path.glob("events.out.tfevents.*")
    purging.rename(tmp_path / "events.out.tfevents.9999999999.zz.1.9")  # sorts after any
    write_hparams(tmp_path, {"row": "resumed"}, 1.25, step=39, tag=HPARAM_METRIC)
    assert tb_scalars(tmp_path)[HPARAM_METRIC] == [(39, 1.25)]


def test_a_users_run_shows_spikes_on_their_curve_and_lr_and_grad_norm(tmp_path: Path) -> None:
    """A user's regression with an 8x LR for 2 steps at step 112: the default rule flags
    the jump and no healthy step; each episode's onset is a one-point run of its own
    (``spikes/step_<k>``) under the curve's own tag, at its reference, its aftermath no
    more marks; ``TrainingCurves`` logs
    ``lr`` and ``grad_norm`` at Lightning's logging steps only."""
    from lit_spikes.callbacks import SpikeDetector
    from lit_spikes.callbacks.curves import TrainingCurves
    from tests.modules.spiky_modules import JumpRegressor, StepRegressionData

    detector = SpikeDetector()  # the module logs its loss as "loss": that curve's chart
    trainer = pl.Trainer(
        max_steps=130,
        accelerator="cpu",
        logger=RunLogger(save_dir=str(tmp_path), name="run", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[detector, TrainingCurves()],
        log_every_n_steps=10,
    )
    module = JumpRegressor(jump_step=112, jump=8.0, jump_length=2)
    trainer.fit(module, datamodule=StepRegressionData())
    spikes = [(s["step"], s["value"]) for s in detector.spikes]
    assert spikes and all(112 <= step < 125 for step, _ in spikes), spikes
    marks = tb_marks(tmp_path / "run")
    assert list(marks) == ["loss"]
    onsets = [(s.step, s.value) for e in detector.episodes for s in [e.onset]]
    assert [step for step, _ in marks["loss"]] == [step for step, _ in onsets]
    feet = zip(marks["loss"], onsets, strict=True)
    assert all(mark < value for (_, mark), (_, value) in feet)  # at its reference
    assert len(onsets) == 1
    scalars = tb_scalars(tmp_path / "run")
    logging_steps = list(range(9, 130, 10))
    assert [step for step, _ in scalars["lr"]] == logging_steps
    assert [step for step, _ in scalars["grad_norm"]] == logging_steps
    assert [v for _, v in scalars["lr"]] == [
        float(np.float32(0.1 * module.factor(s))) for s in logging_steps
    ]
