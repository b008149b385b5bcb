"""The step logger: TensorBoard reads the same scalars as from Lightning's own logger."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from lit_spikes.tb import TensorBoardStepLogger
from tests.conftest import fit, tb_scalars

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
    logger.log_metrics({"loss": 1.0, "pair": {"a": 1.0, "b": 2.0}}, step=0)
    logger.finalize("success")
    assert tb_scalars(tmp_path / "run") == {"loss": [(0, 1.0)]}
    # add_scalars writes each entry of the dict as a run of its own: run/pair_a, run/pair_b
    assert tb_scalars(tmp_path / "run" / "pair_a") == {"pair": [(0, 1.0)]}


def test_waiting_events_are_written_past_max_pending_before_others_and_at_finalize(
    tmp_path: Path,
) -> None:
    logger = TensorBoardStepLogger(str(tmp_path), name="run", version="", max_pending=3)
    for step in range(4):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.save()  # flushes what the writer has: the first three, handed over at step 2
    assert tb_scalars(tmp_path / "run") == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0)]}
    logger.log_metrics({"pair": {"a": 1.0}}, step=4)
    logger.save()  # a dict goes at once, after the scalars waiting before it
    assert [s for s, _ in tb_scalars(tmp_path / "run")["loss"]] == [0, 1, 2, 3]
    logger.log_metrics({"loss": 5.0}, step=5)
    logger.finalize("success")
    assert [s for s, _ in tb_scalars(tmp_path / "run")["loss"]] == [0, 1, 2, 3, 5]
    with pytest.raises(ValueError, match="max_pending=0 must be >= 1"):
        TensorBoardStepLogger(str(tmp_path), max_pending=0)
    with pytest.raises(ValueError, match="hand_over_every=0 must be >= 1"):
        TensorBoardStepLogger(str(tmp_path), hand_over_every=0)


def test_steps_reach_the_writer_at_a_backward_every_hand_over_every_steps(
    tmp_path: Path,
) -> None:
    """TinyGPTModule hands the waiting steps to the logger's helper thread right before a
    backward pass, once the logger's ``hand_over_every`` of them wait: not at a step's
    end, and not every step."""
    every = 4
    logger = TensorBoardStepLogger(
        str(tmp_path), name="run", version="", default_hp_metric=False, hand_over_every=every
    )
    written: dict[tuple[str, int], list[int]] = {}

    class Probe(Callback):  # callback hooks run before the module's
        def _read(self, trainer: pl.Trainer, when: str) -> None:
            trainer.logger.save()  # waits for what was handed over, and flushes it
            steps = tb_scalars(trainer.log_dir).get("train/loss", [])
            written[when, trainer.global_step] = [step for step, _ in steps]

        def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
            self._read(trainer, "before backward")

        def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
            self._read(trainer, "after backward")

    steps = 2 * every + 3
    run = fit(tmp_path, "run", steps, callbacks=[Probe()], logger=logger)
    for k in range(steps):
        assert written["before backward", k] == list(range(every * ((k - 1) // every))), k
        assert written["after backward", k] == list(range(every * (k // every))), k
    assert [s for s, _ in tb_scalars(run.spec.run_dir)["train/loss"]] == list(range(steps))


def test_events_are_built_and_written_off_the_loops_thread(tmp_path: Path) -> None:
    """The loop only keeps a step's numbers: the helper thread builds and adds the event."""
    import threading

    logger = TensorBoardStepLogger(str(tmp_path), name="run", version="")
    writer = logger.experiment._get_file_writer()
    threads: list[str] = []
    add_summary = writer.add_summary

    def recording(*args: Any, **kwargs: Any) -> None:
        threads.append(threading.current_thread().name)
        add_summary(*args, **kwargs)

    writer.add_summary = recording
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step=step)
        logger.write_pending()
    logger.finalize("success")
    assert threads == ["tb-step-events"] * 3
    assert tb_scalars(tmp_path / "run") == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0)]}


