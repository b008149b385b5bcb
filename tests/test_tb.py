"""The step logger: TensorBoard reads the same scalars as from Lightning's own logger."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from lit_spikes.tb import TensorBoardStepLogger
from tests.conftest import tb_scalars

STEPS = [
    {"train/loss": torch.tensor(3.25), "lr": 0.1, "data/position": 7},
    {"train/loss": torch.tensor(float("inf")), "lr": 1e-3, "skipped": True},
    {"val/bpc": 1.5},
]


def _log(logger: TensorBoardLogger) -> None:
    for step, metrics in enumerate(STEPS):
        logger.log_metrics(metrics, step=step)
    logger.finalize("success")


def _summaries(run_dir: Path) -> list[int]:
    """How many values each event with a summary holds, in file order."""
    (events,) = run_dir.glob("events.out.tfevents.*")
    return [len(e.summary.value) for e in EventFileLoader(str(events)).Load() if e.summary.value]


def test_same_scalars_as_tensorboard_logger_in_one_event_per_call(tmp_path: Path) -> None:
    for cls, name in ((TensorBoardLogger, "lightning"), (TensorBoardStepLogger, "step")):
        _log(cls(str(tmp_path), name=name, version="", prefix="run", default_hp_metric=False))
    expected = tb_scalars(tmp_path / "lightning")
    assert expected.keys() == {"run-train/loss", "run-lr", "run-data/position", "run-skipped"} | {
        "run-val/bpc"
    }
    assert tb_scalars(tmp_path / "step") == expected  # tags, steps and values, bit for bit
    assert _summaries(tmp_path / "lightning") == [1, 1, 1, 1, 1, 1, 1]
    assert _summaries(tmp_path / "step") == [3, 3, 1]


def test_non_scalar_values_go_through_tensorboard_logger(tmp_path: Path) -> None:
    logger = TensorBoardStepLogger(str(tmp_path), name="run", version="")
    logger.log_metrics({"loss": 1.0, "pair": {"a": 1.0, "b": 2.0}}, step=0)  # type: ignore[dict-item]
    logger.finalize("success")
    assert tb_scalars(tmp_path / "run") == {"loss": [(0, 1.0)]}
    # add_scalars writes each entry of the dict as a run of its own: run/pair_a, run/pair_b
    assert tb_scalars(tmp_path / "run" / "pair_a") == {"pair": [(0, 1.0)]}
