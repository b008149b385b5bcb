"""Every file of a step resumes that step's run exactly, a validating step's too (issue 54).

Lightning writes ``ModelCheckpoint(every_n_train_steps)``'s and the preemption's files
before the step's validation and its ReduceLROnPlateau update, and a resume starts at the
next step: the validation's updates (EarlyStopping's count, a plateau's LR) were missing,
and a run EarlyStopping ended, resumed from its last file, trained on. ExactResume now
replays what the file came before. The runs: ``tests/modules/validating_runs.py``
(dropout, augmentation, a validation that draws, every 3 steps)."""

from __future__ import annotations

import logging
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume
from lit_spikes.callbacks.preemption import PreemptionCheckpoint
from tests.modules.drawing_runs import SignalAt, differences
from tests.modules.val_nets import ValNet, val_rows
from tests.modules.validating_runs import Steer, Steered, fit_steered

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers")

STOPPED = Steer(every=4, monitor=True, final=True)
"""EarlyStopping(patience=2) ends this run at step 12, a validating step and a file's."""
PLATEAU = Steer(every=4, patience=None, plateau=True)
"""A ReduceLROnPlateau on val_loss lowers the LR at validating steps (12 and 24: files)."""


def assert_same_end(whole: Steered, resumed: Steered) -> None:
    assert resumed.step == whole.step
    assert differences(whole.ended, resumed.ended) == []
    assert resumed.lrs == whole.lrs[len(whole.lrs) - len(resumed.lrs) :]
    assert resumed.early_stopping == whole.early_stopping


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Steered]:
    root = tmp_path_factory.mktemp("stopped")
    whole = fit_steered(root, STOPPED)
    assert whole.step == 12  # what the tests below mean; then the files:
    assert sorted(p.name for p in (root / "every").iterdir()) == [
        "step=12.ckpt", "step=4.ckpt", "step=8.ckpt"]  # fmt: skip
    assert not (root / "final").exists()  # 12 is on the interval
    return root, whole


@pytest.mark.parametrize("name", ["every/step=8.ckpt", "every/step=12.ckpt", "best"])
def test_each_file_of_an_early_stopped_run_stops_where_it_stopped(
    stopped: tuple[Path, Steered], tmp_path: Path, name: str
) -> None:
    """Step 12's file was written before the validation that ended the run: the resume
    skipped it and trained on to 15. (Step 8 does not validate, the best file is written
    after its validation: both resumed exactly before.)"""
    root, whole = stopped
    ckpt = next((root / "best").iterdir()) if name == "best" else root / name
    resumed = fit_steered(tmp_path, STOPPED, ckpt=ckpt)
    assert_same_end(whole, resumed)
    if name.endswith("12.ckpt"):
        assert resumed.ended.losses == []  # it ends at once


def test_a_run_early_stopping_ended_requeued_from_its_final_file_ends_at_once(
    tmp_path: Path,
) -> None:
    """The final file is written after the validation that stopped the run: the stop
    was in no file, and the resume trained on to the next validation's stop (15)."""
    whole = fit_steered(tmp_path / "whole", Steer(every=5, final=True))
    (final,) = (tmp_path / "whole" / "final").iterdir()
    assert final.name == "step=12.ckpt"
    resumed = fit_steered(tmp_path / "again", Steer(every=5, final=True), steps=60, ckpt=final)
    assert resumed.step == 12 and resumed.ended.losses == []
    assert_same_end(whole, resumed)
    # That requeue's own final file says the stop again: a third start ends at once too
    (final,) = (tmp_path / "again" / "final").iterdir()
    third = fit_steered(tmp_path / "third", Steer(every=5, final=True), steps=60, ckpt=final)
    assert third.step == 12 and third.ended.losses == []