def _break_writer(logger: TensorBoardStepLogger) -> None:
    """Every event the logger's helper adds from now on fails, as on a full disk."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    logger.experiment._get_file_writer().add_summary = broken


def test_a_failed_write_is_raised_by_the_next_call(tmp_path: Path) -> None:
    logger = TensorBoardStepLogger(str(tmp_path), name="run", version="")
    _break_writer(logger)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.write_pending()
    with pytest.raises(RuntimeError, match="writing TensorBoard step events failed") as error:
        logger.save()
    assert isinstance(error.value.__cause__, OSError)


def test_the_logger_pickles_without_its_thread(tmp_path: Path) -> None:
    import pickle

    logger = TensorBoardStepLogger(str(tmp_path), name="run", version="")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.write_pending()
    copy = pickle.loads(pickle.dumps(logger))
    copy.log_metrics({"loss": 2.0}, step=1)
    copy.finalize("success")
    logger.finalize("success")
    assert sorted(tb_scalars(tmp_path / "run")["loss"]) == [(0, 1.0), (1, 2.0)]


@pytest.mark.parametrize("status", ["success", "failed"])
def test_finalize_closes_the_file_even_after_a_failed_write(tmp_path: Path, status: str) -> None:
    """A failed run's own error is not replaced by a write error: finalize warns then."""
    logger = TensorBoardStepLogger(str(tmp_path), name="run", version="")
    _break_writer(logger)
    logger.log_metrics({"loss": 1.0}, step=0)
    if status == "failed":
        with pytest.warns(UserWarning, match="events were lost"):
            logger.finalize(status)
    else:
        with pytest.raises(RuntimeError, match="writing TensorBoard step events failed"):
            logger.finalize(status)
    assert logger._helper is None  # the thread was stopped either way


def test_a_runs_final_metric_survives_the_purge_of_a_file_named_after_it(tmp_path: Path) -> None:
    """TensorBoard reads a run's files in name order; a resumed run's file starts with a
    purge of the steps it repeats. The hparams file, written last, must be read last,
    even when its name would sort first (files of one second differ in a counter only,
    compared as text: it once made the main job's hp/val_bpc vanish in tiny runs)."""
    from torch.utils.tensorboard import SummaryWriter

    from lit_spikes.tb import HPARAM_METRIC, write_hparams

    with SummaryWriter(log_dir=str(tmp_path), purge_step=20) as resumed:  # purges >= 20
        resumed.add_scalar("train/loss", 1.0, 20)
    (purging,) = tmp_path.glob("events.out.tfevents.*")
    purging.rename(tmp_path / "events.out.tfevents.9999999999.zz.1.9")  # sorts after any
    write_hparams(tmp_path, {"row": "resumed"}, 1.25, step=39)
    assert tb_scalars(tmp_path)[HPARAM_METRIC] == [(39, 1.25)]


@pytest.mark.parametrize(("bar", "every"), [(True, 5), (False, 5), (True, 1), (False, 1)])
def test_every_step_scalar_follows_log_every_n_steps_with_or_without_a_bar(
    tmp_path: Path, bar: bool, every: int
) -> None:
    """train/loss with the others, at the steps Lightning logs self.log values: not every
    50 steps with a progress bar and every step without one."""
    from lit_spikes.data import StepDataModule
    from lit_spikes.module import TinyGPTModule
    from tests.conftest import TINY_DATA, TINY_GPT, TINY_OPTIM

    trainer = pl.Trainer(
        max_steps=12,
        logger=TensorBoardStepLogger(str(tmp_path), name="run", version=""),
        log_every_n_steps=every,
        enable_progress_bar=bar,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM), datamodule=StepDataModule(TINY_DATA))
    scalars = tb_scalars(tmp_path / "run")
    expected = [step for step in range(12) if (step + 1) % every == 0]
    for tag in ("train/loss", "train/max_logit", "lr", "grad_norm", "data/position"):
        assert [step for step, _ in scalars[tag]] == expected, tag
    assert ("train/loss" in trainer.callback_metrics) == bar  # self.log feeds a bar only


def test_a_module_that_never_hands_over_still_shows_within_max_wait_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another module logs through Lightning and never calls hand_over: its steps are
    written once one is logged max_wait_s after the oldest waiting, not after 100 of them."""
    import lit_spikes.tb as tb_module

    now = [1_000_000.0]  # the logger's clock, moved by the test alone (no scheduling race)
    monkeypatch.setattr(tb_module, "time", type("Clock", (), {"time": lambda: now[0]}))
    logger = TensorBoardStepLogger(str(tmp_path), name="run", version="", max_wait_s=0.05)
    logger.log_metrics({"loss": 0.0}, step=0)
    now[0] += 0.049
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.save()
    assert tb_scalars(tmp_path / "run") == {}  # still waiting: 0.049 s after the oldest
    now[0] += 0.002
    logger.log_metrics({"loss": 2.0}, step=2)
    logger.save()
    assert [s for s, _ in tb_scalars(tmp_path / "run")["loss"]] == [0, 1, 2]
    logger.finalize("success")
    for bad in (0, -1.0, math.inf, math.nan, "5"):
        with pytest.raises(ValueError, match=re.escape(f"max_wait_s={bad!r} must be a positive")):
            TensorBoardStepLogger(str(tmp_path), max_wait_s=bad)  # type: ignore[arg-type]
