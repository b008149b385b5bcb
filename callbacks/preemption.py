"""Stop cleanly on SIGTERM or SIGINT: finish the step, write a checkpoint, exit. Under
SLURM, Lightning's requeue checkpoint waits for the step's end too."""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lit_spikes.callbacks.common import (
    ends_at_this_step,
    trainer_callbacks,
    unused_checkpoint_path,
    validates_at_this_step_anyway,
)
from lit_spikes.callbacks.exact_resume import ExactResume
from lit_spikes.callbacks.step_end import epoch_end_hooks

HANDLED = (signal.SIGTERM, signal.SIGINT)
_log = logging.getLogger(__name__)


@rank_zero_only
def rank_zero_warn_log(message: str) -> None:
    _log.warning(message)


def _how_it_resumes(trainer: pl.Trainer) -> str:
    """What a fit resumed from this step's file continues as: bit-exactly only under
    ExactResume, and but for the epoch's end hooks at an epoch's last batch."""
    if not any(isinstance(c, ExactResume) for c in trainer_callbacks(trainer)):
        return (
            "a fit resumed from it continues the run, not bit-exactly: without ExactResume "
            "Lightning saves no RNG state and skips this step's validation"
        )
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    hooks = epoch_end_hooks(trainer, ExactResume) if last else []
    if hooks:
        return (
            "a fit resumed from it continues bit-exactly but for this epoch's end, which "
            f"Lightning's restart skips: on_train_epoch_end of {', '.join(hooks)}"
        )
    return "a fit resumed from it continues bit-exactly"


def _requeue_signal(trainer: pl.Trainer) -> int | None:
    """The signal on which Lightning's SLURM auto-requeue saves ``hpc_ckpt_<n>.ckpt`` and
    requeues the job (SIGUSR1 unless set), when that is on; None otherwise."""
    # Private: the environment Lightning chose, or the user's plugin; public only on a
    # parallel strategy (trainer.strategy.cluster_environment), none on one device.
    connector = getattr(trainer, "_accelerator_connector", None)
    environment = getattr(connector, "cluster_environment", None)
    if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
        return None
    requeue = environment.requeue_signal or signal.SIGUSR1
    return None if requeue in HANDLED else int(requeue)


def _run_after_checkpoints(trainer: pl.Trainer, callback: Callback) -> None:
    """Move ``callback`` to the end of the Trainer's callbacks, after the checkpoint
    callbacks (which Lightning's callback connector puts last before ``setup``): its
    ``on_train_batch_end`` then sees every other callback's state of the step and the files
    they wrote in it. A new list: a hook loop of Lightning's may be iterating the old one."""
    others = [c for c in trainer_callbacks(trainer) if c is not callback]
    trainer.callbacks = [*others, callback]  # type: ignore[attr-defined]


def _same_directory(trainer: pl.Trainer, dirpath: Path) -> list[ModelCheckpoint]:
    """The Trainer's ModelCheckpoints that write into ``dirpath``."""
    return [
        c
        for c in trainer.checkpoint_callbacks
        if isinstance(c, ModelCheckpoint)
        and c.dirpath is not None
        and Path(c.dirpath).resolve() == dirpath.resolve()
    ]


