"""``assert_resumes_exactly``: train a LightningModule uninterrupted and interrupted (a real
``.ckpt`` written by ``ModelCheckpoint``, resumed in a fresh Trainer), and name the first
divergence between the two."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint
from typing_extensions import override

from lit_spikes.testing.record import Record, Recorder
from lit_spikes.testing.verdict import Report, compare, format_report

ModelFactory = Callable[[], pl.LightningModule]
DataFactory = Callable[[], Any]
"""Returns a LightningDataModule, a train loader, or a (train loader, val loader) pair."""
CallbacksFactory = Callable[[], Sequence[Callback]]

TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "max_epochs": -1,  # the run ends at ``steps``, however many epochs that takes
}
RESERVED = {
    "max_steps": "give steps= instead",
    "callbacks": "give callbacks= (a factory returning the list) instead",
    "default_root_dir": "the check writes under its own directory (workdir=)",
    "enable_checkpointing": "the check writes its own checkpoint with ModelCheckpoint",
}
CHECKPOINT_NAME = "resume"


class CheckInputError(ValueError):
    """The check's own input is wrong (not the module under check); the message names the
    argument and the fix."""


class ResumeNotExact(AssertionError):
    """The resumed run is not the uninterrupted one; ``report`` says where and why."""

    def __init__(self, report: Report) -> None:
        super().__init__(format_report(report))
        self.report = report


@dataclass(frozen=True)
class Plan:
    """Everything a run of the check needs; picklable when the factories are module-level."""

    model: ModelFactory
    data: DataFactory | None
    callbacks: CallbacksFactory | None
    steps: int
    resume_at: int
    seed: int = 0
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    ignore_attributes: tuple[str, ...] = ()


class _StopAt(Callback):
    """Ends the interrupted run's first half after step ``step`` (its checkpoint is written
    by ModelCheckpoint in the same hook): same max_steps as the uninterrupted run, so that
    schedules sized from the Trainer are the same."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(plan: Plan, new_process: bool) -> None:
    """One clear error for bad input, before anything runs or is written."""
    if not _is_int(plan.steps) or not _is_int(plan.resume_at):
        raise CheckInputError(
            f"steps={plan.steps!r} and resume_at={plan.resume_at!r} must be whole numbers"
        )
    if not 0 < plan.resume_at < plan.steps:
        raise CheckInputError(
            f"resume_at={plan.resume_at} must be after step 0 and before steps={plan.steps}: "
            "the check interrupts the run there and resumes it"
        )
    if not _is_int(plan.seed):
        raise CheckInputError(f"seed={plan.seed!r} must be a whole number")
    names = plan.ignore_attributes
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise CheckInputError(
            f"ignore_attributes={names!r} must be attribute names, e.g. ('history',)"
        )
    for name in ("model", "data", "callbacks"):
        factory = getattr(plan, name)
        if factory is None and name != "model":
            continue
        if not callable(factory):
            raise CheckInputError(
                f"{name}={factory!r} is not a factory: pass a class or a function that "
                f"returns a fresh one (each of the check's runs builds its own)"
            )
    reserved = sorted(set(plan.trainer_kwargs) & set(RESERVED))
    if reserved:
        why = "; ".join(f"{k}: {RESERVED[k]}" for k in reserved)
        raise CheckInputError(f"trainer_kwargs may not set {', '.join(reserved)} ({why})")
    if new_process:
        _check_picklable(plan)


def _check_picklable(plan: Plan) -> None:
    for name in ("model", "data", "callbacks", "trainer_kwargs"):
        value = getattr(plan, name)
        where = getattr(value, "__module__", None)
        problem = "is defined in __main__" if where == "__main__" else None
        if problem is None:
            try:
                pickle.dumps(value)
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                problem = f"cannot be passed by import path ({error})"
        if problem is not None:
            raise CheckInputError(
                f"new_process=True: {name}={value!r} {problem}; define it at module level "
                "in an importable module (a lambda or a function inside a test cannot "
                "cross to the new process)"
            )


