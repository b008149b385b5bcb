"""Shared tiny configs and run helpers: every test trains a model small enough to take
well under a second per run, with the same code path as the demos."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks.run_lock import LOCK_NAME, RunDirectoryLock
from lit_spikes.checkpoints import CheckpointError, checkpoint_step
from lit_spikes.demo.data import DataConfig, StepDataModule
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import OptimConfig, TinyGPTModule
from lit_spikes.demo.world import WorldConfig
from lit_spikes.shared.training import RunSpec
from lit_spikes.shared.training import ddp_env as training_ddp_env

TINY_GPT = GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=16)
TINY_DATA = DataConfig(
    seed=3, batch_size=4, block_size=16, val_batch_size=32, world=WorldConfig(num_chars=20_000)
)
TINY_OPTIM = OptimConfig(peak_lr=0.01, warmup_steps=4, max_steps=20)
TINY_CLI = [
    "--model.gpt.n_layer",
    "2",
    "--model.gpt.n_head",
    "2",
    "--model.gpt.d_model",
    "16",
    "--model.gpt.block_size",
    "16",
    "--data.config.block_size",
    "16",
    "--data.config.batch_size",
    "4",
    "--data.config.world.num_chars",
    "20000",
    "--model.optim.max_steps",
    "20",
    "--model.optim.warmup_steps",
    "4",
    "--trainer.limit_val_batches",
    "0",
    "--trainer.enable_progress_bar",
    "false",
]
"""``lit-spikes fit`` options for the tiny configs above."""


@dataclass
class Run:
    module: TinyGPTModule
    datamodule: StepDataModule
    spec: RunSpec
    trainer: pl.Trainer

    @property
    def losses(self) -> dict[int, float]:
        return {int(r["step"]): r["loss"] for r in self.module.history}


def fit(
    root: Path,
    name: str,
    max_steps: int,
    *,
    gpt: GPTConfig = TINY_GPT,
    optim: OptimConfig = TINY_OPTIM,
    data: DataConfig = TINY_DATA,
    ckpt_path: str | Path | None = None,
    checkpoint_every: int | None = None,
    callbacks: Sequence[Callback] = (),
    val_every: int | None = None,
    model_seed: int = 0,
    **trainer_kwargs: Any,
) -> Run:
    """Fit a tiny model to ``max_steps`` (from ``ckpt_path`` if given) under ``root/name``."""
    module = TinyGPTModule(gpt=gpt, optim=optim, model_seed=model_seed)
    datamodule = StepDataModule(data)
    if val_every is None:
        trainer_kwargs.setdefault("limit_val_batches", 0)
    spec = RunSpec(
        log_root=root,
        name=name,
        max_steps=max_steps,
        checkpoint_every=checkpoint_every,
        val_every=val_every,
        callbacks=list(callbacks),
        progress_bar=False,
        trainer_kwargs=trainer_kwargs,
        resume_step=_resume_step(ckpt_path),
    )
    with warnings.catch_warnings():
        # As in pyproject.toml's filters, for the tests' scripts that call fit in a new
        # process, where pytest's filters do not reach.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        if ckpt_path is not None and Path(ckpt_path).parent.parent != spec.run_dir:
            # A branch: Lightning says that its checkpoints go elsewhere than the run's it
            # resumes, and asks for that run's callbacks, as for every branch of the demos.
            for message in (".*The dirpath has changed from.*", ".*callbacks used to create"):
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
        trainer = spec.trainer()
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return Run(module, datamodule, spec, trainer)


REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core (make test): two threads each would fight over the cores.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the files' own order
    # Under `--dist loadfile` a file's tests go to one worker, so a module-scoped run they
    # share is trained once. The files with slow end-to-end tests first: the workers take
    # them at the start and share the short ones at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


_LEFT_RUNNING: dict[int, str] = {}
"""multiprocessing children alive after a test, by pid: the test that left each."""


@pytest.fixture(autouse=True)
def _note_children_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for child in multiprocessing.active_children():
        _LEFT_RUNNING.setdefault(child.pid or 0, request.node.nodeid)


def _unwrap_loader_classes() -> list[str]:
    """Puts back torch's own ``__init__``/``__setattr__``/``__delattr__`` of DataLoader and
    BatchSampler where a wrapper (``functools.wraps``: it has ``__wrapped__``) is left on
    them; returns the names it put back."""
    left = []
    for cls in (torch.utils.data.DataLoader, torch.utils.data.BatchSampler):
        for name in ("__init__", "__setattr__", "__delattr__"):
            method = cls.__dict__.get(name)
            if hasattr(method, "__wrapped__"):
                left.append(f"{cls.__name__}.{name}")
                while hasattr(method, "__wrapped__"):
                    method = method.__wrapped__
                setattr(cls, name, method)
    return left


@pytest.fixture(autouse=True)
def _no_loader_wrappers_left() -> Iterator[None]:
    """Lightning wraps DataLoader's methods while a ``*_dataloader()`` hook runs and leaves
    the wrappers on when the hook raises; with them, a StatefulDataLoader keeps every epoch's
    iterator and its worker processes alive (a later GC joined 22 of them for 110 s).
    The test that leaves them fails; the next ones get torch's methods back."""
    yield
    left = _unwrap_loader_classes()
    assert not left, (
        f"this test left Lightning's wrappers on {left}: a *_dataloader() hook raised inside "
        "a fit; raise from setup() instead (docs/private-apis.md, row 11)"
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    # A pool worker left alive keeps the interpreter from exiting after the summary (CI ran
    # into its time limit so): end it, and name the test that left it.
    for child in multiprocessing.active_children():
        print(
            f"\nconftest: ended {child.name} (pid {child.pid}), alive since "
            f"{_LEFT_RUNNING.get(child.pid or 0, 'the session start')}",
            file=sys.stderr,
        )
        child.kill()
        child.join(5)


def ddp_env() -> dict[str, str]:
    """Environment for a test that launches DDP processes itself (``training.ddp_env``)."""
    return training_ddp_env(REPO)


def _resume_step(ckpt_path: str | Path | None) -> int | None:
    """The step to purge TensorBoard from; None for a file the Trainer itself must reject."""
    try:
        return checkpoint_step(ckpt_path) if ckpt_path else None
    except CheckpointError:
        return None


class NaNLossModule(TinyGPTModule):
    """TinyGPTModule whose loss at global step ``nan_step`` is NaN (a planted fault)."""

    def __init__(self, *args: Any, nan_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nan_step = nan_step
        forward = self.model.forward

        def poisoned(idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
            out = forward(idx, targets)
            if self.training and targets is not None and self.global_step == self.nan_step:
                return out._replace(loss=out.loss * float("nan"))
            return out

        self.model.forward = poisoned  # type: ignore[method-assign]


def tb_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard reads from a run directory: ``(step, value)`` per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def tb_marks(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The spike marks of a run directory (``SpikeMarks``: a one-point run per episode
    onset under ``spikes/``), merged: ``(step, value)`` per tag, in step order."""
    marks: dict[str, list[tuple[int, float]]] = {}
    for run in sorted((Path(run_dir) / "spikes").glob("step_*")):
        for tag, points in tb_scalars(run).items():
            marks.setdefault(tag, []).extend(points)
    return {tag: sorted(points) for tag, points in marks.items()}


def tb_steps(run_dir: str | Path) -> dict[str, list[int]]:
    """The steps of each scalar tag of a run directory, in TensorBoard's order."""
    return {tag: [step for step, _ in values] for tag, values in tb_scalars(run_dir).items()}


def load_ckpt(path: str | Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_states_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Parameters, AdamW state (exp_avg, exp_avg_sq, step) and scheduler state of two
    checkpoints are bit-identical."""
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), f"parameter {key} differs"
    assert len(a["optimizer_states"]) == len(b["optimizer_states"]) == 1
    state_a, state_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert state_a.keys() == state_b.keys() and state_a
    for index, tensors in state_a.items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(tensors[name], state_b[index][name]), f"{name} of param {index}"
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["global_step"] == b["global_step"]


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One tiny run to step 20 with checkpoints every 5 steps, trained once a session for
    the tests that only resume from (or refuse) its files: read it, write elsewhere."""
    return fit(tmp_path_factory.mktemp("tiny_reference"), "reference", 20, checkpoint_every=5)


@pytest.fixture
def tiny() -> dict[str, Any]:
    """The tiny configs, for tests that vary one field with ``dataclasses.replace``."""
    return {"gpt": TINY_GPT, "data": TINY_DATA, "optim": TINY_OPTIM, "replace": replace}


def wait_for(
    child: subprocess.Popen[Any], ready: Callable[[], bool], what: str, timeout_s: float
) -> None:
    """Poll until ``ready()`` while ``child`` runs; fail the test, naming ``what``, if the
    child exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if child.poll() is not None:
            pytest.fail(f"the process exited with {child.returncode} before {what}")
        time.sleep(0.01)
    pytest.fail(f"{what} did not happen within {timeout_s} s")


def _hold_directory(directory: Path, ready: Any) -> None:
    # terminate() ends it even if the forking process had a SIGTERM handler installed
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    RunDirectoryLock(directory).acquire()
    ready.set()
    time.sleep(120)  # killed or terminated by the test


@pytest.fixture
def directory_holder() -> Iterator[Callable[[Path], Any]]:
    """Starts a process that holds a run directory's lock until the test ends it; returns
    the process (``.pid`` is what the other run's error names)."""
    context = multiprocessing.get_context("fork")
    started = []

    def start(directory: Path) -> Any:
        ready = context.Event()
        holder = context.Process(target=_hold_directory, args=(directory, ready))
        holder.start()
        started.append(holder)
        assert ready.wait(timeout=30)
        return holder

    yield start
    for holder in started:
        holder.kill()
        holder.join()


_LOCK_PROBE = """
import sys
from pathlib import Path
from filelock import FileLock, Timeout
path = Path(sys.argv[1]).resolve() / sys.argv[2]
path.parent.mkdir(parents=True, exist_ok=True)
try:
    FileLock(path, timeout=0, thread_local=False).acquire()
except Timeout:
    sys.exit(3)
"""


def lock_probe(directory: Path) -> str:
    """What another process gets when it tries to lock ``directory``: the lock
    ``RunDirectoryLock`` takes (a ``FileLock`` on the resolved path, no waiting), from a
    Python that imports only filelock (torch and Lightning would take seconds a probe)."""
    done = subprocess.run(
        [sys.executable, "-c", _LOCK_PROBE, str(directory), LOCK_NAME],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if done.returncode == 3:
        return "busy"
    return "free" if done.returncode == 0 else done.stderr


class NaNAtStepModule(TinyGPTModule):
    """TinyGPTModule whose training step 12 returns a NaN loss from a finite forward."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 12:
            self.history[-1]["loss"] = float("nan")
            return loss * float("nan")
        return loss
