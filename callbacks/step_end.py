"""The end of a step that a checkpoint came before, replayed at a resume from it.

Lightning ends a training step in this order: the callbacks' ``on_train_batch_end``
(``ModelCheckpoint(every_n_train_steps)`` and ``PreemptionCheckpoint`` save here), the
module's, then the step's validation if one is due (``on_validation_end``: EarlyStopping
counts, a monitor ModelCheckpoint saves), then the ``ReduceLROnPlateau`` schedulers of the
step interval. A resume starts at the next step, so what came after the save is missing
from the file: Lightning skips the validation on purpose (its loop fast-forwards the
counters), and the plateau schedulers miss a step. At an epoch's last batch the epoch's
end follows (the ``on_train_epoch_end`` hooks, then the epoch-interval plateau update),
which Lightning's restart skips too. ``StepEnd`` tracks where in that order a save falls,
and ``replay`` runs the missing part at the resume, before the next step: with the
per-step seeds (``lit_spikes.randomness``) a replayed validation is the same validation.
docs/how-it-works.md says why a replay, not a later file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint, ProgressBar
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_spikes.callbacks.common import step_validates, trainer_callbacks

QUIET_AT_EPOCH_END = (ModelCheckpoint, ProgressBar)
"""Callbacks whose ``on_train_epoch_end`` changes no training state: a file, a display."""


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
    epoch_end: bool = False
    """The epoch's ``on_train_epoch_end`` hooks (the step was its epoch's last)."""
    epoch_plateau: bool = False
    """The epoch-interval plateau update after them."""

    def pending(self) -> bool:
        return any((self.validation, self.plateau, self.stop, self.epoch_end, self.epoch_plateau))

    def state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: Any) -> Unfinished | None:
        if not isinstance(state, dict):
            return None
        names = ("step", "validation", "plateau", "stop", "epoch", "epoch_end", "epoch_plateau")
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
        self._started: Unfinished | None = None  # the batch's end, at its start's step
        self._validated: int | None = None
        self._stop_before_validation = False

    def batch_started(self, trainer: pl.Trainer, step: int) -> None:
        """``on_train_batch_start``: the previous step's end has run. Once this batch's
        optimizer step is taken, its validation (if due) and its plateau update are to
        come. A validation Lightning adds for a stop (``should_stop``) is not due: the run
        that was not stopped does not validate there."""
        self.closed(trainer, step)
        due = step_validates(trainer)
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        self._started = Unfinished(
            step, due, plateau=True, epoch=epoch_counts(trainer),
            epoch_end=last, epoch_plateau=last,
        )  # fmt: skip

    def _current(self, trainer: pl.Trainer, step: int | None = None) -> Unfinished | None:
        """This step's end, opened once the optimizer step of the batch started is taken
        (``step``: the global step, where the caller read it: ~1.5 us a read)."""
        step = trainer.global_step if step is None else step
        started = self._started
        if self.open is None and started is not None and step > started.step:
            started.step = step  # made for this batch: no copy (~10 us)
            self.open, self._started = started, None
        now = self.open is not None and self.open.step == step
        return self.open if now else None

    def validation_started(self, trainer: pl.Trainer) -> None:
        self._validated, self._stop_before_validation = trainer.global_step, trainer.should_stop
        current = self._current(trainer)
        if current is not None:
            # A file from here on holds the validation's updates; the plateau update that
            # follows, Lightning runs at a resume from it (its loop restarts "on last").
            current.validation = current.plateau = False

    def epoch_ended(self, trainer: pl.Trainer) -> None:
        """``on_train_epoch_end`` (the last step's validation and plateau update ran): a
        file from here on holds the epoch's end hooks, not the epoch plateau update."""
        current = self._current(trainer)
        if current is not None:
            current.validation = current.plateau = current.epoch_end = False

    def _stop_decided(self, trainer: pl.Trainer, step: int | None = None) -> bool:
        """Whether this step's validation asked the run to stop (EarlyStopping): read when
        a file is written or the step's end closes, so that a stopper listed after
        ExactResume counts too (the monitor ModelCheckpoint, moved last, saves after it)."""
        validated = self._validated == (trainer.global_step if step is None else step)
        return validated and trainer.should_stop and not self._stop_before_validation

    def closed(self, trainer: pl.Trainer, step: int | None = None) -> None:
        """The next step's or epoch's start, or the fit's end: the step's end has run. A
        stop its validation decided is still said by a file written after it."""
        current = self._current(trainer, step)
        if current is not None and (current.stop or self._stop_decided(trainer, step)):
            self.open = Unfinished(current.step, False, False, stop=True, epoch=current.epoch)
        else:
            self.open = None

    def unfinished(self, trainer: pl.Trainer) -> Unfinished | None:
        """What a file written now would miss of its step's end (None: nothing)."""
        current = self._current(trainer)
        if current is None:
            return None
        found = replace(current, stop=current.stop or self._stop_decided(trainer))
        return found if found.pending() else None

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
    with epoch_as(trainer, unfinished.epoch):  # as they were in the file's step
        # The resumed run's own schedule: a branch validating elsewhere does not replay it
        if unfinished.validation and step_validates(trainer):
            val_loop = epoch_loop.val_loop
            restarting, val_loop.restarting = val_loop.restarting, False  # a whole one
            pl_module.on_validation_model_zero_grad()
            trainer.validating = True
            try:
                val_loop.run()
            finally:
                trainer.training = True
                val_loop.restarting = restarting
        if unfinished.plateau:
            epoch_loop.update_lr_schedulers("step", update_plateau_schedulers=True)
        if unfinished.epoch_plateau:  # after the epoch's end hooks, which are not replayed
            epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=True)
    if ends.open is not None:  # all of it ran; what stays open: a stop it decided
        ends.open = Unfinished(ends.open.step, False, False, unfinished.stop, ends.open.epoch)
    if unfinished.stop:
        trainer.should_stop = True