def _fit_arguments(data: Any) -> dict[str, Any]:
    if data is None:
        return {}
    if isinstance(data, pl.LightningDataModule):
        return {"datamodule": data}
    if isinstance(data, tuple) and len(data) == 2:
        return {"train_dataloaders": data[0], "val_dataloaders": data[1]}
    return {"train_dataloaders": data}


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's info lines (GPU available, restoring states, ...) times three runs would
    bury the check's report; its warnings still show."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def fit_once(
    plan: Plan,
    root: Path,
    *,
    record: bool = True,
    capture_at: int | None = None,
    stop_at: int | None = None,
    ckpt_path: Path | None = None,
    built: dict[str, list[Any]] | None = None,
) -> Record | None:
    """One run of the check, built fresh from the seed and the factories: to ``plan.steps``,
    or to ``stop_at``, with a ModelCheckpoint file ``root/checkpoints/resume.ckpt`` written
    every ``plan.resume_at`` steps;
    ``built`` gets what each factory returned."""
    pl.seed_everything(plan.seed, verbose=False)
    module = plan.model()
    if not isinstance(module, pl.LightningModule):
        raise CheckInputError(
            f"model() returned {type(module).__name__}, not a LightningModule: pass the "
            "module's class or a function that returns one"
        )
    data = plan.data() if plan.data is not None else None
    own_loader = type(module).train_dataloader is not pl.LightningModule.train_dataloader
    if data is None and not own_loader:
        raise CheckInputError(
            f"{type(module).__name__} has no train_dataloader and no data was given: pass "
            "data= (a factory of a DataModule or a train loader; --data on the command line)"
        )
    callbacks = list(plan.callbacks()) if plan.callbacks is not None else []
    if built is not None:
        built.update(model=[module], data=[data] if data is not None else [], callbacks=callbacks)
    # Every run writes the check's checkpoint at the resume step (the uninterrupted and the
    # resumed run too): what a save does to the run (ExactResume fixes the RNG states the
    # next step starts from, whatever validation draws first) then happens in all three.
    own: list[Callback] = [_StopAt(stop_at)] if stop_at is not None else []
    own.append(
        ModelCheckpoint(
            dirpath=root / "checkpoints",
            filename=CHECKPOINT_NAME,
            every_n_train_steps=plan.resume_at,
            enable_version_counter=False,
        )
    )
    recorder = Recorder(capture_at, tuple(own), plan.ignore_attributes) if record else None
    everything = [*callbacks, *own, *([recorder] if recorder else [])]
    checkpointing = any(isinstance(c, Checkpoint) for c in everything)
    with warnings.catch_warnings(), _quiet_lightning():
        trainer = pl.Trainer(
            **{**TRAINER_DEFAULTS, **plan.trainer_kwargs},
            max_steps=plan.steps,
            callbacks=everything,
            default_root_dir=root,
            enable_checkpointing=checkpointing,
        )
        # A stateful callback of the check's first half missing in the resumed one, and its
        # ModelCheckpoint's directory moved (each run writes under its own): not the user's.
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint.*")
        warnings.filterwarnings("ignore", message="The dirpath has changed from")
        trainer.fit(module, **_fit_arguments(data), ckpt_path=ckpt_path)
    return recorder.record if recorder else None


