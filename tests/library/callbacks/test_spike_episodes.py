"""A spike and its aftermath are one episode (issue 64): the ringing after one bad batch
does not count as more spikes; ``detector.spikes`` reads as its docstring shows; and a fit
ends with one line on its episodes, or that there were none."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from lit_spikes import StepLoader
from lit_spikes.callbacks import Episode, ExactResume, SpikeDetector
from tests.conftest import tb_marks, tb_scalars
from tests.modules.plain_runs import BATCH, loader, train
from tests.modules.spiky_modules import JumpRegressor, StepRegressionData
from tests.modules.user_modules import DropoutRegressor, PoisonedRows

RINGING = {160: 9.0, 161: 12.0, 163: 6.0, 166: 5.0, 209: 7.0}
"""A poisoned batch at step 160 (its peak at 161), the curve ringing at 163 and 166, and
a second spike at 209: flagged values over a flat curve of 1.0."""


def ringing(settle: int | None = None) -> SpikeDetector:
    detector = SpikeDetector(window=20, ratio=2.0, **({} if settle is None else {"settle": settle}))
    for step in range(240):
        detector.check(step, {"loss": RINGING.get(step, 1.0)})
    return detector


def test_the_aftermath_of_a_spike_is_its_episode_not_more_spikes() -> None:
    detector = ringing()
    assert [s.step for s in detector.spikes] == [160, 161, 163, 166, 209]  # every flag kept
    assert detector.onsets == [160, 209]
    first, second = detector.episodes
    assert (first.onset.step, first.peak.step, first.end, first.flags) == (160, 161, 166, 4)
    assert first.peak.value == 12.0 and first.height == 12.0 - first.peak.reference
    assert first.peak.reference == pytest.approx(1.4)  # the window's mean, 9.0 in it
    assert (second.onset.step, second.flags, second.peak.value) == (209, 1, 7.0)


def test_settle_sets_how_long_the_curve_must_stay_in_band() -> None:
    assert ringing(settle=1).onsets == [160, 163, 166, 209]  # consecutive flags alone
    assert ringing(settle=2).onsets == [160, 166, 209]  # 161 -> 163: 2 steps; 163 -> 166: 3
    assert ringing(settle=3).onsets == [160, 209]
    assert ringing(settle=50).onsets == [160]
    with pytest.raises(ValueError, match=r"settle=0"):
        SpikeDetector(settle=0)


def test_the_spikes_slice_as_the_docstring_shows_and_keep_the_latest() -> None:
    detector = SpikeDetector(window=20, ratio=2.0, max_records=3)
    for step in range(240):
        detector.check(step, {"loss": RINGING.get(step, 1.0)})
    assert [s.step for s in detector.spikes[:20]] == [163, 166, 209]  # the latest 3
    assert detector.num_spikes == 5
    again = SpikeDetector(window=20, ratio=2.0, max_records=2)
    again.load_state_dict(detector.state_dict())
    assert [s.step for s in again.spikes[-2:]] == [166, 209]


def test_an_episode_says_itself_in_a_line() -> None:
    (first, _) = ringing().episodes
    assert isinstance(first, Episode)
    assert first.describe() == "step 160 (loss 12 at step 161, +10.6 over 1.4; 4 flags to step 166)"


@pytest.mark.parametrize(
    ("poisoned", "says"),
    [(True, "1 spike episode in 12 steps: step 9 ("), (False, "no spike in 12 steps")],
)
def test_a_fit_ends_with_one_line_on_its_spikes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, poisoned: bool, says: str
) -> None:
    """A user's regressor, a bad batch planted at step 9 (or none): the fit's last word
    from the detector is its episodes (Lightning's info log, as the Trainer's own lines)."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    rows = set(loader().rows_of_step(9)) if poisoned else set()
    detector = SpikeDetector(window=5, warmup=5, ratio=3.0)
    train(
        tmp_path,
        DropoutRegressor(),
        StepLoader(PoisonedRows(rows), BATCH, seed=7),
        12,
        [detector, ExactResume()],
    )
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpikeDetector(")]
    assert len(said) == 1 and said[0].startswith(f"SpikeDetector(loss): {says}")
    assert detector.onsets == ([9] if poisoned else [])


def jump_trainer(root: Path, name: str, detector: SpikeDetector, steps: int = 80) -> Any:
    """A plain Trainer with a TensorBoard logger at ``root/name`` and a checkpoint every
    step (``root/ckpt``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    saver = ModelCheckpoint(root / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=TensorBoardLogger(str(root), name=name, version=""),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[detector, saver],
        log_every_n_steps=1,
    )


def jump_module() -> JumpRegressor:
    return JumpRegressor(jump_step=40, jump=20.0, jump_length=3)


def test_tensorboard_marks_each_episode_once_at_its_onset(tmp_path: Path) -> None:
    """A user's regression with a 20x LR for 3 steps at step 40: the loss stays high for
    six steps, all flagged and logged as ``spike/loss``; the chart of the curve marks the
    episode once, at its onset (it drew a line of six marks)."""
    detector = SpikeDetector(window=20, ratio=3.0)
    jump_trainer(tmp_path, "run", detector).fit(jump_module(), StepRegressionData())
    flagged = [41, 42, 43, 44, 45, 46]
    assert [s.step for s in detector.spikes] == flagged
    assert [step for step, _ in tb_scalars(tmp_path / "run")["spike/loss"]] == flagged
    marks = tb_marks(tmp_path / "run")
    assert [step for step, _ in marks["loss"]] == detector.onsets == [41]


def test_a_run_resumed_mid_episode_marks_no_new_onset(tmp_path: Path) -> None:
    """Resumed from ``step=44.ckpt`` (steps 0-43 trained), in the episode begun at 41: the
    flags after it are its aftermath (the detector's state holds the episode), so no mark,
    and one episode."""
    jump_trainer(tmp_path, "first", SpikeDetector(window=20, ratio=3.0), 44).fit(
        jump_module(), StepRegressionData()
    )
    detector = SpikeDetector(window=20, ratio=3.0)
    jump_trainer(tmp_path, "resumed", detector).fit(
        jump_module(), StepRegressionData(), ckpt_path=tmp_path / "ckpt" / "step=44.ckpt"
    )
    assert [s.step for s in detector.spikes] == [41, 42, 43, 44, 45, 46]
    assert [e.onset.step for e in detector.episodes] == [41]
    resumed = [step for step, _ in tb_scalars(tmp_path / "resumed")["spike/loss"]]
    assert resumed == [44, 45, 46]  # judged after the resume
    assert not (tmp_path / "resumed" / "spikes").exists()  # no mark written
