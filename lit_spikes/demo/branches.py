"""Training runs ("branches") that scripts launch, alone or in parallel worker processes.

A branch is a picklable description of one Trainer run: what to train, from which real
``.ckpt`` file, with which callbacks. ``run_branches`` runs independent branches in
worker processes (one CPU thread each, so every core is busy and every branch computes
exactly what it would alone) and shows one overall progress display.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from types import TracebackType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from typing_extensions import override

from lit_spikes.callbacks.common import trainer_callbacks
from lit_spikes.callbacks.preemption import PreemptionCheckpoint
from lit_spikes.checkpoints import checkpoint_step
from lit_spikes.demo.data import DataConfig, StepDataModule
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import DEFAULT_MODEL_SEED, OptimConfig, TinyGPTModule
from lit_spikes.demo.tensorboard import HPARAM_METRIC
from lit_spikes.shared.tb import write_hparams
from lit_spikes.shared.training import RunSpec, quiet_branches


@dataclass
class Branch:
    """One training run of a comparison: a row of a demo's table."""

    name: str
    """Row name; also its TensorBoard run, ``<log_root>/<name>``."""
    max_steps: int
    """Global step at which it ends."""
    ckpt_path: Path | None = None
    """Lightning checkpoint to resume from (None: train from scratch)."""
    gpt: GPTConfig = field(default_factory=GPTConfig)
    """Model shape."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimiser and schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data seed, batch size, skip set."""
    model_seed: int = DEFAULT_MODEL_SEED
    """Initialisation seed (ignored when resuming: the weights come from the checkpoint)."""
    callbacks: Sequence[Callback] = ()
    """Remedies, detectors: picklable callback instances."""
    checkpoint_every: int | None = None
    """Write ``step=<k>.ckpt`` every this many steps."""
    val_every: int | None = 100
    """Validate every this many steps (and so at the end when it divides ``max_steps``)."""
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Other ``pl.Trainer`` arguments, e.g. ``gradient_clip_val``."""
    label: str = ""
    """Human-readable row label for tables (defaults to ``name``)."""


class BranchInterrupted(Exception):
    """A signal (Ctrl-C, SIGTERM) stopped a branch: its ``PreemptionCheckpoint`` wrote a
    checkpoint and Lightning returned early. The run is not complete, so nothing that
    reads its results may go on (picklable: it comes back from a worker process)."""

    def __init__(self, name: str, step: int, signum: int) -> None:
        super().__init__(name, step, signum)
        self.name, self.step, self.signum = name, step, signum

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name} stopped run {self.name} after step {self.step}"


class WorkerDied(RuntimeError):
    """A worker process died (a signal, the kernel's out-of-memory killer) while it
    trained branches: the pool cannot go on, and these branches have no result."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__(list(names))  # the names alone: it pickles and unpickles whole
        self.names = list(names)

    def __str__(self) -> str:
        lost = f" while training {', '.join(self.names)}" if self.names else ""
        return (
            f"a worker process died{lost} (killed by a signal, or out of memory?): the "
            "branches cannot go on; run it again (with fewer workers if memory ran out)"
        )


@dataclass
class BranchResult:
    """What a finished branch reports back to the script that launched it."""

    name: str
    label: str
    history: list[dict[str, float]]
    val_bpc: float
    state: dict[str, torch.Tensor]
    start_step: int
    wall_s: float
    callback_states: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0
    """``time.time()`` when it began: with ``wall_s`` and ``pid``, a timeline of a job."""
    pid: int = 0
    """The process that trained it."""

    def losses(self) -> dict[int, float]:
        return {int(r["step"]): r["loss"] for r in self.history}

    def window(self, lo: int, hi: int, key: str = "loss") -> float:
        """Largest ``key`` over steps in ``[lo, hi)``."""
        return max(r[key] for r in self.history if lo <= r["step"] < hi)

    def at(self, step: int, key: str = "loss") -> float:
        return next(r[key] for r in self.history if r["step"] == step)


class _Reporter(Callback):
    """Tells the parent process how a branch is doing: ``("progress", name, step)`` every
    few steps, ``("checkpoint", name, step)`` once ``step=<k>.ckpt`` is on disk, and
    ``("spike", name, record)`` for each spike a detector among the callbacks flags.
    Once ``stop`` is set, the branch stops at its next step, as on a SIGTERM."""

    def __init__(
        self, name: str, queue: Any, checkpoint_every: int | None, stop: Any = None, every: int = 5
    ):
        self.name, self.queue, self.every, self.stop = name, queue, every, stop
        self.checkpoint_every = checkpoint_every
        self._spikes_sent = 0
        self._checkpoint_sent = 0

    def _send_checkpoint(self, trainer: pl.Trainer) -> None:
        # ModelCheckpoint saves in on_train_batch_end, before this step's validation and
        # the next batch: whichever of those comes first, the file is complete.
        step = trainer.global_step
        due = self.checkpoint_every and step and step % self.checkpoint_every == 0
        if due and step != self._checkpoint_sent:
            self._checkpoint_sent = step
            self.queue.put(("checkpoint", self.name, step))

    @override
    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # A resumed run's first step is its checkpoint's, in the run that wrote it.
        self._checkpoint_sent = trainer.global_step

    @override
    def on_validation_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # Before validating (0.5 s for the demos' reference): the branches waiting for
        # this file start that much earlier.
        if not trainer.sanity_checking:
            self._send_checkpoint(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.stop is not None and self.stop.is_set():
            # The runner closes on an error: the branch's own SIGTERM path (a preemption
            # checkpoint where it writes them) stops it, rather than training to its end.
            os.kill(os.getpid(), signal.SIGTERM)
        self._send_checkpoint(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._send_checkpoint(trainer)  # the last step's, when no validation followed it

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            self.queue.put(("progress", self.name, step))
        callbacks: list[Callback] = getattr(trainer, "callbacks", [])
        spikes = [s for cb in callbacks for s in getattr(cb, "spikes", [])]
        for spike in spikes[self._spikes_sent :]:
            self.queue.put(("spike", self.name, dict(spike)))
        self._spikes_sent = len(spikes)


def run_branch(
    branch: Branch,
    log_root: Path,
    progress_queue: Any = None,
    progress_bar: bool = True,
    stop: Any = None,
) -> BranchResult:
    """Train one branch to its end and collect its results (``progress_queue``: where it
    reports, see ``_Reporter``; ``stop``: an event that stops it early)."""
    started_at, start = time.time(), time.perf_counter()
    module = TinyGPTModule(gpt=branch.gpt, optim=branch.optim, model_seed=branch.model_seed)
    datamodule = StepDataModule(branch.data)
    callbacks = list(branch.callbacks)
    if progress_queue is not None:
        callbacks.append(_Reporter(branch.name, progress_queue, branch.checkpoint_every, stop))
    spec = RunSpec(
        log_root=log_root,
        name=branch.name,
        max_steps=branch.max_steps,
        checkpoint_every=branch.checkpoint_every,
        val_every=branch.val_every,
        callbacks=callbacks,
        progress_bar=progress_bar and progress_queue is None,
        trainer_kwargs=branch.trainer_kwargs,
        resume_step=_ckpt_step(branch.ckpt_path) if branch.ckpt_path else None,
    )
    # Under a BranchRunner (a report queue) the runner's display is the report.
    quiet = quiet_branches() if progress_queue is not None else _no_many_workers_warning()
    with quiet:
        trainer = spec.trainer()
        trainer.fit(module, datamodule=datamodule, ckpt_path=branch.ckpt_path)
    for callback in trainer_callbacks(trainer):
        if not isinstance(callback, PreemptionCheckpoint):
            continue
        if callback.saved_path is not None or callback.ended_by_signal:  # even at the end
            signum = int(callback.received or signal.SIGINT)
            raise BranchInterrupted(branch.name, trainer.global_step, signum)
    bpc = trainer.callback_metrics.get("val/bpc")
    if trainer.is_global_zero and module.history:
        write_hparams(
            spec.run_dir,
            branch_hparams(branch),
            float(bpc) if bpc is not None else float("nan"),
            int(module.history[-1]["step"]),
            HPARAM_METRIC,
        )
    return BranchResult(
        name=branch.name,
        label=branch.label or branch.name,
        history=module.history,
        val_bpc=float(bpc) if bpc is not None else float("nan"),
        state={k: v.detach().clone() for k, v in module.model.state_dict().items()},
        start_step=int(module.history[0]["step"]) if module.history else branch.max_steps,
        wall_s=time.perf_counter() - start,
        callback_states={
            type(cb).__name__: cb.state_dict() for cb in branch.callbacks if cb.state_dict()
        },
        started_at=started_at,
        pid=os.getpid(),
    )


@contextmanager
def _no_many_workers_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        yield


def branch_hparams(branch: Branch) -> dict[str, float | int | str | bool]:
    """What distinguishes a branch, as TensorBoard hparams (plain scalars and strings)."""
    callbacks = ", ".join(type(cb).__name__ for cb in branch.callbacks)
    return {
        "row": branch.label or branch.name,
        "resumed_from_step": _ckpt_step(branch.ckpt_path),
        "data_seed": branch.data.seed,
        "skip": str(list(branch.data.skip)) if branch.data.skip else "none",
        "peak_lr": branch.optim.peak_lr,
        "lr_scale": branch.optim.lr_scale,
        "gradient_clip_val": float(branch.trainer_kwargs.get("gradient_clip_val") or 0.0),
        "callbacks": callbacks or "none",
        "model_seed": branch.model_seed,
        "qk_norm": branch.gpt.qk_norm,
    }


_REPORTS: Any = None
"""In a worker process: the queue its branches report to (given at its start: a
``multiprocessing`` queue travels to a process when it starts, not with each task)."""
_STOP: Any = None
"""In a worker process: the event that stops its branch early (given at its start too)."""


def _start_worker(reports: Any, stop: Any) -> None:
    # First: Ctrl-C in a terminal reaches every process of its group, and an idle worker
    # would die of a KeyboardInterrupt (a traceback, a broken pool). The main process
    # decides: it sets ``stop``. A branch training here still catches SIGINT: its
    # PreemptionCheckpoint installs its own handler while it trains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _REPORTS, _STOP
    _REPORTS, _STOP = reports, stop
    # Only progress is lost if the reader is gone: a worker need not wait for it at exit.
    reports.cancel_join_thread()
    torch.set_num_threads(1)
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: Any) -> None:
    """Ends this worker when the process that started it is gone (SIGKILL, a crash): no
    one would read its result, and an orphan would go on training, then block forever on
    a pipe nobody reads. Its checkpoints are atomic: none is left half-written."""
    parent.join()
    os._exit(128 + signal.SIGTERM)


def _worker(branch: Branch, log_root: Path) -> BranchResult:
    return run_branch(branch, log_root, _REPORTS, stop=_STOP)


def _ready() -> None:
    """A worker's first task: it exists, with torch and Lightning imported."""


def _context() -> Any:
    """Processes forked from a server that has imported torch and Lightning once (about
    4 s a process otherwise), where the platform has one; fresh interpreters elsewhere."""
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["lit_spikes.demo.branches"])
        return context
    return mp.get_context("spawn")


def _died(future: Future[BranchResult]) -> bool:
    """Whether ``future`` failed because a process of the pool died."""
    done = future.done() and not future.cancelled()
    return done and isinstance(future.exception(), BrokenProcessPool)


class _Here:
    """Where a branch trained in this process reports: checkpoints and spikes go to
    ``on_report`` at once; with its progress, the runner shows the workers' and hands
    waiting branches to free workers (this process has no other thread to do it)."""

    def __init__(
        self, runner: BranchRunner, on_report: Callable[[str, str, Any], None] | None
    ) -> None:
        self.runner, self.on_report = runner, on_report

    def put(self, item: tuple[str, str, Any]) -> None:
        kind, name, payload = item
        if kind == "progress":
            self.runner.poll()
            self.runner._show(name, payload)
            self.runner._read_reports()
            self.runner._dispatch()
        elif self.on_report is not None:
            self.on_report(kind, name, payload)


class BranchRunner:
    """Runs branches in ``workers`` worker processes (one CPU thread each) under one
    overall progress display, and passes on what a branch trained in this process
    reports while it runs, so that a caller can submit new branches as soon as a
    checkpoint or a spike they need exists.

    This process works too: ``run_here`` trains a branch here at once (the one every
    other branch waits for: no process to start), and while every worker is busy,
    ``events`` trains the next waiting branch here. So no core idles while one waits.

    Example:
        >>> with BranchRunner(Path("runs"), workers=1) as runner:
        ...     def on_report(kind, name, payload):
        ...         if kind == "checkpoint" and payload == 100:
        ...             runner.submit(branch_from_step_100)
        ...     runner.run_here(reference, on_report)
        ...     for kind, name, result in runner.events():
        ...         pass
        >>> runner.results["demo1/reference"]
    """

    def __init__(
        self, log_root: Path, workers: int = 2, poll: Callable[[], None] | None = None
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.log_root, self.workers = log_root, workers
        self.poll = poll or (lambda: None)
        """Called between the steps of a branch trained here and between waits for the
        workers; it may raise to stop everything (the main job's dropped signal)."""
        self.results: dict[str, BranchResult] = {}
        self._stack = ExitStack()
        self._waiting: deque[Branch] = deque()
        """Submitted, not yet handed to the pool: this process may still take them."""
        self._futures: dict[Future[BranchResult], Branch] = {}
        """Handed to the pool, their results not yet collected, in that order."""
        self._tasks: dict[str, tuple[TaskID, int]] = {}
        self._refused = False
        """A submit found the pool broken: ``_raise_if_broken`` says so."""

    def __enter__(self) -> BranchRunner:
        context = _context()
        self._queue = context.Queue()
        self._stop = context.Event()
        columns = (
            TextColumn("{task.description:<30}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        # Twice a second, not Rich's default 10: redrawing every branch's bar costs 4% of
        # a core in a terminal at 10 Hz, taken from the training beside it.
        self._progress = self._stack.enter_context(Progress(*columns, refresh_per_second=2))
        self._pool = ProcessPoolExecutor(
            self.workers,
            mp_context=context,
            initializer=_start_worker,
            initargs=(self._queue, self._stop),
        )
        # Workers start on demand, the first after the fork server's imports (seconds):
        # a thread starts them now, while a branch trains here, so that they are ready.
        self._starter = threading.Thread(target=self._start_workers, daemon=True)
        self._starter.start()
        return self

    def _start_workers(self) -> None:
        try:
            for _ in range(self.workers):
                self._pool.submit(_ready)
        except (BrokenProcessPool, RuntimeError):
            pass  # a broken or closed pool: the branches' own submits say so

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._starter.join()  # before the pool shuts down
        if error is not None:
            # The shutdown would wait for every running branch to train to its end: each
            # stops at its next step instead, and queued ones are dropped.
            self._stop.set()
            # Queued ones are cancelled, not shut down with wait=False: that drops the
            # pool's manager thread unjoined, and now and then a worker was left behind,
            # which the interpreter's exit then waited for forever.
            for future in self._futures:
                future.cancel()
        # A worker cannot exit while its reports fill the queue's pipe (its feeder thread
        # waits to flush them): read them until the running branches are done.
        running = [future for future in self._futures if not future.done()]
        while running:
            _, left = wait(running, timeout=0.5)
            self._read_reports()
            running = list(left)
        self._pool.shutdown(wait=True)
        self._stack.__exit__(kind, error, trace)

    def submit(self, branch: Branch) -> None:
        """Queue ``branch``: a worker takes it when one is free (or this process, from
        ``events``, when none is)."""
        self._add_task(branch)
        self._waiting.append(branch)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand waiting branches to free workers, one each: the pool would queue more
        for its busy workers, where this process could no longer take them."""
        if self._starter.is_alive() or self._refused:
            return  # the first start holds the pool's lock for seconds: none waits here
        busy = sum(not future.done() for future in self._futures)
        while self._waiting and busy < self.workers:
            try:
                future = self._pool.submit(_worker, self._waiting[0], self.log_root)
            except BrokenProcessPool:
                # Not raised here: this may run in a callback of a branch training here,
                # which it would abort nameless. Said once that run is done, with names.
                self._refused = True
                return
            self._futures[future] = self._waiting.popleft()
            busy += 1

    def _add_task(self, branch: Branch) -> None:
        if branch.name not in self._tasks:
            first = _ckpt_step(branch.ckpt_path)
            task = self._progress.add_task(branch.name, total=branch.max_steps - first)
            self._tasks[branch.name] = (task, first)

    def _show(self, name: str, step: int) -> None:
        task, first = self._tasks[name]
        self._progress.update(task, completed=step - first)

    def _finish(self, name: str) -> None:
        task, _ = self._tasks[name]
        self._progress.update(task, completed=self._progress.tasks[task].total)

    def _read_reports(self) -> None:
        """Shows the progress the workers reported; their other reports are not needed:
        their branches' results come back whole."""
        while True:
            try:
                kind, name, payload = self._queue.get_nowait()
            except Empty:
                return
            if kind == "progress":
                self._show(name, payload)

    def _raise_if_broken(self) -> None:
        """Raises WorkerDied once a worker died, naming the branches left without a
        result (every unfinished future of the pool then fails)."""
        if self._refused or any(_died(future) for future in self._futures):
            lost = [b.name for f, b in self._futures.items() if not f.done() or _died(f)]
            raise WorkerDied(lost)

    def run_here(
        self, branch: Branch, on_report: Callable[[str, str, Any], None] | None = None
    ) -> BranchResult:
        """Train ``branch`` in this process (one thread, as a worker) while the workers
        run what is submitted, and call ``on_report(kind, name, payload)`` for each
        checkpoint and spike it reports, as it happens (``on_report`` may ``submit``)."""
        self._add_task(branch)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the same numerics as in a worker
        try:
            result = run_branch(branch, self.log_root, _Here(self, on_report))
        finally:
            torch.set_num_threads(threads)
        self._raise_if_broken()
        self.results[branch.name] = result
        self._finish(branch.name)
        return result

    def events(self) -> Iterator[tuple[str, str, BranchResult]]:
        """Yields ``("done", name, result)`` as each submitted branch ends, until all have
        (branches submitted meanwhile included); results also land in ``results``. A
        branch's error is raised here; a dead worker's as ``WorkerDied``. While every
        worker is busy, this process trains the next waiting branch itself."""
        while self._waiting or self._futures:
            self.poll()
            self._raise_if_broken()  # before this process trains a branch of its own
            self._dispatch()
            if self._waiting:
                # Every worker busy (or starting): this core's work keeps the main job
                # within its target, 0.6x the seed's serial way.
                branch = self._waiting.popleft()
                yield "done", branch.name, self.run_here(branch)
                continue
            # wait, not as_completed: the workers' progress is read between waits, and a
            # timeout of as_completed would end its iteration.
            done, _ = wait(self._futures, timeout=0.5, return_when=FIRST_COMPLETED)
            self._read_reports()
            for future in [f for f in self._futures if f in done]:
                if _died(future):
                    self._raise_if_broken()
                name = self._futures.pop(future).name
                self.results[name] = future.result()  # re-raises a branch's error here
                self._finish(name)
                yield "done", name, self.results[name]


def run_branches(
    branches: Sequence[Branch], log_root: Path, workers: int = 2
) -> dict[str, BranchResult]:
    """Run independent branches, ``workers`` at a time: in ``workers - 1`` worker
    processes and this one (with one worker: here, one after the other)."""
    if workers == 1:
        return {b.name: run_branch(b, log_root) for b in branches}
    with BranchRunner(log_root, workers - 1) as runner:  # this process is the other
        for branch in branches:
            runner.submit(branch)
        for _ in runner.events():
            pass
    return {b.name: runner.results[b.name] for b in branches}


def _ckpt_step(path: Path | None) -> int:
    """The global step a branch starts at: that of its checkpoint, or 0."""
    return 0 if path is None else checkpoint_step(path)
