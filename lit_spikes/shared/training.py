"""Building Trainers the way every script, test and the CLI of this project runs them:
the tools and the demo build theirs here, below both (issue 63)."""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins import CheckpointIO
from typing_extensions import override

from lit_spikes.callbacks.common import validates_at_this_step_anyway
from lit_spikes.checkpoints import AtomicCheckpointIO, remove_leftovers
from lit_spikes.shared.progress import with_step_progress_bar
from lit_spikes.shared.tb import RunLogger

if TYPE_CHECKING:
    from lit_spikes.callbacks.run_lock import RunDirectoryLock

CHECKPOINT_DIRNAME = "checkpoints"
"""The folder of a run's checkpoint files (``<run>/checkpoints``), for ``RunSpec`` and
``lit-spikes fit`` alike."""

CHECKPOINT_FILENAME = "{step}"
"""ModelCheckpoint's name pattern: files are called ``step=<k>.ckpt``."""


BRANCH_WARNINGS = (
    ".*does not have many workers.*",
    ".*callbacks used to create the checkpoint need to be provided.*",
    ".*The dirpath has changed from.*",
    ".*exists and is not empty.*",
    ".*`training_step` returned `None`.*",
    ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
    ".*the checkpoint was trained with data seed.*",
)
"""Lightning's warnings that every branch resumed from another run's file would print
(each branch deliberately runs other callbacks than the run that wrote the file), and the
data-seed change a branch asks for on purpose (demo 1's row says so in its table)."""


@contextmanager
def quiet_branches() -> Iterator[None]:
    """For scripts that run many branches under their own report: Lightning's info
    messages (``GPU available: False``, tips) and ``BRANCH_WARNINGS`` are left out;
    every other warning still shows."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # never lower a level a user raised
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        with warnings.catch_warnings():
            for message in BRANCH_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def ddp_env(repo: str | Path) -> dict[str, str]:
    """Environment for a script that launches DDP processes itself on this machine: one
    thread each, ``repo`` importable, and none of a surrounding launcher's variables
    (SLURM, torchrun), which Lightning would follow instead of starting a fresh group."""
    launcher = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK"}
    launcher |= {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"}
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM_")}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}


def step_checkpoint(dirpath: str | Path, every_n_steps: int) -> ModelCheckpoint:
    """A ModelCheckpoint writing ``step=<k>.ckpt`` every ``every_n_steps`` steps, keeping all."""
    if every_n_steps < 1:
        raise ValueError(f"checkpoint_every={every_n_steps} must be >= 1")
    return ModelCheckpoint(
        dirpath=dirpath,
        filename=CHECKPOINT_FILENAME,
        every_n_train_steps=every_n_steps,
        save_top_k=-1,
        save_on_train_epoch_end=False,
        auto_insert_metric_name=True,
    )


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where a run rooted at ``run_dir`` keeps its checkpoint of global step ``step``."""
    return Path(run_dir) / CHECKPOINT_DIRNAME / f"step={step}.ckpt"