def test_a_resume_from_the_best_file_of_a_run_stopped_there_ends_at_once(tmp_path: Path) -> None:
    """EarlyStopping(stopping_threshold) stops the run at step 6, whose validation is the
    best: the monitor checkpoint writes its file after that decision, which no file held
    (the resume trained on to the next validation)."""
    steer = Steer(monitor=True, patience=10, good_enough=1.3)
    whole = fit_steered(tmp_path / "whole", steer)
    assert whole.step == 6 and whole.best is not None and whole.best[0] == "best-step=6.ckpt"
    best = tmp_path / "whole" / "best" / "best-step=6.ckpt"
    resumed = fit_steered(tmp_path / "resumed", steer, ckpt=best)
    assert resumed.step == 6 and resumed.ended.losses == []
    assert_same_end(whole, resumed)


def test_a_requeue_from_last_ckpt_of_a_run_early_stopping_ended_ends_at_once(
    tmp_path: Path,
) -> None:
    """ModelCheckpoint(save_last=True) rewrites last.ckpt after the validation of a step
    it saved: at step 12, the one that stopped the run. The stop was in no file: the
    requeue from last.ckpt trained on to step 15."""
    steer = Steer(every=4, save_last=True)
    whole = fit_steered(tmp_path / "whole", steer)
    assert whole.step == 12
    last = tmp_path / "whole" / "every" / "last.ckpt"
    requeued = fit_steered(tmp_path / "requeued", steer, steps=60, ckpt=last)
    assert requeued.step == 12 and requeued.ended.losses == []
    assert_same_end(whole, requeued)


@pytest.mark.parametrize(("step", "sigint"), [(5, False), (6, False), (12, False), (9, True)])
def test_a_sigterm_at_any_step_resumes_the_run_that_got_none(
    stopped: tuple[Path, Steered], tmp_path: Path, step: int, sigint: bool
) -> None:
    """At a validating step (6, 9, 12) the preemption file came before the validation:
    the resume missed it (EarlyStopping stopped 3 steps late). SIGINT alike."""
    _, whole = stopped
    steer = Steer(sigterm_at=step, sigint=sigint)
    first = fit_steered(tmp_path / "first", steer)
    assert first.step == step
    (ckpt,) = (tmp_path / "first" / "preempted").iterdir()
    assert_same_end(whole, fit_steered(tmp_path / "resumed", STOPPED, ckpt=ckpt))


def test_a_monitor_checkpoint_requeued_in_its_directory_keeps_its_best(tmp_path: Path) -> None:
    """Files every 3 steps, at validating steps; the best val_loss is step 6's. Requeued
    from step 6's file into the run's own directory (Lightning restores a monitor's best
    only there), the validation of step 6 that the file came before was skipped: the
    monitor never saw the best, and kept another step's file."""
    steer = Steer(every=3, monitor=True)
    whole = fit_steered(tmp_path, steer)
    assert whole.best is not None and whole.best[0] == "best-step=6.ckpt"
    requeued = fit_steered(tmp_path, steer, ckpt=tmp_path / "every" / "step=6.ckpt")
    assert_same_end(whole, requeued)
    assert requeued.best is not None
    name, score = requeued.best  # a file of a name the first run left gets a version
    assert (name.split("-v")[0].removesuffix(".ckpt") + ".ckpt", score) == whole.best


@pytest.fixture(scope="module")
def lowered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Steered]:
    root = tmp_path_factory.mktemp("plateau")
    whole = fit_steered(root, PLATEAU)
    assert len(set(whole.lrs)) > 2  # the plateau lowered the LR more than once
    return root, whole


@pytest.mark.parametrize("step", [12, 20, 24])
def test_a_plateau_scheduler_resumes_from_each_file(
    lowered: tuple[Path, Steered], tmp_path: Path, step: int
) -> None:
    """From a validating step's file (12, 24) the resume missed that validation and the
    LR it lowered: 29 and 17 tensors differed."""
    root, whole = lowered
    ckpt = root / "every" / f"step={step}.ckpt"
    assert_same_end(whole, fit_steered(tmp_path, PLATEAU, ckpt=ckpt))


