"""Training runs ("branches") that scripts launch, alone or in parallel worker processes.

A branch is a picklable description of one Trainer run: what to train, from which real
``.ckpt`` file, with which callbacks. ``run_branches`` runs independent branches in
worker processes (one CPU thread each, so both cores are busy and every branch computes
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
from concurrent.futures import Future, ProcessPoolExecutor
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

from lit_spikes.callbacks._common import trainer_callbacks
from lit_spikes.callbacks.preemption import PreemptionCheckpoint
from lit_spikes.checkpoints import checkpoint_step
from lit_spikes.data import DataConfig, StepDataModule
from lit_spikes.model import GPTConfig
from lit_spikes.module import DEFAULT_MODEL_SEED, OptimConfig, TinyGPTModule
from lit_spikes.tb import write_hparams
from lit_spikes.training import RunSpec, quiet_branches


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
    ``("spike", name, record)`` for each spike a detector among the callbacks flags."""

    def __init__(self, name: str, queue: Any, checkpoint_every: int | None, every: int = 5):
        self.name, self.queue, self.every = name, queue, every
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
    branch: Branch, log_root: Path, progress_queue: Any = None, progress_bar: bool = True
) -> BranchResult:
    """Train one branch to its end and collect its results."""
    started_at, start = time.time(), time.perf_counter()
    module = TinyGPTModule(gpt=branch.gpt, optim=branch.optim, model_seed=branch.model_seed)
    datamodule = StepDataModule(branch.data)
    callbacks = list(branch.callbacks)
    if progress_queue is not None:
        callbacks.append(_Reporter(branch.name, progress_queue, branch.checkpoint_every))
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


def _start_worker(reports: Any) -> None:
    # First: Ctrl-C in a terminal reaches every process of its group, and an idle worker
    # would die of a KeyboardInterrupt (a traceback, a broken pool). The main process
    # decides: it stops the workers (SIGTERM). A branch training here still catches
    # SIGINT: its PreemptionCheckpoint installs its own handler while it trains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _REPORTS
    _REPORTS = reports
    # Every report a branch's result waits for is read before that result (its "end"
    # marker): a worker need not wait at its exit for a reader that may be gone.
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
    try:
        return run_branch(branch, log_root, _REPORTS)
    finally:
        # The queue's feeder thread may deliver the branch's last reports after its
        # result (which comes back on the pool's own pipe): this marker comes after them.
        _REPORTS.put(("end", branch.name, None))


def _ready() -> None:
    """A worker's first task: it exists, with torch and Lightning imported."""


def _context() -> Any:
    """Processes forked from a server that has imported torch and Lightning once (about
    4 s a process otherwise), where the platform has one; fresh interpreters elsewhere."""
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["lit_spikes.branches"])
        return context
    return mp.get_context("spawn")


class _Relay:
    """The queue a branch trained in this process reports to: its progress goes to the
    display, its checkpoints and spikes to ``on_report`` at once (or, without one, to
    ``events``)."""

    def __init__(
        self, runner: BranchRunner, on_report: Callable[[str, str, Any], None] | None
    ) -> None:
        self.runner, self.on_report = runner, on_report

    def put(self, item: tuple[str, str, Any]) -> None:
        kind, name, payload = item
        if kind == "progress":
            self.runner._show_progress(name, payload)
        elif self.on_report is not None:
            self.on_report(kind, name, payload)
        else:
            self.runner._held.append(item)


