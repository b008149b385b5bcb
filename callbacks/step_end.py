"""The end of a step that a checkpoint came before, replayed at a resume from it.

Lightning ends a training step in this order: the callbacks' ``on_train_batch_end``
(``ModelCheckpoint(every_n_train_steps)`` and ``PreemptionCheckpoint`` save here), the
module's, then the step's validation if one is due (``on_validation_end``: EarlyStopping
counts, a monitor ModelCheckpoint saves), then the ``ReduceLROnPlateau`` schedulers of the
step interval. A resume starts at the next step, so what came after the save is missing
from the file: Lightning skips the validation on purpose (its loop fast-forwards the
counters), and the plateau schedulers miss a step. ``StepEnd`` tracks where in that order
a save falls, and ``replay`` runs the missing part at the resume, before the next step:
with the per-step seeds (``lit_spikes.randomness``) a replayed validation is the same
validation. docs/how-it-works.md says why a replay, not a later file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch

from lit_spikes.callbacks.common import validates_at_this_step_anyway


@dataclass
class Unfinished:
    """What of step ``step``'s end had not run when a file was written."""

    step: int
    validation: bool
    """Its validation (one was due)."""
    plateau: bool
    """Its plateau schedulers' update (after the validation)."""
    stop: bool = False
    """Its validation asked the run to stop (``trainer.should_stop``: EarlyStopping), which
    no file holds: the resume stops at once."""
    epoch: tuple[int, int] | None = None
    """The fit loop's epoch counts (completed, processed) in the step: at an epoch's last
    batch, Lightning's restart has counted the epoch done before the replay."""

    def state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: Any) -> Unfinished | None:
        if not isinstance(state, dict):
            return None
        names = ("step", "validation", "plateau", "stop", "epoch")
        found = cls(**{k: state[k] for k in names if k in state})
        found.epoch = tuple(found.epoch) if found.epoch is not None else None  # type: ignore[assignment]
        return found


class StepEnd:
    """Where the Trainer is in a step's end, from ExactResume's hooks. The step's end is
    known from its start (whether a validation is due is decided by the batch's place),
    so that a file written in any callback's ``on_train_batch_end``, before ExactResume's
    or after, says what it misses."""

    def __init__(self) -> None:
        self.open: Unfinished | None = None
        self._started: tuple[int, bool, tuple[int, int]] | None = None  # step, due, epoch
        self._validated: int | None = None
        self._stop_before_validation = False

    def batch_started(self, trainer: pl.Trainer) -> None:
        """``on_train_batch_start``: the previous step's end has run. Once this batch's
        optimizer step is taken, its validation (if due) and its plateau update are to
        come. A validation Lightning adds for a stop (``should_stop``) is not due: the run
        that was not stopped does not validate there."""
        self.closed(trainer)
        due = trainer.enable_validation and validates_at_this_step_anyway(trainer)
        self._started = (trainer.global_step, due, epoch_counts(trainer))

    def _current(self, trainer: pl.Trainer) -> Unfinished | None:
        """This step's end, opened once the optimizer step of the batch started is taken."""
        if self.open is None and self._started is not None:
            started, due, epoch = self._started
            if trainer.global_step > started:
                self.open = Unfinished(trainer.global_step, due, plateau=True, epoch=epoch)
                self._started = None
        now = self.open is not None and self.open.step == trainer.global_step
        return self.open if now else None

    def validation_started(self, trainer: pl.Trainer) -> None:
        self._validated, self._stop_before_validation = trainer.global_step, trainer.should_stop
        current = self._current(trainer)
        if current is not None:
            # A file from here on holds the validation's updates; the plateau update that
            # follows, Lightning runs at a resume from it (its loop restarts "on last").
            current.validation = current.plateau = False

    def _stop_decided(self, trainer: pl.Trainer) -> bool:
        """Whether this step's validation asked the run to stop (EarlyStopping): read when
        a file is written or the step's end closes, so that a stopper listed after
        ExactResume counts too (the monitor ModelCheckpoint, moved last, saves after it)."""
        validated = self._validated == trainer.global_step
        return validated and trainer.should_stop and not self._stop_before_validation

    def closed(self, trainer: pl.Trainer) -> None:
        """The next step's start, the epoch's end or the fit's: the step's end has run.
        A stop its validation decided is still said by a file written after it."""
        current = self._current(trainer)
        if current is not None and self._stop_decided(trainer):
            self.open = replace(current, validation=False, plateau=False, stop=True)
        else:
            self.open = None

    def unfinished(self, trainer: pl.Trainer) -> Unfinished | None:
        """What a file written now would miss of its step's end (None: nothing)."""
        current = self._current(trainer)
        if current is None:
            return None
        found = replace(current, stop=current.stop or self._stop_decided(trainer))
        return found if found.validation or found.plateau or found.stop else None

    def replaying(self, unfinished: Unfinished) -> None:
        """A resume replays this step's end: tracked as a step's end that runs now."""
        self.open, self._started = replace(unfinished), None


