"""The spike marks land on the chart of the curve the user logged, whatever the monitor,
as one-point runs at the level the curve rose from (issue 65): read back with
TensorBoard's own reader on modules written for the tests."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger

from lit_spikes.callbacks import SpikeDetector, TrainingCurves
from lit_spikes.callbacks.spike_marks import mark_run
from tests.conftest import tb_scalars
from tests.modules.spiky_modules import ValidatedRegressionData
from tests.modules.tb_modules import ChartedConv

POISON = (25, 50)
"""Two poisoned batches, each its own episode (more than ``settle`` steps apart)."""
Scalars = dict[str, list[tuple[int, float]]]


def charted_run(
    root: Path, module: ChartedConv, detector: SpikeDetector, *callbacks: Any, every: int = 1
) -> dict[str, Scalars]:
    """Train 60 steps (validating every 20, logging every ``every``) and return the
    scalars of every run under ``root/run`` by its name there (``.``: the run itself)."""
    trainer = pl.Trainer(
        max_steps=60,
        accelerator="cpu",
        logger=TensorBoardLogger(str(root), name="run", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[detector, *callbacks],
        log_every_n_steps=every,
        val_check_interval=20,
        limit_val_batches=1,
    )
    trainer.fit(module, datamodule=ValidatedRegressionData(poison=POISON))
    runs = {p.parent for p in (root / "run").rglob("events.out.tfevents.*")}
    return {p.relative_to(root / "run").as_posix(): tb_scalars(p) for p in runs}


def marks(runs: dict[str, Scalars]) -> dict[str, Scalars]:
    return {name: tags for name, tags in runs.items() if name != "."}


def reference(curve: list[tuple[int, float]], step: int, window: int = 10) -> float:
    """The level a spike at ``step`` rose from, as the detector's ratio rule measures it:
    the mean of the ``window`` values before it (every step logged), as TensorBoard keeps
    it (float32)."""
    values = dict(curve)
    return float(np.float32(statistics.fmean(values[k] for k in range(step - window, step))))


def expected_marks(tag: str, curve: list[tuple[int, float]]) -> dict[str, Scalars]:
    """A run per poisoned step, holding one point on ``tag`` at the spike's reference."""
    return {mark_run(step): {tag: [(step, reference(curve, step))]} for step in POISON}


def test_marks_of_the_returned_loss_land_on_the_users_train_loss(tmp_path: Path) -> None:
    """The default monitor (the returned loss) and a module logging it as ``train_loss``:
    each onset a run of its own on the ``train_loss`` chart, one point at the spike's
    reference (inside the 5-95% range TensorBoard's default scaling keeps), and no
    ``loss`` chart of the detector's."""
    detector = SpikeDetector(ratio=3.0, window=10)
    runs = charted_run(tmp_path, ChartedConv(), detector)
    assert detector.onsets == list(POISON)
    main = runs["."]
    assert "loss" not in main and "val_loss" in main
    assert marks(runs) == expected_marks("train_loss", main["train_loss"])
    low, high = np.quantile([v for _, v in main["train_loss"]], [0.05, 0.95])
    feet = [v for tags in marks(runs).values() for _, v in tags["train_loss"]]
    assert all(low <= foot <= high for foot in feet), (feet, low, high)


def test_a_loss_logged_on_step_and_epoch_is_marked_on_its_step_chart(tmp_path: Path) -> None:
    """Logged with ``on_epoch=True`` too, the curve's chart is ``train_loss_step``."""
    runs = charted_run(tmp_path, ChartedConv(on_epoch=True), SpikeDetector(ratio=3.0, window=10))
    assert marks(runs) == expected_marks("train_loss_step", runs["."]["train_loss_step"])


def test_a_loss_the_module_does_not_log_is_logged_by_the_detector(tmp_path: Path) -> None:
    """A module that only returns its loss: the detector logs the ``loss`` curve itself,
    at Lightning's logging steps and at every flagged step, and marks that chart."""
    detector = SpikeDetector(ratio=3.0, window=10)
    runs = charted_run(tmp_path, ChartedConv(log_as=None), detector, every=10)
    flagged = [s.step for s in detector.spikes]
    steps = [step for step, _ in runs["."]["loss"]]
    assert steps == sorted({*range(9, 60, 10), *flagged})
    assert set(marks(runs)) == {mark_run(step) for step in POISON}
    assert all(list(tags) == ["loss"] for tags in marks(runs).values())


def test_a_logged_monitor_and_a_stated_curve_are_marked_on_their_charts(tmp_path: Path) -> None:
    """``monitor="train_loss"``: its own chart; ``curves={"loss": "mine"}``: the tag stated."""
    runs = charted_run(
        tmp_path / "a", ChartedConv(), SpikeDetector("train_loss", ratio=3.0, window=10)
    )
    assert marks(runs) == expected_marks("train_loss", runs["."]["train_loss"])
    stated = SpikeDetector(ratio=3.0, window=10, curves={"loss": "mine"})
    runs = charted_run(tmp_path / "b", ChartedConv(), stated)
    assert {tag for tags in marks(runs).values() for tag in tags} == {"mine"}


def test_grad_norm_is_logged_by_the_detector_unless_training_curves_does(tmp_path: Path) -> None:
    """``monitor="grad_norm"``: without ``TrainingCurves`` the detector logs the curve
    itself (at the logging steps); with it, ``TrainingCurves``' curve is the chart."""
    alone = charted_run(
        tmp_path / "a", ChartedConv(), SpikeDetector("grad_norm", ratio=3.0, window=10), every=10
    )
    curves = charted_run(
        tmp_path / "b",
        ChartedConv(),
        SpikeDetector("grad_norm", ratio=3.0, window=10),
        TrainingCurves(),
        every=10,
    )
    for runs in (alone, curves):
        assert runs["."]["grad_norm"], list(runs["."])
        assert {tag for tags in marks(runs).values() for tag in tags} == {"grad_norm"}
    logging = set(range(9, 60, 10))
    assert {step for step, _ in curves["."]["grad_norm"]} == logging  # TrainingCurves' alone
    assert {step for step, _ in alone["."]["grad_norm"]} > logging  # and the flagged steps
