"""The main job (``make demo``): demos 1, 2 and 3 on the built-in world.

One reference run trains from scratch, writing ``step=<k>.ckpt`` files and watching for
spikes. Every other row of demos 1 and 2 is a branch resumed from one of those real
checkpoint files, run in parallel worker processes. Tables and observations are printed
from the numbers of this run; all runs go to ``<log_root>/demo1`` and ``<log_root>/demo2``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from errno import EEXIST, ENOTEMPTY
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console

from lit_spikes.callbacks.run_lock import RunDirectoryBusy, RunDirectoryLock
from lit_spikes.demo.branches import (
    BranchInterrupted,
    BranchResult,
    BranchRunner,
    WorkerDied,
    run_branch,
)
from lit_spikes.demo.demos import (
    DEMO_BRANCHES,
    REFERENCE,
    Demo1Report,
    Demo2Report,
    DemoSetup,
    LedgerRow,
    NoSpikeAfterWarmup,
    PalmCost,
    SpikePlan,
    default_workers,
    demo1_branches,
    demo1_columns,
    demo1_report,
    demo2_branches,
    demo2_columns,
    demo2_ledger,
    demo2_report,
    markdown_table,
    plan_remedies,
    print_demo1,
    print_demo2,
    print_demo3,
)
from lit_spikes.demo.tensorboard import LAYOUT
from lit_spikes.shared.tb import write_summary
from lit_spikes.shared.training import unwritable_directory
from lit_spikes.tools import command_parser, parse_config


@dataclass
class MainJobResult:
    reference: BranchResult
    demo1: Demo1Report | None
    demo2: Demo2Report | None
    ledger: list[LedgerRow] | None
    wall_s: float
    """The whole job: training, tables, figures."""
    train_s: float
    """Its training: from the start to the last branch's end."""
    results: dict[str, BranchResult]
    """Every run by name, the reference included."""


REFERENCE_NOTE = (
    f"The *do nothing (reference)* row is the run `{REFERENCE}`, logged once: "
    "`--logdir` on the log root overlays it with these rows."
)
"""Below demo 2's table in TensorBoard: where its first row's curves are."""


def tensorboard_command(log_root: Path) -> str:
    """How to open TensorBoard on ``log_root`` from here: ``make tensorboard`` for the
    Makefile's ``runs``, and the ``tensorboard`` beside this Python (a venv's, which is
    not on the PATH unless activated)."""
    beside = Path(sys.executable).parent / "tensorboard"
    program = os.path.relpath(beside) if beside.exists() else "tensorboard"
    command = f"{program} --logdir {log_root}"
    return f"make tensorboard (or {command})" if log_root == Path("runs") else command


NOT_EMPTY = (ENOTEMPTY, EEXIST)
"""What rmdir of a directory that still holds files says (POSIX allows either)."""


class PreviousResultsStuck(PermissionError):
    """Files of the previous main job that could not be removed."""


def clear_previous(setup: DemoSetup, demos: tuple[int, ...] = (1, 2, 3)) -> None:
    """A new main job replaces the previous one's runs of the demos it runs: stale
    checkpoints and event files would otherwise mix into this run's TensorBoard curves and
    rollback choices. The reference (in ``demo1``) is trained again by every demo; demo 2's
    runs and ledger (which demo 3 reads) go only when demo 2 or 3 runs again."""
    cleared = ["demo1"] + (["demo2"] if 2 in demos or 3 in demos else [])
    left: list[str] = []

    def keep(function: Any, path: str, error: BaseException) -> None:
        # Gone already: nothing to clear; a directory not empty: one of its files said so.
        if isinstance(error, FileNotFoundError) or getattr(error, "errno", None) in NOT_EMPTY:
            return
        left.append(path)

    # onexc from Python 3.12 on (onerror is deprecated there), onerror before it.
    handler: dict[str, Any] = (
        {"onexc": keep}
        if sys.version_info >= (3, 12)
        else {"onerror": lambda function, path, info: keep(function, path, info[1])}
    )
    for demo in cleared:
        shutil.rmtree(setup.log_root / demo, **handler)
    if left:  # they would mix into this run's curves and rollback choices
        raise PreviousResultsStuck(
            f"could not remove {len(left)} file(s) of the previous main job, e.g. {left[0]} "
            "(written by another user?): remove them, or give another --log_root"
        )


