"""A study is a job: its cells run in worker processes (one torch thread each, one per
core), each writes its result into its own run directory, and a rerun of the same
command takes every finished cell from its ``cell.json`` instead of computing it again.
A cell without that file (killed half-way) is cleared and computed afresh.

What the cells are and how one is computed is the study's ``StudyPlan`` (the study of
any module, ``lit_spikes.tools.study``, and the demos' own): this module only runs
them."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from lit_spikes.checkpoints import atomic_write

STUDY_FILE = "study.json"
"""In the log root: the fingerprint of the config its cells were computed with."""


class AnotherStudy(ValueError):
    """The log root holds cells of a study with other settings."""


class StudyInterrupted(BaseException):
    """SIGINT or SIGTERM stopped the study; the cells done are kept for the rerun."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass
class StudyRun:
    """What a study's run did."""

    results: dict[str, dict[str, Any]]
    """Every cell's result by name."""
    computed: list[str] = field(default_factory=list)
    """The cells this run computed (the others were done before it)."""
    wall_s: float = 0.0
    workers: int = 1


RESULT = "cell.json"
"""A done cell's result, in its run directory."""


@dataclass(frozen=True)
class Cell:
    """One unit of a study's work."""

    name: str
    """Its run directory under the log root, e.g. ``seed03-data0/scale_lr``."""
    kind: str
    """What it computes (``reference``, a remedy, ``diagnose``, ``sweep``...)."""
    model_seed: int
    data_seed: int
    cost: int
    """Training steps it takes (its share of the work, for the time left)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Where it resumes from, what it skips, the sweep point."""


@dataclass(frozen=True)
class StudyPlan:
    """What a study computes: its cells and how each is computed. The functions are
    module-level ones (a worker process gets the plan by pickling)."""

    config: Any
    """The study's settings: the functions' first argument."""
    log_root: Path
    fingerprint: str
    """What decides each cell's numbers (a log root holds the cells of one)."""
    seeds: list[tuple[int, int]]
    """Every (model seed, data seed); each has one ``reference`` cell."""
    first: Callable[[Any], list[Cell]]
    """The cells that need nothing else (each seed's ``reference`` among them)."""
    follow: Callable[[Any, dict[str, Any]], list[Cell]]
    """A seed's cells after its reference, from the reference's result."""
    compute: Callable[[Any, Cell], dict[str, Any]]
    """Computes a cell into its run directory; returns its result (``run_cell`` writes it)."""
    later_cells: int
    """About how many cells a seed's reference is followed by (progress)."""
    later_cost: int
    """About how many training steps those take (progress)."""
    preload: str
    """The module a worker imports before its first cell (torch and Lightning once)."""


def read_result(log_root: Path, cell: Cell) -> dict[str, Any] | None:
    """A done cell's result, or None."""
    path = log_root / cell.name / RESULT
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return result


def run_cell(plan: StudyPlan, cell: Cell) -> dict[str, Any]:
    """Compute ``cell`` into its run directory and write its ``cell.json``; returns it."""
    from lit_spikes.shared.training import quiet_branches

    start = time.perf_counter()
    with quiet_branches():
        result = plan.compute(plan.config, cell)
    result |= {
        "name": cell.name,
        "kind": cell.kind,
        "model_seed": cell.model_seed,
        "data_seed": cell.data_seed,
        "params": cell.params,
        "fingerprint": plan.fingerprint,
        "wall_s": time.perf_counter() - start,
        "steps_trained": cell.cost,
    }
    text = json.dumps(result, indent=1, allow_nan=True)
    atomic_write(plan.log_root / cell.name / RESULT, lambda handle: handle.write(text.encode()))
    return result


def check_log_root(plan: StudyPlan) -> None:
    """Refuses a log root whose cells were computed with other settings (a usage error:
    nothing is run or written).

    Raises:
        AnotherStudy: its ``study.json`` names another fingerprint.
    """
    path = plan.log_root / STUDY_FILE
    if path.is_file():
        saved = json.loads(path.read_text()).get("fingerprint")
        if saved != plan.fingerprint:
            raise AnotherStudy(
                f"{plan.log_root} holds a study run with other settings (fingerprint "
                f"{saved}, this one {plan.fingerprint}): give another --log_root, or "
                "remove that directory to start over"
            )


def _mark_log_root(plan: StudyPlan) -> None:
    plan.log_root.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"fingerprint": plan.fingerprint})
    atomic_write(plan.log_root / STUDY_FILE, lambda handle: handle.write(text.encode()))


# ------------------------------------------------------------------------------ workers

_PIDS: Any = None


def _start_worker(pids: Any) -> None:
    # Ctrl-C reaches the whole process group: the main process decides, and stops the
    # workers with SIGTERM (a cell then stops at its next step, its file left unfinished).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)  # one core each: every cell computes what it would alone
    pids.put(os.getpid())
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: Any) -> None:
    """Ends this worker when the study's process is gone (SIGKILL): nobody would read
    its result; the rerun computes the cell again."""
    parent.join()
    os._exit(128 + signal.SIGTERM)


def _work(plan: StudyPlan, cell: Cell) -> dict[str, Any]:
    return run_cell(plan, cell)


def _context(preload: str) -> Any:
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload([preload])  # torch, Lightning once
        return context
    return mp.get_context("spawn")


# ------------------------------------------------------------------------------ the job


