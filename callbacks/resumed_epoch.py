"""A fit resumed at an epoch's start reads its plain loaders as the uninterrupted run's
epoch did (issue 62, case 2).

From its second epoch on, a run builds each epoch's loader iterator after
``on_train_epoch_start`` (where ``ExactResume`` keys the epoch's randomness): a
``DataLoader`` draws its workers' base seed from torch's RNG (or its own ``generator``)
there, and a shuffling sampler its order. A resumed fit builds its first iterator in
``FitLoop.setup_data``, before any epoch hook, and Lightning's restart from a file of an
epoch's last batch calls no ``on_train_epoch_start`` for the epoch it goes on with: the
epoch's reads then came from whatever the resume left (12 of 16 tensors differed, with
0 or 2 workers). So the fit's first ``epoch_loop.on_run_start`` (a public attribute of
the loop objects, where Lightning builds a later epoch's iterator; no public hook sits
between the iterator and the first batch) is wrapped: at a resume at an epoch's start it
keys the epoch as ``on_train_epoch_start`` would have, and builds the iterators anew from
there, as the uninterrupted run did. docs/how-it-works.md
says what cannot be made exact this way (persistent workers).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_spikes.callbacks.loader_positions import (
    rebuilt_at_resume,
    steps_per_epoch,
    train_loaders,
)
from lit_spikes.stacklevel import outside_lightning


def at_an_epochs_start(trainer: pl.Trainer) -> bool:
    """Whether a resumed fit goes on at the first batch of ``trainer.current_epoch``
    (a file of an epoch's last batch); not where its first run of the epoch loop only
    finishes the file's epoch (a file of the epoch's end), nor mid-epoch."""
    per_epoch = steps_per_epoch(trainer)
    step = trainer.global_step
    return per_epoch > 0 and step > 0 and step == trainer.current_epoch * per_epoch


def epoch_trained(trainer: pl.Trainer) -> bool:
    """Whether the epoch the fit goes on with trained all its batches: a file written at
    its end (``ModelCheckpoint``'s default, in ``on_train_epoch_end``), whose restart
    under ``max_steps`` would otherwise fetch and train one batch more in it (Lightning
    issue 19403: its epoch loop waits for a validation that does not come)."""
    batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    return batches >= trainer.num_training_batches


def start_skipped(trainer: pl.Trainer) -> bool:
    """Whether Lightning's restart skipped the epoch's start (a file of the epoch
    before's last batch): the fit loop counts an epoch ready before its
    ``on_train_epoch_start`` hooks, and this one it never counted."""
    progress = trainer.fit_loop.epoch_progress
    return progress.total.ready == progress.total.completed


def count_the_epoch_started(trainer: pl.Trainer) -> None:
    """The epoch Lightning's restart never counts ready and started: the next file then
    held other epoch counts than the run's, and a resume from it under ``max_epochs``
    trained an epoch more."""
    trainer.fit_loop.epoch_progress.increment_ready()
    trainer.fit_loop.epoch_progress.increment_started()


def finish_without_training(trainer: pl.Trainer, data_fetcher: Any) -> None:
    """The file's epoch trained all its batches: its loop ends without fetching one more,
    and is counted processed once (Lightning's restart counts it again at its end, and a
    ``max_epochs`` run then ended an epoch early)."""
    data_fetcher.done = True  # its next fetch ends the epoch
    # The fit loop's epoch trackers count processed epochs too (typed as their base class)
    total: Any = trainer.fit_loop.epoch_progress.total
    current: Any = trainer.fit_loop.epoch_progress.current
    if total.processed > total.completed:
        current.processed -= 1
        total.processed -= 1


def start_the_epoch(trainer: pl.Trainer, own: Callback) -> None:
    """The epoch's start Lightning's restart skipped: every other callback's
    ``on_train_epoch_start`` (a finetuning unfreeze, an accumulation schedule), in their
    order; the module's own is said, not called (one that logs cannot be called outside
    Lightning's loop)."""
    module = trainer.lightning_module
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if callback is not own:
            callback.on_train_epoch_start(trainer, module)
    if is_overridden("on_train_epoch_start", module):
        warnings.warn(
            f"ExactResume: the fit goes on at the start of epoch {trainer.current_epoch} "
            f"(global step {trainer.global_step}) from a file of the epoch before's last "
            "batch, whose restart Lightning begins with no on_train_epoch_start: the "
            f"callbacks' ran here, but {type(module).__name__}'s own does not run for that "
            "epoch in the resumed run (a module's hook may log, which only Lightning's loop "
            "can call); a file of another step resumes it",
            stacklevel=outside_lightning(),
        )


def rebuild_resumed_epoch(
    trainer: pl.Trainer, own: Callback, start_epoch: Callable[[int], None]
) -> Callable[[], None]:
    """Wrap the fit's epoch loop's first ``on_run_start`` (called after the epoch loop's
    reset, before its first batch) so that a resume at an epoch's start whose start
    Lightning skipped counts it, calls ``start_epoch(epoch)`` (``own``'s keying of it) and
    the other callbacks' ``on_train_epoch_start``, and builds the train iterators anew;
    returns the unwrapping. The wrapper removes itself as it runs: none
    of this project's frames stays on the stack while the epoch trains."""
    loop = trainer.fit_loop.epoch_loop
    if "on_run_start" in vars(loop):
        return lambda: None  # wrapped already (one ExactResume per Trainer)
    original = loop.on_run_start

    def on_run_start(data_fetcher: Any) -> None:
        loop.__dict__.pop("on_run_start", None)  # the fit's first epoch only
        resumed = trainer.fit_loop.is_resuming and at_an_epochs_start(trainer)
        if resumed and start_skipped(trainer):
            count_the_epoch_started(trainer)
            start_epoch(trainer.current_epoch)
            start_the_epoch(trainer, own)
        if resumed and rebuilt_at_resume(train_loaders(trainer)):
            iter(data_fetcher)  # what the run's epoch_loop.on_run_start did here
        original(data_fetcher)
        if trainer.fit_loop.is_resuming and epoch_trained(trainer):
            finish_without_training(trainer, data_fetcher)

    loop.on_run_start = on_run_start  # type: ignore[method-assign]
    return lambda: loop.__dict__.pop("on_run_start", None)