def epoch_counts(trainer: pl.Trainer) -> tuple[int, int]:
    current: Any = trainer.fit_loop.epoch_progress.current  # a _ProcessedTracker
    return current.completed, current.processed


@contextmanager
def epoch_as(trainer: pl.Trainer, epoch: tuple[int, int] | None) -> Iterator[None]:
    """The fit loop's epoch counts as they were in the file's step (``current_epoch``:
    what EarlyStopping records and every logged metric carries), put back after. A
    loop counter, set because Lightning has no public way to validate inside a fit."""
    current: Any = trainer.fit_loop.epoch_progress.current  # a _ProcessedTracker
    if epoch is None:
        yield
        return
    now = current.completed, current.processed
    current.completed, current.processed = epoch
    try:
        yield
    finally:
        current.completed, current.processed = now


def saved_metrics(trainer: pl.Trainer | None) -> dict[str, Any]:
    """The Trainer's ``callback_metrics`` (what the run logged last: the latest validation's
    too), which Lightning does not save: a resume without them has a ReduceLROnPlateau or
    a monitor with nothing to read until the next validation."""
    if trainer is None:
        return {}
    return {
        name: value.detach().clone() if isinstance(value, torch.Tensor) else value
        for name, value in trainer.callback_metrics.items()
        if isinstance(value, torch.Tensor | int | float)
    }


def replay(
    trainer: pl.Trainer, pl_module: pl.LightningModule, unfinished: Unfinished, ends: StepEnd
) -> None:
    """Run what of the file's step's end had not run, as Lightning's training epoch loop
    runs it after a step (its ``on_advance_end``), before the resumed run's first step.

    The loops are reached through their public attributes (``fit_loop.epoch_loop``,
    ``val_loop.run``, ``update_lr_schedulers``): Lightning has no public call that
    validates inside a fit, and its own restart skips this validation."""
    ends.replaying(unfinished)
    epoch_loop = trainer.fit_loop.epoch_loop
    with epoch_as(trainer, unfinished.epoch):  # the resumed run's schedule at that step:
        due = trainer.enable_validation and validates_at_this_step_anyway(trainer)
    if unfinished.validation and due:  # a branch validating elsewhere does not replay it
        val_loop = epoch_loop.val_loop
        restarting, val_loop.restarting = val_loop.restarting, False  # a whole validation
        pl_module.on_validation_model_zero_grad()
        trainer.validating = True
        with epoch_as(trainer, unfinished.epoch):
            try:
                val_loop.run()
            finally:
                trainer.training = True
                val_loop.restarting = restarting
    if unfinished.plateau:
        epoch_loop.update_lr_schedulers("step", update_plateau_schedulers=True)
        if ends.open is not None:
            ends.open.plateau = False
    if unfinished.stop:
        trainer.should_stop = True