class _Progress:
    """One line per finished cell: cells done of the total known, time left from the
    work done so far (cells weighted by their training steps)."""

    def __init__(self, plan: StudyPlan, out: TextIO) -> None:
        self.plan, self.out, self.start = plan, out, time.perf_counter()
        self.cost_done = 0

    def remaining_cost(self, waiting: list[Cell], running: list[Cell], open_seeds: int) -> int:
        return sum(c.cost for c in waiting + running) + open_seeds * self.plan.later_cost

    def line(self, done: int, total: int, computed: int, remaining: int) -> None:
        elapsed = time.perf_counter() - self.start
        rate = self.cost_done / elapsed if elapsed > 0 else 0.0
        left = f"~{_clock(remaining / rate)} left" if rate > 0 else "time left unknown"
        print(
            f"study: {done}/{total} cells done ({computed} computed now), "
            f"{_clock(elapsed)} elapsed, {left}",
            file=self.out,
            flush=True,
        )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


@contextmanager
def _signals_stop() -> Iterator[Callable[[], None]]:
    """SIGINT and SIGTERM raise ``StudyInterrupted``; a raise that lands in a weakref
    callback is dropped (as the main job's once was), so the signal is remembered: the
    yielded check raises it between cells, and the study never ends as done after one."""
    fired: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        fired.append(signum)
        raise StudyInterrupted(signum)

    def check() -> None:
        if fired:
            raise StudyInterrupted(fired[0])

    if threading.current_thread() is not threading.main_thread():
        yield check
        return
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield check
    except StudyInterrupted:
        raise
    except BaseException as error:
        if not fired:
            raise
        raise StudyInterrupted(fired[0]) from error
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    check()


def done_cells(plan: StudyPlan) -> StudyRun:
    """The results of the cells done so far, computing nothing (an interim report of a
    study still running, or stopped): a seed's later cells only where its reference is
    done."""
    run = StudyRun({})
    known = plan.first(plan.config)
    while known:
        cell = known.pop(0)
        result = read_result(plan.log_root, cell)
        if result is None or result.get("fingerprint") != plan.fingerprint:
            continue
        run.results[cell.name] = result
        if cell.kind == "reference":
            known += plan.follow(plan.config, result)
    return run


def run_study(plan: StudyPlan, workers: int, out: TextIO | None = None) -> StudyRun:
    """Compute every cell of ``plan`` not done yet, ``workers`` at a time, and return
    all their results (with ``workers`` 1: here, one after the other).

    Raises:
        AnotherStudy: the log root holds another study's cells.
        StudyInterrupted: SIGINT or SIGTERM; rerun the same command to continue.
    """
    check_log_root(plan)
    _mark_log_root(plan)
    start = time.perf_counter()
    run = StudyRun({}, workers=workers)
    waiting: list[Cell] = []
    open_seeds = {(m, d) for m, d in plan.seeds}
    progress = _Progress(plan, sys.stderr if out is None else out)

    def take(cell: Cell, first: bool = False) -> None:
        """A cell done before (its result read), or one to compute (its leftovers gone):
        ``first``, before those waiting."""
        result = read_result(plan.log_root, cell)
        if result is not None and result.get("fingerprint") == plan.fingerprint:
            finished(cell, result)
        else:
            shutil.rmtree(plan.log_root / cell.name, ignore_errors=True)
            waiting.insert(0 if first else len(waiting), cell)

    def finished(cell: Cell, result: dict[str, Any]) -> None:
        run.results[cell.name] = result
        if cell.kind == "reference":
            open_seeds.discard((cell.model_seed, cell.data_seed))
            # A seed's cells before the next seed's: a study stopped early has whole seeds.
            for follower in reversed(plan.follow(plan.config, result)):
                take(follower, first=True)

    for cell in plan.first(plan.config):
        take(cell)
    with _signals_stop() as check:
        if workers == 1:
            while waiting:
                check()
                cell = waiting.pop(0)
                finished(cell, run_cell(plan, cell))
                run.computed.append(cell.name)
                progress.cost_done += cell.cost
                total = len(run.results) + len(waiting)
                total += len(open_seeds) * plan.later_cells
                remaining = progress.remaining_cost(waiting, [], len(open_seeds))
                progress.line(len(run.results), total, len(run.computed), remaining)
        else:
            _run_pool(plan, workers, waiting, run, finished, progress, open_seeds, check)
    run.wall_s = time.perf_counter() - start
    return run


def _run_pool(
    plan: StudyPlan,
    workers: int,
    waiting: list[Cell],
    run: StudyRun,
    finished: Any,
    progress: _Progress,
    open_seeds: set[tuple[int, int]],
    check: Callable[[], None],
) -> None:
    context = _context(plan.preload)
    pids = context.Queue()
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(pids,)
    )
    futures: dict[Future[dict[str, Any]], Cell] = {}
    try:
        while waiting or futures:
            while waiting and len(futures) < workers:
                cell = waiting.pop(0)
                futures[pool.submit(_work, plan, cell)] = cell
            done, _ = wait(futures, timeout=1.0, return_when=FIRST_COMPLETED)
            check()  # a signal whose raise was dropped
            if not done:
                continue
            for future in done:
                cell = futures.pop(future)
                finished(cell, future.result())  # a cell's error is raised here
                run.computed.append(cell.name)
                progress.cost_done += cell.cost
            total = len(run.results) + len(waiting) + len(futures)
            total += len(open_seeds) * plan.later_cells  # a seed's cells after its reference
            remaining = progress.remaining_cost(waiting, list(futures.values()), len(open_seeds))
            progress.line(len(run.results), total, len(run.computed), remaining)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        while not pids.empty():
            with suppress(ProcessLookupError):
                os.kill(pids.get_nowait(), signal.SIGTERM)  # a worker this study started
        raise
    pool.shutdown(wait=True)