@pytest.mark.parametrize("step", [4, 6, 8])
def test_an_epoch_plateau_scheduler_resumes_from_each_file(tmp_path: Path, step: int) -> None:
    """6 batches an epoch. Lightning skips the epoch plateau update at the end of a resumed
    fit's first epoch (from step 4 and 8: its LR stayed up) and that of the epoch a file
    of its last batch ends (step 6)."""
    steer = Steer(every=2, patience=None, plateau="epoch")
    whole = fit_steered(tmp_path / "whole", steer)
    assert len(set(whole.lrs)) > 2  # the plateau lowered the LR more than once
    ckpt = tmp_path / "whole" / "every" / f"step={step}.ckpt"
    assert_same_end(whole, fit_steered(tmp_path / "resumed", steer, ckpt=ckpt))


@pytest.mark.parametrize("every", [7, 10])
def test_extending_a_finished_run_equals_the_longer_run(tmp_path: Path, every: int) -> None:
    """30 steps, then 63 from the last file: off the interval (FinalCheckpoint's file of
    step 30, written after the final validation, at which Lightning's restart stepped the
    plateau again and, with no metric to read, raised) and on it (step 30's every-k file,
    before that validation)."""
    steer = Steer(every=every, final=True, patience=None, plateau=True)
    longer = fit_steered(tmp_path / "longer", Steer(patience=None, plateau=True), steps=63)
    fit_steered(tmp_path / "short", steer, steps=30)
    where = "final" if 30 % every else "every"
    ckpt = tmp_path / "short" / where / "step=30.ckpt"
    assert_same_end(longer, fit_steered(tmp_path / "extended", steer, steps=63, ckpt=ckpt))