class BranchRunner:
    """Runs branches in ``workers`` worker processes (one CPU thread each) under one
    overall progress display, and passes on what the branches report while they run, so
    a caller can start new branches as soon as a checkpoint or a spike they need exists.

    This process works too: ``run_here`` trains a branch here at once (the one every
    other branch waits for: no process to start), and while ``events`` waits, it takes
    the next submitted branch whenever every worker is busy. So no core idles while a
    branch waits, and the last branches end closer together.

    Example:
        >>> with BranchRunner(Path("runs"), workers=2) as runner:
        ...     def on_report(kind, name, payload):
        ...         if kind == "checkpoint" and payload == 100:
        ...             runner.submit(branch_from_step_100)
        ...     runner.run_here(reference, on_report)
        ...     for kind, name, payload in runner.events():
        ...         pass
        >>> runner.results["demo1/reference"]
    """

    def __init__(self, log_root: Path, workers: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.log_root, self.workers = log_root, workers
        self.results: dict[str, BranchResult] = {}
        self._stack = ExitStack()
        self._futures: dict[Future[BranchResult], str] = {}
        self._tasks: dict[str, tuple[TaskID, int]] = {}
        self._held: deque[tuple[str, str, Any]] = deque()
        self._ended: set[str] = set()
        self._pending: deque[Branch] = deque()
        self._lock = threading.Lock()
        self._drain_error: BaseException | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._broken = False
        """A worker died: nothing more goes to the pool; ``_raise_if_broken`` says so."""

    def __enter__(self) -> BranchRunner:
        context = _context()
        self._queue = context.Queue()
        columns = (
            TextColumn("{task.description:<30}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        # Twice a second, not Rich's default 10: redrawing every branch's bar costs 4% of
        # a core in a terminal at 10 Hz, taken from the training beside it.
        self._progress = self._stack.enter_context(Progress(*columns, refresh_per_second=2))
        self._pool = self._stack.enter_context(
            ProcessPoolExecutor(
                self.workers,
                mp_context=context,
                initializer=_start_worker,
                initargs=(self._queue,),
            )
        )
        # Workers start on demand: start them all now, so that they are ready when the
        # first branches are submitted (each submit finding none idle starts one). The
        # first start waits seconds for the server's imports: a thread waits, so that
        # a branch can train here meanwhile; nothing goes to the pool until it is done.
        self._starter = threading.Thread(target=self._start_workers, daemon=True)
        self._starter.start()
        return self

    def _start_workers(self) -> None:
        try:
            for _ in range(self.workers):
                self._pool.submit(_ready)
        except BaseException as error:  # e.g. the server failed to start: dispatch raises it
            self._start_error = error
        finally:
            self._started.set()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._starter.join()  # before the pool shuts down
        if error is not None:
            # The pool's shutdown would wait for every running branch to train to its end:
            # queued ones are dropped, running ones get SIGTERM (each writes its preemption
            # checkpoint and stops at the next step; an idle worker just ends).
            for process in list((getattr(self._pool, "_processes", None) or {}).values()):
                process.terminate()
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._stack.__exit__(kind, error, trace)

    def submit(self, branch: Branch) -> None:
        """Queue ``branch``: a worker takes it when one is free (or this process, from
        ``events``, when none is)."""
        if self._start_error is not None:
            raise self._start_error
        first = _ckpt_step(branch.ckpt_path)
        task = self._progress.add_task(branch.name, total=branch.max_steps - first)
        self._tasks[branch.name] = (task, first)
        with self._lock:
            self._pending.append(branch)
            self._dispatch()

    def _dispatch(self) -> None:
        """Hand queued branches to free workers (the caller holds the lock). Branches go
        to the pool one per free worker only, so the queue stays here to be shared."""
        if not self._started.is_set():
            return  # the workers are still starting: the branches wait here
        if self._start_error is not None:
            raise self._start_error
        busy = sum(not future.done() for future in self._futures)
        while self._pending and busy < self.workers and not self._broken:
            branch = self._pending[0]
            try:
                future = self._pool.submit(_worker, branch, self.log_root)
            except BrokenProcessPool:
                # Not here: this may run in a branch's callback in this process (a
                # reference training on), which the error would abort nameless. Said once
                # that run is done, naming the branches the dead worker took with it.
                self._broken = True
                return
            self._pending.popleft()
            self._futures[future] = branch.name
            busy += 1

    def _raise_if_broken(self) -> None:
        """Raises WorkerDied if a worker died, naming the branches it left without a
        result (each future of the pool fails once one of its processes dies)."""
        with self._lock:
            lost = [
                name
                for future, name in self._futures.items()
                if future.done() and isinstance(future.exception(), BrokenProcessPool)
            ]
        if lost or self._broken:
            raise WorkerDied(lost)

    def _show_progress(self, name: str, step: int) -> None:
        task, first = self._tasks[name]
        self._progress.update(task, completed=step - first)

    def run_here(
        self, branch: Branch, on_report: Callable[[str, str, Any], None] | None = None
    ) -> BranchResult:
        """Train ``branch`` in this process (one thread, as a worker) while the workers
        run what is submitted, and call ``on_report(kind, name, payload)`` for each
        checkpoint and spike it reports, as it happens (``on_report`` may ``submit``;
        without it those reports come out of ``events``)."""
        if branch.name not in self._tasks:
            first = _ckpt_step(branch.ckpt_path)
            task = self._progress.add_task(branch.name, total=branch.max_steps - first)
            self._tasks[branch.name] = (task, first)
        stop = threading.Event()
        drain = threading.Thread(target=self._drain, args=(stop,), daemon=True)
        drain.start()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the same numerics as in a worker
        try:
            result = run_branch(branch, self.log_root, _Relay(self, on_report))
        finally:
            torch.set_num_threads(threads)
            stop.set()
            drain.join()
        if self._drain_error is not None:
            raise self._drain_error
        self._raise_if_broken()
        self.results[branch.name] = result
        task, _ = self._tasks[branch.name]
        self._progress.update(task, completed=self._progress.tasks[task].total)
        return result

    def _drain(self, stop: threading.Event) -> None:
        """While ``run_here`` trains: show the workers' progress, keep their other
        reports for ``events``, and hand queued branches to workers as they free up."""
        try:
            while not stop.is_set():
                with self._lock:
                    self._dispatch()
                try:
                    kind, name, payload = self._queue.get(timeout=0.2)
                except Empty:
                    continue
                self._take_report(kind, name, payload)
        except BaseException as error:  # e.g. a broken pool: run_here raises it
            self._drain_error = error

    def _take_report(self, kind: str, name: str, payload: Any) -> None:
        """A worker's report: progress is shown, an end marker noted, the rest held."""
        if kind == "progress":
            self._show_progress(name, payload)
        elif kind == "end":
            self._ended.add(name)
        else:
            self._held.append((kind, name, payload))

    def events(self) -> Iterator[tuple[str, str, Any]]:
        """Yields ``(kind, branch, payload)`` reports (checkpoints, spikes; progress goes
        to the display) until every submitted branch is done
        (including branches submitted while iterating); results land in ``results``.
        A branch's reports all come before its ``("done", name, result)``. While every
        worker is busy, this process trains the next queued branch itself. (A branch
        trained by a direct ``run_here`` call has no ``done`` event: it returns.)"""
        while True:
            while self._held:
                yield self._held.popleft()
            with self._lock:
                self._dispatch()
                mine = self._pending.popleft() if self._pending and not self._broken else None
                waiting = bool(self._futures)
            self._raise_if_broken()  # before this process trains a branch of its own
            if mine is not None:
                result = self.run_here(mine)
                while self._held:
                    yield self._held.popleft()
                yield "done", mine.name, result
                continue
            if not waiting:
                return
            try:
                kind, name, payload = self._queue.get(timeout=0.2)
            except Empty:
                pass
            else:
                self._take_report(kind, name, payload)
            while self._held:
                yield self._held.popleft()
            with self._lock:
                finished = [
                    (future, name)
                    for future, name in self._futures.items()
                    if future.done() and (name in self._ended or future.exception() is not None)
                ]
                for future, _ in finished:
                    del self._futures[future]
            for future, name in finished:
                if isinstance(future.exception(), BrokenProcessPool):
                    self._raise_if_broken()  # a worker died: named, not a bare pool error
                self.results[name] = future.result()  # re-raises a branch's error here
                task, _ = self._tasks[name]
                self._progress.update(task, completed=self._progress.tasks[task].total)
                yield "done", name, self.results[name]


def run_branches(
    branches: Sequence[Branch], log_root: Path, workers: int = 2
) -> dict[str, BranchResult]:
    """Run independent branches, ``workers`` at a time, each in its own process."""
    if workers == 1:
        return {b.name: run_branch(b, log_root) for b in branches}
    with BranchRunner(log_root, workers) as runner:
        for branch in branches:
            runner.submit(branch)
        for _ in runner.events():
            pass
    return {b.name: runner.results[b.name] for b in branches}


def _ckpt_step(path: Path | None) -> int:
    """The global step a branch starts at: that of its checkpoint, or 0."""
    return 0 if path is None else checkpoint_step(path)