class PreemptionCheckpoint(Callback):
    """On SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) during training, sets a
    flag; at the next step boundary it writes ``<dirpath>/step=<k>.ckpt`` through the
    Trainer's CheckpointIO and stops the Trainer cleanly, at once: no validation after the
    file (which Lightning runs when a callback stops it) and no steps to reach
    ``min_steps``/``min_epochs``. An interruption then costs nothing: resuming from that
    file continues bit-exactly. A signal in the run's last step writes nothing more (the
    run is complete: ``ended_by_signal``); a second Ctrl-C while the first waits for the
    step's end goes to the handlers from before (it stops a hanging step), a second
    SIGTERM changes nothing.

    Under SLURM with Lightning's auto-requeue (``#SBATCH --signal=USR1@90``), Lightning's
    own handler saves ``hpc_ckpt_<n>.ckpt``, which the requeued job resumes from, the
    moment the signal arrives: in the middle of a step (after AdamW's update but before
    the scheduler's, or with the step's dropout already drawn), which no resume continues
    bit-exactly. This callback holds that signal until the step's end, as it does SIGTERM
    (under DDP every rank at the same step), and calls Lightning's handler there: the
    file is a step boundary's, and training goes on as Lightning's requeue does.

    It runs after the other callbacks (``setup`` moves it last, after the checkpoint
    callbacks, which Lightning puts last), so that its file holds their state of the
    step. Where a ``ModelCheckpoint`` of the same directory wrote a full checkpoint in the
    step's ``on_train_batch_end`` (a step of its interval), that file is the one:
    ``saved_path`` names it and nothing is written again.

    Its signal handlers replace Lightning's (and the default KeyboardInterrupt) only while
    training runs, and the previous handlers come back at the end. Python installs signal
    handlers from the main thread only: a ``fit`` run in another thread trains on with a
    warning that no signal will be caught (Lightning skips its own handlers there too).

    Args:
        dirpath: directory for the checkpoint (the run's ``checkpoints`` directory).

    Example:
        >>> preemption = PreemptionCheckpoint("runs/x/checkpoints")
        >>> trainer = pl.Trainer(callbacks=[preemption])
        >>> trainer.fit(module, datamodule=dm)
        >>> preemption.saved_path  # set when a signal stopped the run
    """

    def __init__(self, dirpath: str | Path) -> None:
        super().__init__()
        self.dirpath = Path(dirpath)
        self.received: int | None = None
        self.saved_path: Path | None = None
        self.ended_by_signal = False
        """A signal arrived in the run's last step: the run is complete (no file of this
        callback's), and whoever runs several (recover, the main job) stops after it."""
        self._previous: dict[int, Any] = {}
        self._requeue: tuple[int, int | None] | None = None
        """(signal, received or None) while Lightning's requeue signal is held here."""
        self._stop_overrides: dict[str, Any] = {}
        self._trainer: weakref.ref[pl.Trainer] | None = None
        self._savers: list[ModelCheckpoint] = []
        """The ModelCheckpoints writing into ``dirpath``."""
        self._saved_before: list[tuple[str, Any]] = []
        """Their ``best_model_path`` and ``current_score`` as the step started."""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None or trainer.state.status != TrainerStatus.RUNNING:
            # Left installed by a fit that failed before this callback's on_exception ran
            # (another one's raised first): the handlers from before take it, as they would
            # have without this callback, and are back for good.
            self._restore_handlers()
            signal.raise_signal(signum)
            return
        if self.received is None:
            self.received = signum
            return
        if signum != signal.SIGINT:
            return  # a SIGTERM again (a scheduler and a launcher both forwarding it): the same stop
        # A second Ctrl-C while the first waits for the step's end (a step that hangs: a
        # stuck collective, a slow read): the handlers from before take it, as if this
        # callback were not there (KeyboardInterrupt, which Lightning shuts down on).
        self._restore_handlers()
        signal.raise_signal(signum)

    def _hold_requeue(self, signum: int, frame: FrameType | None) -> None:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None or trainer.state.status != TrainerStatus.RUNNING or not self._requeue:
            self._restore_handlers()  # as in _handle: left installed by a failed fit
            signal.raise_signal(signum)
            return
        self._requeue = (self._requeue[0], signum)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            _run_after_checkpoints(trainer, self)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.received, self.saved_path, self.ended_by_signal = None, None, False
        self._requeue = None
        self._savers = _same_directory(trainer, self.dirpath)  # their setup set dirpath
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn(
                f"PreemptionCheckpoint: fit runs in thread {threading.current_thread().name!r}, "
                "and Python catches signals in the main thread only: SIGTERM and SIGINT will "
                "not write a checkpoint in this run. Call fit from the main thread for that."
            )
            return
        self._trainer = weakref.ref(trainer)
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        requeue = _requeue_signal(trainer)
        if requeue is not None and callable(signal.getsignal(requeue)):
            # Lightning's requeue handler, installed just before on_train_start
            self._previous[requeue] = signal.signal(requeue, self._hold_requeue)
            self._requeue = (requeue, None)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.saved_path is not None:
            return
        if self._requeue is not None:
            self._requeue_at_step_end(trainer)
        # Under DDP a signal may reach one rank only, or ranks at different steps: they
        # agree each step, so all save (a collective) and stop at the same step.
        received = self.received is not None
        if trainer.world_size > 1:
            received = trainer.strategy.reduce_boolean_decision(received, all=False)
        if not received:
            return
        if ends_at_this_step(trainer):
            # The run is complete at this step: its regular final checkpoint follows, and
            # it ends as finished, not as a preempted run with nothing left to resume.
            self.ended_by_signal = True
            return
        path = self._saved_in_this_step()
        if path is None:
            # Beside another run's file of this step (this run's own is never there yet).
            path = unused_checkpoint_path(self.dirpath, trainer.global_step)
            trainer.save_checkpoint(path, weights_only=False)  # synchronous: on disk now
        self.saved_path = path
        trainer.should_stop = True
        self._stop_now(trainer)
        name = signal.Signals(self.received).name if self.received else "a signal on another rank"
        # A warning, not info: scripts that quiet Lightning's info logs still show it.
        # How to resume is the caller's to say (lit-spikes fit, recover and a script differ).
        rank_zero_warn_log(
            f"Received {name}: stopped after step {trainer.global_step}, checkpoint written "
            f"to {path}; {_how_it_resumes(trainer)}."
        )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # References only (no IO, no host read): compared at a signal in this step's end.
        self._saved_before = [(c.best_model_path, c.current_score) for c in self._savers]

    def _saved_in_this_step(self) -> Path | None:
        """The full checkpoint a ModelCheckpoint of ``dirpath`` wrote in this step's
        ``on_train_batch_end`` (before this callback's), if one did: without a monitor its
        ``best_model_path`` moves to each file it writes; with one, each file it writes
        gets the step's new ``current_score``. A file rewritten under its old name without
        a monitor cannot be told from one of an earlier step: None (this callback writes
        its own)."""
        for saver, (best, score) in zip(self._savers, self._saved_before, strict=True):
            if saver.save_weights_only:
                continue  # no file to resume from
            if saver.monitor is None:
                written = saver.best_model_path if saver.best_model_path != best else None
            elif saver.current_score is not score:
                new = saver.current_score
                written = next((p for p, v in saver.best_k_models.items() if v is new), None)
            else:
                written = None
            if written:
                return self.dirpath / Path(written).name  # named as this callback names its own
        return None

    def _requeue_at_step_end(self, trainer: pl.Trainer) -> None:
        """Call Lightning's requeue handler, held since the signal, now that the step is
        done: it saves ``hpc_ckpt_<n>.ckpt`` (a collective under DDP: every rank agrees on
        the step first) and requeues the job."""
        assert self._requeue is not None
        requeue, received = self._requeue
        held = received is not None
        if trainer.world_size > 1:
            held = trainer.strategy.reduce_boolean_decision(held, all=False)
        if not held:
            return
        self._requeue = (requeue, None)
        handler = self._previous.get(requeue)
        if callable(handler):
            handler(received if received is not None else requeue, None)

    def _stop_now(self, trainer: pl.Trainer) -> None:
        """Make ``should_stop`` stop at this step, with nothing more to run. Lightning
        validates once more when a callback stops it (for an early-stopping monitor): here
        that only spends the signal's grace period, after the checkpoint is written. And it
        trains on past a stop until ``min_steps``/``min_epochs``, steps no file would keep
        (the resumed run still trains to them). A validation due at this step anyway runs
        (a plateau scheduler of this step reads its metric): without ExactResume, a
        resumed run counts it as done; with it, the file says the validation is due and
        the resumed run replays it, since the file holds none of its updates. The
        ModelCheckpoints of ``dirpath`` write nothing more in this fit: at the validation's
        and the epoch's end that Lightning runs after a stop they would write this step
        again, beside the file. All come back at the end."""
        fit_loop = trainer.fit_loop
        self._stop_overrides = {
            "limit_val_batches": trainer.limit_val_batches,
            "min_steps": fit_loop.epoch_loop.min_steps,
            "min_epochs": fit_loop.min_epochs,
        }
        if not validates_at_this_step_anyway(trainer):
            trainer.limit_val_batches = 0
        fit_loop.epoch_loop.min_steps = None
        fit_loop.min_epochs = None
        self._stop_overrides["savers"] = [(c, c.save_top_k, c.save_last) for c in self._savers]
        for saver in self._savers:
            saver.save_top_k, saver.save_last = 0, None

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous, self._requeue = {}, None

    def _restore(self, trainer: pl.Trainer) -> None:
        self._restore_handlers()
        if self._stop_overrides:  # the Trainer as it was given, for a later validate/test
            overrides, self._stop_overrides = self._stop_overrides, {}
            trainer.limit_val_batches = overrides["limit_val_batches"]
            trainer.fit_loop.epoch_loop.min_steps = overrides["min_steps"]
            trainer.fit_loop.min_epochs = overrides["min_epochs"]
            for saver, top_k, last in overrides["savers"]:
                saver.save_top_k, saver.save_last = top_k, last

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore(trainer)