def _resume_in_new_process(plan: Plan, root: Path, ckpt_path: Path) -> Record:
    """The resumed half, under ``root / "resumed"`` as in this process, in a new one."""
    spec, out = root / "resume-spec.pkl", root / "resumed-record.pt"
    # The process settings a step's numerics depend on, as here (what the user's own
    # script would set again): threads and subnormal flushing.
    from lit_spikes.callbacks.fingerprint import flush_denormal_enabled

    settings = {"num_threads": torch.get_num_threads(), "flush_denormal": flush_denormal_enabled()}
    spec.write_bytes(pickle.dumps((plan, ckpt_path, settings)))
    env = dict(os.environ)
    # The factories' modules import in the child as they did here (a test module, say).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())
    done = subprocess.run(
        [sys.executable, "-m", "lit_spikes.testing.child", str(spec), str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"the resumed half in a new process failed (exit {done.returncode}):\n"
            f"{done.stderr[-3000:]}"
        )
    return Record.from_dict(torch.load(out, weights_only=True))


def _refuse_shared(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> None:
    """A factory that hands out the same object twice carries one run's state into the
    next (a loader's position, a callback's count): the comparison would mean nothing."""
    for name, objects in second.items():
        shared = [o for o in objects if any(o is p for p in first.get(name, []))]
        if shared:
            raise CheckInputError(
                f"{name}() returned the same {type(shared[0]).__name__} object to two runs: "
                "it must build a fresh one at each call (each run starts from nothing, as "
                "a resumed process does)"
            )


def run_check(plan: Plan, root: Path, *, new_process: bool = False) -> Report:
    """The check's three runs under ``root``, compared (``validate`` the plan first)."""
    reference_built: dict[str, list[Any]] = {}
    reference = fit_once(
        plan, root / "uninterrupted", capture_at=plan.resume_at, built=reference_built
    )
    assert reference is not None
    if reference.final_step != plan.steps:
        raise CheckInputError(
            f"the uninterrupted run stopped at step {reference.final_step}, not at "
            f"steps={plan.steps}: its data ran out (max_epochs in trainer_kwargs) or something "
            "stopped it; give fewer steps or more data"
        )
    first_root = root / "interrupted"
    first_built: dict[str, list[Any]] = {}
    first_half = fit_once(plan, first_root, stop_at=plan.resume_at, built=first_built)
    _refuse_shared(reference_built, first_built)
    ckpt = first_root / "checkpoints" / f"{CHECKPOINT_NAME}.ckpt"
    assert first_half is not None
    if first_half.final_step != plan.resume_at or not ckpt.is_file():
        raise RuntimeError(
            f"the interrupted run stopped at step {first_half.final_step} without writing "
            f"{ckpt} at step {plan.resume_at}"
        )
    resumed = (
        _resume_in_new_process(plan, root, ckpt)
        if new_process
        else fit_once(plan, root / "resumed", capture_at=plan.resume_at, ckpt_path=ckpt)
    )
    assert resumed is not None
    return compare(
        reference,
        resumed,
        steps=plan.steps,
        resume_at=plan.resume_at,
        first_half=first_half,
        new_process=new_process,
    )


def check_resume(
    model: ModelFactory,
    data: DataFactory | None = None,
    callbacks: CallbacksFactory | None = None,
    *,
    steps: int,
    resume_at: int,
    seed: int = 0,
    new_process: bool = False,
    trainer_kwargs: dict[str, Any] | None = None,
    ignore_attributes: Sequence[str] = (),
    workdir: str | Path | None = None,
) -> Report:
    """Like ``assert_resumes_exactly`` but returns the report whatever it says."""
    # A bare string stays one, for validate to refuse: tuple("history") would be letters.
    names: Any = (
        ignore_attributes if isinstance(ignore_attributes, str) else tuple(ignore_attributes)
    )
    kwargs = dict(trainer_kwargs or {})
    plan = Plan(model, data, callbacks, steps, resume_at, seed, kwargs, names)
    validate(plan, new_process)
    if workdir is not None:
        return run_check(plan, Path(workdir), new_process=new_process)
    with tempfile.TemporaryDirectory(prefix="check-resume-") as tmp:
        return run_check(plan, Path(tmp), new_process=new_process)


def assert_resumes_exactly(
    model: ModelFactory,
    data: DataFactory | None = None,
    callbacks: CallbacksFactory | None = None,
    *,
    steps: int,
    resume_at: int,
    seed: int = 0,
    new_process: bool = False,
    trainer_kwargs: dict[str, Any] | None = None,
    ignore_attributes: Sequence[str] = (),
    workdir: str | Path | None = None,
) -> Report:
    """Train ``model()`` on ``data()`` with ``callbacks()`` to ``steps`` uninterrupted, and
    again interrupted at ``resume_at`` (a ModelCheckpoint ``.ckpt``, resumed in a fresh
    Trainer, in a new process if ``new_process``); raise ``ResumeNotExact`` (an
    AssertionError) naming the first divergence and its likely fix unless every component
    is bit-for-bit the same. Each run seeds with ``seed`` and calls the factories afresh;
    ``new_process`` needs module-level factories (they cross by import path);
    ``ignore_attributes`` names plain attributes of the module or of callbacks that are no
    training state (a log of losses, say) and not to be compared."""
    report = check_resume(
        model,
        data,
        callbacks,
        steps=steps,
        resume_at=resume_at,
        seed=seed,
        new_process=new_process,
        trainer_kwargs=trainer_kwargs,
        ignore_attributes=ignore_attributes,
        workdir=workdir,
    )
    if not report.exact:
        raise ResumeNotExact(report)
    return report