def wide_console() -> Console:
    """A console that does not fold the tables at 80 columns when output is piped."""
    console = Console()
    return console if console.is_terminal else Console(width=132)


def write_figures(
    setup: DemoSetup,
    plan: SpikePlan | None,
    reference: BranchResult,
    results: dict[str, BranchResult],
    demos: tuple[int, ...],
) -> list[Path]:
    """Loss and max-logit comparison PNGs of demos 1 and 2, in each demo's log directory
    and in ``setup.figures_dir``."""
    from lit_spikes.demo.plots import plot_comparison

    figures: list[tuple[str, dict[str, list[dict[str, float]]], tuple[int, int] | None, str]] = []
    if 1 in demos:
        rows = {reference.label: reference.history}
        rows |= {results[b.name].label: results[b.name].history for b in demo1_branches(setup)}
        title = f"Demo 1: resumed from the step-{setup.ckpt_step} checkpoint"
        figures.append(("demo1", rows, None, title))
    if plan is not None and 2 in demos:
        rows = {"do nothing (reference)": reference.history}
        rows |= {
            results[b.name].label: results[b.name].history for b in demo2_branches(setup, plan)
        }
        title = f"Demo 2: remedies from step {plan.ckpt_step} (spike at step {plan.onset})"
        figures.append(("demo2", rows, (plan.onset, plan.onset + 10), title))
    written = []
    for demo, rows, window, title in figures:
        ckpt = setup.ckpt_step if demo == "demo1" else plan.ckpt_step if plan else None
        targets = [setup.log_root / demo / "comparison.png"]
        if setup.figures_dir is not None:
            targets.append(setup.figures_dir / f"{demo}.png")
        for target in targets:
            written.append(
                plot_comparison(rows, target, title, ckpt_step=ckpt, spike_window=window)
            )
    return written


def ledger_path(log_root: Path) -> Path:
    return log_root / "demo2" / "ledger.json"


def write_ledger(setup: DemoSetup, ledger: list[LedgerRow]) -> None:
    """Demo 2's cost ledger, for ``scripts/demo_palm_cost.py`` to print beside PaLM's."""
    path = ledger_path(setup.log_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(row) for row in ledger], indent=2))


def read_ledger(log_root: Path) -> list[LedgerRow] | None:
    path = ledger_path(log_root)
    if not path.is_file():
        return None
    return [LedgerRow(**row) for row in json.loads(path.read_text())]


class MainJobInterrupted(BaseException):
    """Ctrl-C or SIGTERM stopped the main job outside a run that checkpoints (a branch
    trained in this process, a wait for the workers). A ``BaseException``, as
    ``KeyboardInterrupt``: no ``except Exception`` on its way may swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name} stopped it"


class _JobSignal:
    """The signal that stopped the job, once one fired. Its handler raises at once, but
    a raise that lands in a weakref callback or a ``__del__`` is printed and dropped
    (CI saw a Ctrl-C lost so, the job going on to a wrong error): ``raise_if_fired``
    raises it again at the next safe point."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def raise_if_fired(self) -> None:
        if self.signum is not None:
            raise MainJobInterrupted(self.signum)