def epoch_end_hooks(trainer: pl.Trainer, own: type[Callback]) -> list[str]:
    """The module and callbacks with an ``on_train_epoch_end`` of their own, by class name:
    what a resume from a file of an epoch's last batch does not run (Lightning's restart
    skips the epoch's end; hooks that log cannot be called outside Lightning's loop), but
    ``own``'s (ExactResume's: it tracks the step's end)."""
    module = trainer.lightning_module
    found = [type(module).__name__] if is_overridden("on_train_epoch_end", module) else []
    for callback in trainer_callbacks(trainer):
        quiet = isinstance(callback, (*QUIET_AT_EPOCH_END, own))
        if isinstance(callback, EarlyStopping):
            # Private: no public attribute says whether it judges at the epoch's end.
            quiet = getattr(callback, "_check_on_train_epoch_end", True) is False
        if not quiet and is_overridden("on_train_epoch_end", callback):
            found.append(type(callback).__name__)
    return found


class PlateauCatchUp:
    """Lightning skips the epoch-interval plateau update at the end of the first epoch of a
    resumed fit (its fit loop's ``update_plateau_schedulers=not self.restarting``, with no
    metric saved to read). Seen at that epoch's end, it is made up at the next epoch's
    start or the fit's end, on the same epoch counts and the metrics of that epoch's end."""

    def __init__(self) -> None:
        self._skipped: tuple[int, int] | None = None

    def epoch_ended(self, trainer: pl.Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        progress = epoch_loop.batch_progress
        reached = progress.is_last_batch or progress.current.ready == trainer.num_training_batches
        skipped = trainer.fit_loop.restarting and reached
        self._skipped = epoch_counts(trainer) if skipped else None

    def make_up(self, trainer: pl.Trainer) -> None:
        skipped, self._skipped = self._skipped, None
        if skipped is not None:
            with epoch_as(trainer, skipped):
                trainer.fit_loop.epoch_loop.update_lr_schedulers("epoch", True)


class AfterFileWatch:
    """Names what a module's own ``on_train_batch_end`` changes after its step's file:
    Lightning calls it after every callback's, where the files are written, so a resume
    from that file misses the change (an EMA buffer updated there, a counter). At a save
    in a step's ``on_train_batch_end`` it notes each tensor of the module's state and its
    version counter (bumped by every in-place write); at the next hook (a validation's
    start, the next step's, the epoch's or the fit's end) it compares. No copy, no host
    read: only where the module has such a hook of its own."""

    def __init__(self) -> None:
        self._noted: tuple[int, dict[str, tuple[torch.Tensor, int]]] | None = None
        self.warned = False

    def saved(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ends: StepEnd) -> None:
        current = ends.unfinished(trainer)
        in_batch_end = current is not None and current.plateau  # before the validation
        own_hook = is_overridden("on_train_batch_end", pl_module)
        if self.warned or not in_batch_end or not own_hook:
            return
        state = pl_module.state_dict(keep_vars=True)
        # Private: a tensor's version counter is what sees an in-place write, with no copy
        # of the state and no host read; torch has no public equivalent.
        self._noted = (trainer.global_step, {k: (t, t._version) for k, t in state.items()})

    def changed(self, pl_module: pl.LightningModule) -> str | None:
        """The warning, once, if the module's state changed since the file was noted."""
        noted, self._noted = self._noted, None
        if noted is None:
            return None
        step, tensors = noted
        state = pl_module.state_dict(keep_vars=True)
        moved = [
            name for name, (tensor, version) in tensors.items()
            if state.get(name) is not tensor or tensor._version != version
        ]  # fmt: skip
        if not moved:
            return None
        self.warned = True
        return (
            f"ExactResume: {type(pl_module).__name__}.on_train_batch_end changed "
            f"{', '.join(moved[:5])}{' ...' if len(moved) > 5 else ''} after the file of step "
            f"{step} was written (Lightning calls the module's hook after the callbacks', "
            "where files are written): a resume from that file misses the change. Make it "
            "in a callback listed before the checkpoint callbacks, or in the module's "
            "on_before_zero_grad or optimizer_step, which run before the files"
        )