@dataclass
class RunSpec:
    """How one training run is laid out on disk and driven by its Trainer."""

    log_root: Path
    """TensorBoard root: every run of one comparison shares it (``runs/demo1``)."""
    name: str
    """The run's name: its TensorBoard directory is ``log_root/name``, its checkpoints
    are in ``log_root/name/checkpoints``."""
    max_steps: int
    """Global step at which training ends."""
    checkpoint_every: int | None = None
    """Write ``step=<k>.ckpt`` every this many steps, keeping all (None: no checkpoints)."""
    val_every: int | None = None
    """Validate every this many steps (None: only at the end)."""
    callbacks: Sequence[Callback] = field(default_factory=list)
    """Extra callbacks (spike detection, remedies)."""
    progress_bar: bool = True
    """Lightning's progress bar (off in worker processes, which report otherwise)."""
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Anything else for ``pl.Trainer`` (``gradient_clip_val``, ``devices``, ...)."""
    resume_step: int | None = None
    """Global step of the checkpoint this run resumes from: TensorBoard drops whatever an
    earlier run logged into the same directory from that step on (``purge_step``)."""

    def __post_init__(self) -> None:
        self.log_root = Path(self.log_root)  # a str is fine too
        if self.max_steps < 1:
            raise ValueError(f"RunSpec.max_steps={self.max_steps} must be >= 1")
        if "callbacks" in self.trainer_kwargs:  # they would replace the lock and checkpoints
            raise ValueError(
                "RunSpec.trainer_kwargs['callbacks']: give them as RunSpec(callbacks=[...]), "
                "which keeps the run's lock, preemption and step checkpoints beside them"
            )

    @property
    def run_dir(self) -> Path:
        return self.log_root / self.name

    def trainer(self) -> pl.Trainer:
        kwargs: dict[str, Any] = {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": self.max_steps,
            "log_every_n_steps": 1,
            "val_check_interval": self.val_every or self.max_steps,
            "check_val_every_n_epoch": None,
            "num_sanity_val_steps": 0,
            "enable_model_summary": False,
            "enable_checkpointing": self.checkpoint_every is not None,
            "enable_progress_bar": self.progress_bar,
            "default_root_dir": str(self.run_dir),
        }
        kwargs.update(self.trainer_kwargs)
        logger = RunLogger(
            save_dir=str(self.log_root),
            name=self.name,
            version="",
            purge_step=self.resume_step,
            hparams_metric=None,  # the demos' branch runner records each row's own
        )
        parts = standard_run(
            kwargs,
            self.run_dir,
            checkpoint_every=self.checkpoint_every,
            given=self.callbacks,
            final_checkpoint=False,  # as RunSpec always did: its runs' files stay the same
            logger=logger,
        )
        assert parts.lock is not None  # training=True
        kwargs = parts.trainer_kwargs
        kwargs["callbacks"] = [parts.lock, *self.callbacks, *parts.callbacks]
        trainer = pl.Trainer(**kwargs)
        claim_run_directory(parts.lock, trainer)
        return trainer


@dataclass
class StandardRun:
    """What every lit-spikes run adds to its Trainer (``standard_run``)."""

    lock: RunDirectoryLock | None
    """The run directory's lock (None: a run that trains nothing, ``validate``); the
    caller places it among its callbacks and takes it with ``claim_run_directory``."""
    callbacks: list[Callback]
    """To come after the lock and the run's own callbacks: preemption, step and final
    checkpoints, ``ValidateAtEnd``, a step progress bar."""
    trainer_kwargs: dict[str, Any]
    """The Trainer's keyword arguments with ``enable_checkpointing``, ``logger`` and
    ``plugins`` set as the run needs."""


def standard_run(
    trainer_kwargs: dict[str, Any],
    run_dir: str | Path,
    *,
    checkpoint_every: int | None,
    given: Sequence[Any] = (),
    training: bool = True,
    final_checkpoint: bool = True,
    logger: Any = None,
) -> StandardRun:
    """The standard set of a run under ``run_dir``, for ``RunSpec`` and ``lit-spikes
    fit`` alike (one place to change it): the lock; with ``checkpoint_every`` (None: no
    checkpoints) a ``PreemptionCheckpoint``, ``step=<k>.ckpt`` every that many steps and
    (``final_checkpoint``) the last step's; ``ValidateAtEnd`` where the validation
    interval misses the last step; a step progress bar unless ``given`` (the run's own
    callbacks) has a bar, the bar is off or ``max_steps`` is not set; ``logger`` where
    ``trainer_kwargs`` has none (None or True); the atomic checkpoint plugin.
    ``training=False``: only the logger and the plugin. ``trainer_kwargs`` itself is
    left as it is."""
    # Imported here: the callbacks package imports this module's neighbours.
    from lit_spikes.callbacks.final_checkpoint import FinalCheckpoint
    from lit_spikes.callbacks.preemption import PreemptionCheckpoint
    from lit_spikes.callbacks.run_lock import RunDirectoryLock

    kwargs = dict(trainer_kwargs)
    lock = RunDirectoryLock(run_dir) if training else None
    callbacks: list[Callback] = []
    checkpoints = training and checkpoint_every is not None
    if checkpoints:
        assert checkpoint_every is not None  # for mypy: checkpoints says so
        dirpath = Path(run_dir) / CHECKPOINT_DIRNAME
        callbacks.append(PreemptionCheckpoint(dirpath))
        callbacks.append(step_checkpoint(dirpath, checkpoint_every))
        if final_checkpoint:
            callbacks.append(FinalCheckpoint(dirpath, checkpoint_every))  # if off-interval
    else:
        kwargs["enable_checkpointing"] = False  # no default ModelCheckpoint either
    interval, steps = kwargs.get("val_check_interval"), kwargs.get("max_steps", -1)
    if training and ValidateAtEnd.needed(interval, steps):
        callbacks.append(ValidateAtEnd())  # the final model's validation
    if kwargs.get("enable_progress_bar", True) is not False and steps is not None and steps > 0:
        # (a run bounded by epochs or time only: Lightning's own bar, which counts those)
        callbacks = with_step_progress_bar([*given, *callbacks])[len(given) :]
    if logger is not None and kwargs.get("logger") in (None, True):
        kwargs["logger"] = logger
    kwargs["plugins"] = with_checkpoint_io(kwargs)
    return StandardRun(lock, callbacks, kwargs)


def claim_run_directory(lock: RunDirectoryLock, trainer: pl.Trainer) -> None:
    """Take the run directory for ``trainer`` before its fit (Lightning's logger writes a
    file before any setup hook runs) and clear the leftovers of a killed save there (the
    directory is this run's now); a failure releases the lock: no fit will."""
    lock.acquire_for(trainer)
    try:
        remove_leftovers(lock.directory / CHECKPOINT_DIRNAME)
    except BaseException:
        lock.release()
        raise


class ValidateAtEnd(Callback):
    """Validates after the run's last step (``max_steps``) when the schedule in steps
    would not (``val_check_interval`` that does not divide it): a fit ends with its final
    model's validation. It asks Lightning to stop at that step, which validates at once
    (the validation Lightning runs for an early stop)."""

    @staticmethod
    def needed(val_check_interval: Any, max_steps: int) -> bool:
        """Whether a run validating every ``val_check_interval`` steps (an int; anything
        else: not a schedule in steps) misses its last step: only then is this callback
        added (each callback costs the loop its hook calls at every step)."""
        every = val_check_interval
        # max_steps -1 (no limit, a module's own ending): no last step to miss
        return isinstance(every, int) and every > 0 and max_steps > 0 and max_steps % every != 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == trainer.max_steps and not validates_at_this_step_anyway(trainer):
            trainer.should_stop = True


def with_checkpoint_io(trainer_kwargs: dict[str, Any]) -> list[Any]:
    """The ``plugins`` of ``trainer_kwargs`` (one or a list, or none) with an
    ``AtomicCheckpointIO`` added, unless one of them is a CheckpointIO already: other
    plugins (a cluster environment, a precision) must not cost the atomic writes."""
    given = trainer_kwargs.get("plugins") or []
    plugins = list(given) if isinstance(given, list | tuple) else [given]
    if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
        plugins.append(AtomicCheckpointIO())
    return plugins


def unwritable_directory(path: Path) -> str | None:
    """Why files cannot be written into ``path`` (None: they can), checked without
    creating it: a run refused later, for another reason, leaves no empty directory."""
    existing = path
    try:
        while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
            existing = existing.parent
        if existing.is_symlink() and not existing.exists():
            return f"cannot be created ({existing} is a dangling symbolic link)"
        if not existing.is_dir():
            return f"cannot be created ({existing} is not a directory)"
    except OSError as error:  # a parent that may not be searched
        return f"cannot be checked ({error.strerror}: {error.filename})"
    try:  # a directory that exists may still refuse files (read-only, someone else's)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        if existing == path:
            return f"is not writable ({error.strerror})"
        return f"cannot be created ({error.strerror} in {existing})"
    return None