@contextmanager
def _signals_stop_the_job(signums: tuple[int, ...]) -> Iterator[_JobSignal]:
    """While the job runs, the first of ``signums`` raises ``MainJobInterrupted`` in the
    main thread; Lightning's SIGTERM handler calls this one too, and a run's
    ``PreemptionCheckpoint`` hands it a second signal. Without it, a SIGTERM during a
    branch trained here ended the job with status 0 (Lightning's ``SIGTERMException`` is
    a ``SystemExit(None)``), a Ctrl-C there with 1, and a SIGTERM while this process
    waited for its workers killed it at once and left them training, orphaned. Whatever
    else ends the job once a signal fired, it ends as ``MainJobInterrupted``. A second
    signal (Lightning's teardown may have put this handler back) does what it did before
    the job: a second Ctrl-C interrupts the cleanup, a second SIGTERM ends the process."""
    fired = _JobSignal()
    if threading.current_thread() is not threading.main_thread():
        yield fired  # only the main thread may set handlers (a job run from another thread)
        return
    previous = {signum: signal.getsignal(signum) for signum in signums}

    def stop(signum: int, frame: Any) -> None:
        if fired.signum is None:
            fired.signum = signum
            raise MainJobInterrupted(signum)
        before = previous[signum]
        if callable(before):
            before(signum, frame)
            return
        signal.signal(signum, before if before is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # its default action (or none, if it was ignored)

    for signum in signums:
        signal.signal(signum, stop)
    try:
        yield fired
    except MainJobInterrupted:
        raise
    except BaseException as error:
        if fired.signum is None:
            raise
        raise MainJobInterrupted(fired.signum) from error  # e.g. Lightning's SIGTERMException
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    fired.raise_if_fired()  # its raise was dropped and nothing else stopped the job


ONE_RUN_NOTE = (
    "These tables are one run: its exact figures differ from one CPU to another (the float "
    "kernels differ). How often each finding holds across seeds: `make study` "
    "(docs/study.md)."
)


def run_main_job(
    setup: DemoSetup, demos: tuple[int, ...] = (1, 2, 3), console: Console | None = None
) -> MainJobResult:
    """Run the reference and the branches the chosen demos need, then print their tables.

    The reference trains in this process, from the first second (one thread, as the
    workers). Each branch starts in a worker as soon as what it needs exists: demo 1's
    once ``step=<ckpt_step>.ckpt`` is written, demo 2's once the detector flagged the
    spike (its checkpoint, ``rollback_distance`` steps earlier, is written by then). The
    workers start while the reference trains, so every core works from the start.

    With ``setup.trainer_kwargs`` asking for several processes (DDP), every run spans
    them and the runs go one after the other in this process; Lightning starts this
    script again for the other ranks, which train the same runs and write nothing else.
    """
    unknown = sorted(set(demos) - {1, 2, 3})
    if unknown or not demos:
        raise ValueError(f"demos={demos!r}: choose from 1, 2, 3")
    leader = getattr(rank_zero_only, "rank", 0) == 0  # set from the launcher's env
    root_lock = RunDirectoryLock(setup.log_root)
    if leader:  # before the files of a main job that may be running there are removed
        root_lock.acquire()
    try:
        # Under DDP a Ctrl-C stays Lightning's: its KeyboardInterrupt path also kills the
        # other ranks, which would otherwise wait in a collective for this one.
        signums = (signal.SIGTERM,) if setup.distributed else (signal.SIGINT, signal.SIGTERM)
        with _signals_stop_the_job(signums) as fired:
            return _run_main_job(setup, demos, console, leader, fired.raise_if_fired)
    finally:
        root_lock.release()


def _run_main_job(
    setup: DemoSetup,
    demos: tuple[int, ...],
    console: Console | None,
    leader: bool,
    poll: Callable[[], None],
) -> MainJobResult:
    console = console or wide_console()
    if not leader:
        console = Console(quiet=True)
    start = time.perf_counter()
    if leader:
        clear_previous(setup, demos)
    need_plan = 2 in demos or 3 in demos
    how = (
        f"one after the other across {setup.trainer_kwargs.get('devices')} processes"
        if setup.distributed
        else f"this process and {setup.workers} worker{'s' if setup.workers > 1 else ''}"
    )
    console.rule(
        f"Reference run ({setup.steps} steps, checkpoint every {setup.checkpoint_every}) "
        f"and its branches, {how}"
    )
    if setup.distributed:
        results, plan, no_spike = _run_in_sequence(setup, demos, need_plan)
    else:
        results, plan, no_spike = _run_in_parallel(setup, demos, need_plan, poll)
    train = time.perf_counter() - start
    reference = results[REFERENCE]
    demo1 = demo2 = ledger = None
    if 1 in demos:
        demo1 = demo1_report(setup, reference, results)
    if plan is not None:
        demo2 = demo2_report(setup, plan, reference, results)
        ledger = demo2_ledger(setup, plan, results)
    if leader:
        if demo1 is not None:
            print_demo1(setup, demo1, console)
            table = markdown_table(*demo1_columns(setup, demo1))
            write_summary(setup.log_root / "demo1", {"demo1/table": table}, LAYOUT)
        if demo2 is not None and ledger is not None:
            write_ledger(setup, ledger)
            table = markdown_table(*demo2_columns(setup, demo2))
            write_summary(
                setup.log_root / "demo2", {"demo2/table": f"{table}\n\n{REFERENCE_NOTE}"}, LAYOUT
            )
            if 2 in demos:
                print_demo2(setup, demo2, console)
        if 3 in demos:
            print_demo3(PalmCost(), ledger, console)
        for figure in write_figures(setup, plan, reference, results, demos):
            console.print(f"Figure: {figure}")
    if leader and demos:
        console.print(f"\n{ONE_RUN_NOTE}")
    wall = time.perf_counter() - start
    console.print(f"\nWall time: {wall:.1f} s. TensorBoard: {tensorboard_command(setup.log_root)}")
    if no_spike is not None:
        raise no_spike  # after demo 1's table and figure: that demo needs no spike
    return MainJobResult(reference, demo1, demo2, ledger, wall, train, results)


def _run_in_parallel(
    setup: DemoSetup, demos: tuple[int, ...], need_plan: bool, poll: Callable[[], None]
) -> tuple[dict[str, BranchResult], SpikePlan | None, NoSpikeAfterWarmup | None]:
    """The reference trains in this process from the first second; ``setup.workers``
    worker processes take each branch as soon as what it needs is on disk. Without a
    spike after warm-up demo 1 is still run (its error is returned, for after it)."""
    plan: SpikePlan | None = None
    spikes: list[dict[str, Any]] = []
    waiting_for_demo1 = 1 in demos
    with BranchRunner(setup.log_root, setup.workers, poll) as runner:

        def on_report(kind: str, name: str, payload: Any) -> None:
            nonlocal plan, waiting_for_demo1
            if kind == "checkpoint" and waiting_for_demo1 and payload == setup.ckpt_step:
                waiting_for_demo1 = False
                for branch in demo1_branches(setup):
                    runner.submit(branch)
            elif kind == "spike":
                spikes.append(payload)
                if need_plan and plan is None and payload["step"] >= setup.optim.warmup_steps:
                    plan = plan_remedies(setup, spikes)
                    for branch in demo2_branches(setup, plan):
                        runner.submit(branch)

        runner.run_here(setup.reference(), on_report)
        no_spike = None
        if need_plan and plan is None:
            try:
                plan_remedies(setup, spikes)  # no spike after warm-up: its clear error
            except NoSpikeAfterWarmup as error:
                no_spike = error
        for _ in runner.events():
            pass
    return runner.results, plan, no_spike


def _run_in_sequence(
    setup: DemoSetup, demos: tuple[int, ...], need_plan: bool
) -> tuple[dict[str, BranchResult], SpikePlan | None, NoSpikeAfterWarmup | None]:
    """Every rank runs the same runs in the same order (the detector's spikes are the
    same on every rank, so is the plan)."""
    reference = run_branch(setup.reference(), setup.log_root)
    results = {REFERENCE: reference}
    branches = demo1_branches(setup) if 1 in demos else []
    plan, no_spike = None, None
    if need_plan:
        spikes = reference.callback_states.get("SpikeDetector", {}).get("spikes", [])
        try:
            plan = plan_remedies(setup, spikes)
            branches += demo2_branches(setup, plan)
        except NoSpikeAfterWarmup as error:
            no_spike = error
    for branch in branches:
        results[branch.name] = run_branch(branch, setup.log_root)
    return results, plan, no_spike


@dataclass(frozen=True)
class MainJobConfig:
    """The main job's options (``make demo``; ``scripts/main_job.py --help``)."""

    log_root: Path = Path("runs")
    """TensorBoard root: each demo writes ``<log_root>/demo<n>/<row>``."""
    workers: int | None = None
    """Branch processes beside this one, which trains too (None: one per other core this
    process may use, CPU quota counted; at most one per branch)."""
    devices: int = 1
    """Processes per run (with ``strategy: ddp`` each run spans them, runs in sequence)."""
    strategy: str = "auto"
    """Lightning's strategy: ``auto`` or ``ddp``."""
    figures_dir: Path | None = None
    """Also write the comparison PNGs here (``make figures``: docs/figures, which the README
    shows); they always go to ``<log_root>/demo<n>/comparison.png`` as well."""

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers={self.workers} must be >= 1")
        if self.devices < 1:
            raise ValueError(f"--devices={self.devices} must be >= 1")
        if self.strategy not in ("auto", "ddp"):
            raise ValueError(f"--strategy={self.strategy!r} must be auto or ddp")
        if self.workers is not None and self.devices > 1:
            raise ValueError(
                f"--workers={self.workers} with --devices={self.devices}: the runs then go one "
                "after the other across the DDP processes, with no workers; leave --workers out"
            )
        for flag, path in (("--log_root", self.log_root), ("--figures_dir", self.figures_dir)):
            problem = None if path is None else unwritable_directory(path)  # now, not at the end
            if problem is not None:
                raise ValueError(f"{flag} {path} {problem}")

    def setup(self) -> DemoSetup:
        """The demos' setup for these options.

        Raises:
            ValueError: ``devices`` that do not divide the demos' batch.
        """
        workers = default_workers() if self.workers is None else self.workers
        if workers > DEMO_BRANCHES:
            print(
                f"main job: --workers={workers}: the demos have {DEMO_BRANCHES} branches, so "
                f"{DEMO_BRANCHES} workers",
                file=sys.stderr,
            )
            workers = DEMO_BRANCHES
        trainer_kwargs: dict[str, Any] = {}
        if self.devices > 1 or self.strategy != "auto":
            trainer_kwargs = {"devices": self.devices, "strategy": self.strategy}
        setup = DemoSetup(
            log_root=Path(self.log_root),
            workers=workers,
            figures_dir=None if self.figures_dir is None else Path(self.figures_dir),
            trainer_kwargs=trainer_kwargs,
        )
        rows = setup.data.batch_size
        if rows % self.devices:
            choices = ", ".join(str(n) for n in range(2, rows + 1) if rows % n == 0)
            raise ValueError(
                f"--devices={self.devices}: the demos' batch of {rows} rows per step is split "
                f"over the processes, so their number must divide it ({choices})"
            )
        return setup


def main(argv: list[str] | None = None, demos: tuple[int, ...] = (1, 2, 3)) -> None:
    """``make demo``; exits 75 when another main job holds the directory, 1 on an error
    that says what to do, 128 + the signal number when a signal stopped it."""
    parser = command_parser("main job", __doc__.splitlines()[0], MainJobConfig)
    config, _ = parse_config(parser, MainJobConfig, sys.argv[1:] if argv is None else argv)
    try:
        setup = config.setup()
    except ValueError as error:
        parser.error(str(error))
    try:
        run_main_job(setup, demos)
    except RunDirectoryBusy as error:  # another main job there: not a crash, retry later
        print(f"main job: error: {error}", file=sys.stderr)
        raise SystemExit(os.EX_TEMPFAIL) from None
    except (PreviousResultsStuck, NoSpikeAfterWarmup, WorkerDied) as error:
        # Not this code's fault, and each says what to do: an error line, no traceback
        # (files it could not clear; no spike for demo 2, after demo 1's table; a worker
        # killed from outside, with the branches it took).
        print(f"main job: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except (BranchInterrupted, MainJobInterrupted) as stop:  # no tables from cut-short runs
        print(f"main job: {stop}; run it again to start over", file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None


if __name__ == "__main__":
    main()