class EpochCounter(ValNet):
    """Counts its epochs in its own ``on_train_epoch_end``: state an epoch's end changes."""

    def on_train_epoch_end(self) -> None:
        self.epochs = getattr(self, "epochs", 0) + 1


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
@pytest.mark.parametrize(("module", "warned"), [(EpochCounter, True), (ValNet, False)])
def test_a_file_of_an_epochs_last_batch_names_the_epoch_end_hooks_it_skips(
    tmp_path: Path, module: type[ValNet], warned: bool
) -> None:
    """Lightning's restart skips the epoch's end of a file written at its last batch
    (step 16 of 16 batches an epoch); ExactResume replays the epoch plateau update, not
    the hooks (one that logs cannot be called outside Lightning's loop): it names them."""

    def fit(ckpt: Path | None = None) -> None:
        every = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=16, save_top_k=-1)
        trainer = pl.Trainer(max_steps=20, callbacks=[ExactResume(), every], logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
        loader = StepLoader(val_rows(), batch_size=4, seed=0)
        trainer.fit(module(), train_dataloaders=loader, ckpt_path=ckpt)

    fit()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit(tmp_path / "step=16.ckpt")
    named = [str(w.message) for w in seen if "on_train_epoch_end of" in str(w.message)]
    assert bool(named) is warned, named
    if warned:
        assert "on_train_epoch_end of EpochCounter does not run" in named[0]


WHOLE: dict[Steer, Steered] = {}
"""The uninterrupted runs the property below compares with, each trained once."""


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 29), st.sampled_from([STOPPED, PLATEAU]))
def test_a_sigterm_at_any_step_of_a_run_steered_by_its_validation(step: int, steer: Steer) -> None:
    """The property of issue 53's invariance tests, with preemption at any step (issue 54):
    a run whose validation steers it (EarlyStopping, or a plateau's LR), signaled at any
    step, validating or not, and requeued from its file, ends as the run that got none."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if steer not in WHOLE:
            WHOLE[steer] = fit_steered(root / "whole", steer)
        whole = WHOLE[steer]
        first = fit_steered(root / "first", replace(steer, sigterm_at=step))
        if first.step < step:
            return  # the run stopped (EarlyStopping) before the signal's step
        (ckpt,) = (root / "first" / "preempted").iterdir()
        assert_same_end(whole, fit_steered(root / "requeued", steer, ckpt=ckpt))


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
@pytest.mark.parametrize(
    ("exact", "says"),
    [(True, "continues bit-exactly."), (False, "continues the run, not bit-exactly")],
)
def test_a_signals_message_says_bit_exact_only_where_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, exact: bool, says: str
) -> None:
    """ "continues bit-exactly" was printed without ExactResume too, whose resume neither
    restores the RNG nor replays the step's validation."""
    callbacks: list[Any] = [SignalAt(5), PreemptionCheckpoint(tmp_path)]
    callbacks += [ExactResume()] if exact else []
    trainer = pl.Trainer(max_steps=10, callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lit_spikes.callbacks.preemption"):
        trainer.fit(ValNet(), train_dataloaders=StepLoader(val_rows(), batch_size=4, seed=0))
    (message,) = [r.getMessage() for r in caplog.records if "Received SIGTERM" in r.getMessage()]
    assert says in message, message


@pytest.mark.parametrize(("step", "warned"), [(12, True), (8, False)])
def test_a_file_of_an_earlier_lit_spikes_at_a_validating_step_warns(
    stopped: tuple[Path, Steered], tmp_path: Path, step: int, warned: bool
) -> None:
    """A file written before this issue says nothing of its step's end: at a step that
    validates, the resume may miss that validation's updates, and says so."""
    root, _ = stopped
    checkpoint = torch.load(root / "every" / f"step={step}.ckpt", weights_only=True)
    for key in ("step_end", "callback_metrics"):
        del checkpoint["callbacks"]["ExactResume{}"][key]
    older = tmp_path / "older.ckpt"
    torch.save(checkpoint, older)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit_steered(tmp_path / "resumed", STOPPED, ckpt=older)
    named = [str(w.message) for w in seen if "written by an earlier lit-spikes" in str(w.message)]
    assert bool(named) is warned, named


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
def test_a_time_based_validation_is_never_said_to_be_due(tmp_path: Path) -> None:
    """A validation every so many seconds is no function of the step: no file says one is
    due, and no resume replays one the run may never have run."""
    every = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(max_steps=6, callbacks=[ExactResume(), every], logger=False,
                         val_check_interval="00:00:00:01", check_val_every_n_epoch=None,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)  # fmt: skip
    loader = StepLoader(val_rows(), batch_size=4, seed=0)
    trainer.fit(ValNet(), train_dataloaders=loader, val_dataloaders=loader)
    for step in (2, 4, 6):
        state = torch.load(tmp_path / f"step={step}.ckpt", weights_only=True)
        step_end = state["callbacks"]["ExactResume{}"]["step_end"]
        assert step_end is not None and step_end["validation"] is False, step_end


class EmaInBatchEnd(ValNet):
    """Keeps an average of its first layer's weight, updated in its own on_train_batch_end
    (where many modules keep an EMA)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", self.net[0].weight.detach().clone())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.mul_(0.9).add_(self.net[0].weight.detach(), alpha=0.1)


class LogsInBatchEnd(ValNet):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("seen", float(batch_idx))  # changes no state a file holds


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
@pytest.mark.parametrize(("module", "warned"), [(EmaInBatchEnd, True), (LogsInBatchEnd, False)])
def test_state_a_modules_own_batch_end_changes_after_the_file_is_named(
    tmp_path: Path, module: type[ValNet], warned: bool
) -> None:
    """Lightning calls the module's on_train_batch_end after the callbacks' (where the
    files are written): the change is in no file of its step, and a resume misses it."""
    every = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = pl.Trainer(max_steps=7, callbacks=[ExactResume(), every], logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module(), train_dataloaders=StepLoader(val_rows(), batch_size=4, seed=0))
    named = [str(w.message) for w in seen if "on_train_batch_end changed" in str(w.message)]
    assert len(named) == int(warned), named  # once a fit
    if warned:
        assert "EmaInBatchEnd.on_train_batch_end changed ema after the file of step 3" in named[0]
