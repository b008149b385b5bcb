"""`make bench`: figures measured side by side in one run, on this machine.

1. Loop overhead: ms/step of the Lightning loop as the demos run it (TensorBoard logging
   every step, spike detector on, a checkpoint every 50 steps, progress bar off) against a
   plain PyTorch loop on the same model, batches and thread count, and of Lightning's loop
   alone (every feature off: what Lightning itself costs); interleaved repeats in
   alternating order, medians, the median of the ratios to each repeat's plain run.
2. Main job against the seed's way: the training of `make demo` (reference + all branches
   of demos 1 and 2, in parallel workers from real checkpoints) against the same steps run
   serially by a plain loop branching from an in-memory snapshot; interleaved pairs, the
   median ratio (``--skip-main-job`` leaves this part out).
3. Checkpoint cost and size against 12 bytes per parameter.
4. Spike detector cost per step, and spike-to-remedy latency.
5. Model speed against d_model and context, FLOP/s against the matmul peak.
6. DDP scaling: ms/step of 1 process x 1 thread against 2 DDP processes x 1 thread (gloo)
   at the same global batch, interleaved, and the scaling efficiency.
7. torch.compile on CPU: eager against compiled ms/step (interleaved), the first step's
   compile time, and whether a resumed compiled run is bit-equal to an uninterrupted one.
8. Where a step's time goes, in the three loops of part 1: the model's forward, backward,
   AdamW's update and the rest (data, the gradient norm, the records, and in Lightning its
   loop, hooks and callbacks), each the median per step of interleaved runs (timers
   around those three calls in every loop alike; not in the default set).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from rich.console import Console
from rich.table import Table

from lit_spikes.callbacks import SpikeDetector
from lit_spikes.demo.data import DataConfig, StepDataModule
from lit_spikes.demo.demos import DEMO_BRANCHES, DemoSetup
from lit_spikes.demo.main_job import run_main_job
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import (
    DEFAULT_MODEL_SEED,
    OptimConfig,
    TinyGPTModule,
    set_flush_denormal,
)
from lit_spikes.demo.plain import evaluate_bpc, train_plain
from lit_spikes.shared.training import RunSpec, ddp_env

DEMO_CHECKPOINT_EVERY = DemoSetup().checkpoint_every


class StepTimer(Callback):
    """Wall time of each training step (from one step's start to the next's)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics
    ``k`` and ``n + 1 - k`` (1-based) with the largest ``k`` whose interval still covers
    the median with at least ``confidence`` (Binomial(n, 1/2) tails). With fewer than 6
    values no such interval exists: their range is returned."""
    ordered, n = sorted(values), len(values)
    best = 1
    for k in range(1, n // 2 + 1):
        tail = sum(math.comb(n, i) for i in range(k)) / 2**n  # P(fewer than k below)
        if 1 - 2 * tail >= confidence:
            best = k
    return ordered[best - 1], ordered[n - best]


def ms_per_step(starts: list[float], warmup: int) -> float:
    return 1000 * (starts[-1] - starts[warmup]) / (len(starts) - 1 - warmup)


@contextmanager
def step_stamps(where: Any) -> Iterator[list[float]]:
    """The time of each step's gradient-norm call in ``where`` (``lit_spikes.demo.plain`` or
    ``lit_spikes.demo.module``): one call per step, after backward, in both loops, so both are
    timed by the same instrument and neither pays for a timing callback."""
    stamps: list[float] = []
    original = where.grad_norm

    def timed(parameters: Any) -> torch.Tensor:
        stamps.append(time.perf_counter())
        return original(parameters)

    where.grad_norm = timed
    try:
        yield stamps
    finally:
        where.grad_norm = original


def time_plain(steps: int, warmup: int, compile_model: bool = False) -> tuple[float, float]:
    """ms/step of the plain loop after ``warmup`` steps, and its first step's seconds."""
    import lit_spikes.demo.plain as plain

    begin = time.perf_counter()
    with step_stamps(plain) as starts:
        train_plain(
            GPTConfig(),
            OptimConfig(),
            DataConfig(),
            steps,
            DEFAULT_MODEL_SEED,
            compile_model=compile_model,
        )
    return ms_per_step(starts, warmup), starts[0] - begin


def time_lightning(
    steps: int, warmup: int, root: Path, checkpoint_every: int | None, features: bool = True
) -> float:
    """ms/step of the Lightning loop as the demos run it, timed as ``time_plain``;
    ``features=False``: Lightning's loop alone (no logger, checkpoints or callbacks)."""
    import lit_spikes.demo.module as module_code

    spec = RunSpec(
        root,
        "bench",
        steps,
        checkpoint_every=checkpoint_every if features else None,
        callbacks=[SpikeDetector()] if features else [],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0} | ({} if features else {"logger": False}),
    )
    module = TinyGPTModule()
    with warnings.catch_warnings(), step_stamps(module_code) as starts:
        warnings.simplefilter("ignore")
        spec.trainer().fit(module, datamodule=StepDataModule())
    return ms_per_step(starts, warmup)


def seed_way_serial(setup: DemoSetup, branch_count: int) -> tuple[float, int]:
    """The seed's way: one reference run keeping an in-memory snapshot, then every branch
    resumed from it, one after the other, in a plain loop. Returns (seconds, steps)."""
    start = time.perf_counter()
    reference = train_plain(
        setup.gpt,
        setup.optim,
        setup.data,
        setup.steps,
        setup.model_seed,
        record=True,
        snapshot_at=setup.ckpt_step,
    )
    assert reference.snapshot is not None
    evaluate_bpc(reference.model, setup.data)  # the seed evaluates every row at its end
    for _ in range(branch_count):
        branch = train_plain(
            setup.gpt,
            setup.optim,
            setup.data,
            setup.steps,
            setup.model_seed,
            record=True,
            resume=reference.snapshot,
        )
        evaluate_bpc(branch.model, setup.data)
    steps = setup.steps + branch_count * (setup.steps - setup.ckpt_step)
    return time.perf_counter() - start, steps


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bench_checkpoints(console: Console, repeats: int = 5) -> None:
    """Part 3: save/load time and size of a real checkpoint against 12 bytes/parameter."""
    from lit_spikes.checkpoints import load_checkpoint

    table = Table(
        title="3. Checkpoint cost and size (AtomicCheckpointIO: 'save' is the whole "
        "synchronous save the loop pays for, fsyncs included)"
    )
    for column in (
        "d_model",
        "parameters",
        "file (KB)",
        "bytes/param",
        "vs 12 B/param",
        "save (ms)",
        "load (ms)",
    ):
        table.add_column(column, justify="right")
    for width in (64, 128, 256):
        with tempfile.TemporaryDirectory() as tmp:
            gpt = GPTConfig(d_model=width)
            spec = RunSpec(
                Path(tmp),
                "ckpt",
                2,
                progress_bar=False,
                trainer_kwargs={"limit_val_batches": 0, "logger": False},
            )
            module = TinyGPTModule(gpt=gpt)
            trainer = spec.trainer()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.fit(module, datamodule=StepDataModule())
            path = Path(tmp) / "step=2.ckpt"
            saves, loads = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                trainer.save_checkpoint(path, weights_only=False)
                saves.append(time.perf_counter() - start)
                start = time.perf_counter()
                load_checkpoint(path)
                loads.append(time.perf_counter() - start)
            params = sum(p.numel() for p in module.parameters())
            size = path.stat().st_size
            table.add_row(
                str(width),
                f"{params:,}",
                f"{size / 1024:.0f}",
                f"{size / params:.2f}",
                f"{size / params / 12:.3f}x",
                f"{1000 * statistics.median(saves):.1f}",
                f"{1000 * statistics.median(loads):.1f}",
            )
    console.print(table)


def bench_detector(console: Console, step_ms: float) -> None:
    """Part 4: the spike detector's cost per step, and the time from a detected spike to
    the first step of a remedy branch (choosing the checkpoint, building the Trainer,
    restoring), beyond the steps recomputed."""
    from lit_spikes.callbacks import LRScaler, RollbackRestore
    from lit_spikes.demo.branches import Branch, run_branch

    detector = SpikeDetector(monitor=("loss", "max_logit", "grad_norm"), z_score=6.0)
    record = {"loss": 2.0, "max_logit": 300.0, "grad_norm": 0.3}
    calls = 20_000
    start = time.perf_counter()
    for step in range(calls):
        detector.check(step, record)
    per_call_ms = 1000 * (time.perf_counter() - start) / calls
    console.print(
        f"4. Spike detector (3 metrics, ratio and z-score): {1000 * per_call_ms:.1f} us/step, "
        f"{100 * per_call_ms / step_ms:.3f}% of a {step_ms:.1f} ms step"
    )

    class FirstStep(Callback):
        def __init__(self) -> None:
            self.at: float | None = None

        def on_train_batch_start(self, *args: Any) -> None:
            if self.at is None:
                self.at = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_branch(Branch("ref", 60, checkpoint_every=20, val_every=None), root, progress_bar=False)
        start = time.perf_counter()
        rollback = RollbackRestore(root / "ref" / "checkpoints", spike_step=55, distance=20)
        first = FirstStep()
        branch = Branch(
            "remedy",
            61,
            ckpt_path=rollback.ckpt_path,
            val_every=None,
            callbacks=[first, LRScaler(0.5, start_step=rollback.ckpt_step)],
        )
        run_branch(branch, root, progress_bar=False)
        assert first.at is not None
        console.print(
            f"   From a detected spike to the first step of the remedy branch "
            f"(in-process): {1000 * (first.at - start):.0f} ms"
        )


def bench_model(console: Console, steps: int = 20) -> None:
    """Part 5: step time against d_model and context length, achieved FLOP/s against this
    machine's measured single-thread matmul peak."""
    size = 512
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    peak = 20 * 2 * size**3 / (time.perf_counter() - start)
    table = Table(title=f"5. Model speed, 1 thread (matmul peak {peak / 1e9:.1f} GFLOP/s)")
    for column in ("d_model", "context", "ms/step", "GFLOP/s", "of peak"):
        table.add_column(column, justify="right")
    for width, context in ((64, 64), (128, 64), (256, 64), (64, 128), (64, 256)):
        gpt = GPTConfig(d_model=width, block_size=context)
        data = DataConfig(block_size=context)
        start = time.perf_counter()
        result = train_plain(gpt, OptimConfig(), data, steps, record=False)
        ms = 1000 * (time.perf_counter() - start) / steps
        params = sum(p.numel() for p in result.model.parameters())
        tokens = data.batch_size * context
        # 6 FLOPs per parameter per token (forward + backward), plus attention's QK^T and
        # AV: 2 matmuls x 2 FLOPs x T x d per token per layer, x3 for the backward pass.
        flops = 6 * params * tokens + 12 * gpt.n_layer * tokens * context * width
        achieved = flops / (ms / 1000)
        table.add_row(
            str(width), str(context), f"{ms:.1f}", f"{achieved / 1e9:.2f}", f"{achieved / peak:.1%}"
        )
    console.print(table)
    bench_subnormals(console)


def bench_subnormals(console: Console, steps: int = 300, pairs: int = 3) -> None:
    """Part 5: the default run with subnormal floats flushed (the default) and kept,
    ``pairs`` interleaved pairs in alternating order, medians and the median pair ratio."""
    times: dict[bool, list[float]] = {True: [], False: []}
    same = True
    for pair in range(pairs):
        results = {}
        for flush in (True, False) if pair % 2 == 0 else (False, True):
            start = time.perf_counter()
            results[flush] = train_plain(
                GPTConfig(), OptimConfig(), DataConfig(), steps, flush_denormal=flush, record=True
            )
            times[flush].append(1000 * (time.perf_counter() - start) / steps)
        kept, flushed = results[False].model.state_dict(), results[True].model.state_dict()
        same = same and all(torch.equal(v, flushed[k]) for k, v in kept.items())
    set_flush_denormal(True)  # train_plain leaves the thread as it ran
    flushed_ms, kept_ms = statistics.median(times[True]), statistics.median(times[False])
    ratio = statistics.median(k / f for f, k in zip(times[True], times[False], strict=True))
    console.print(
        f"Subnormal floats, default model, {steps} steps, {pairs} pairs (medians): flushed "
        f"[bold]{flushed_ms:.1f}[/bold] ms/step, kept {kept_ms:.1f} ms/step "
        f"([bold]{ratio:.2f}x[/bold], median pair ratio); final weights bit-equal in every "
        f"pair: {same}"
    )


def ddp_worker(devices: int, steps: int, warmup: int, root: str) -> None:
    """Body of ``bench.py --ddp-worker``: one timed run on ``devices`` processes, as the
    demos run (TensorBoard every step, spike detector), at the default global batch.
    Lightning starts this same command again for the other ranks; rank 0 reports."""
    torch.set_num_threads(1)
    timer = StepTimer()
    kwargs: dict[str, Any] = {"limit_val_batches": 0}
    if devices > 1:
        kwargs |= {"devices": devices, "strategy": "ddp"}
    spec = RunSpec(
        Path(root),
        f"ddp{devices}",
        steps,
        callbacks=[timer, SpikeDetector()],
        progress_bar=False,
        trainer_kwargs=kwargs,
    )
    trainer = spec.trainer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyGPTModule(), datamodule=StepDataModule())
    if trainer.is_global_zero:
        report = {"ms": ms_per_step(timer.starts, warmup), "world_size": trainer.world_size}
        (Path(root) / f"ddp{devices}.json").write_text(json.dumps(report))


def time_processes(devices: int, steps: int, warmup: int, root: Path) -> float:
    """ms/step of one ``ddp_worker`` run on ``devices`` processes (started fresh)."""
    env = ddp_env(Path(__file__).resolve().parent.parent)
    command = [sys.executable, str(Path(__file__).resolve()), "--ddp-worker", str(devices)]
    command += ["--steps", str(steps), "--warmup", str(warmup), "--root", str(root)]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
    report = json.loads((root / f"ddp{devices}.json").read_text())
    assert report["world_size"] == devices, report
    return float(report["ms"])


def bench_ddp(console: Console, steps: int, warmup: int, repeats: int) -> None:
    """Part 6."""
    single, double = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            single.append(time_processes(1, steps, warmup, Path(tmp) / f"{repeat}"))
            double.append(time_processes(2, steps, warmup, Path(tmp) / f"{repeat}"))
    one, two = statistics.median(single), statistics.median(double)
    batch = DataConfig().batch_size
    table = Table(
        title=f"6. DDP scaling at the same global batch ({batch} rows), "
        f"{repeats} interleaved repeats, medians"
    )
    for column in ("processes x threads", "rows per process", "ms/step", "all repeats"):
        table.add_column(column, justify="right")
    table.add_row("1 x 1", str(batch), f"{one:.1f}", " ".join(f"{v:.1f}" for v in single))
    table.add_row(
        "2 x 1 (DDP, gloo)", str(batch // 2), f"{two:.1f}", " ".join(f"{v:.1f}" for v in double)
    )
    console.print(table)
    speedup = one / two
    console.print(
        f"Speed-up {speedup:.2f}x on 2 processes; scaling efficiency "
        f"[bold]{speedup / 2:.0%}[/bold] (speed-up / processes)"
    )


def bench_compile(console: Console, steps: int, warmup: int, repeats: int) -> None:
    """Part 7."""
    import torch._dynamo

    eager, compiled, first = [], [], []
    for _ in range(repeats):
        eager.append(time_plain(steps, warmup)[0])
        ms, first_s = time_plain(steps, warmup, compile_model=True)
        compiled.append(ms)
        first.append(first_s)
    args = (GPTConfig(), OptimConfig(), DataConfig())
    whole = train_plain(*args, 30, snapshot_at=20, compile_model=True)
    assert whole.snapshot is not None
    resumed = train_plain(*args, 30, resume=whole.snapshot, compile_model=True)
    exact = all(
        torch.equal(value, resumed.model.state_dict()[key])
        for key, value in whole.model.state_dict().items()
    )
    torch.compiler.reset()
    e, c = statistics.median(eager), statistics.median(compiled)
    table = Table(title=f"7. torch.compile on CPU, 1 thread ({repeats} interleaved repeats)")
    for column in ("model", "ms/step (median)", "all repeats", "first step (s)"):
        table.add_column(column, justify="right")
    table.add_row("eager", f"{e:.1f}", " ".join(f"{v:.1f}" for v in eager), "")
    table.add_row(
        "model.compile()",
        f"{c:.1f}",
        " ".join(f"{v:.1f}" for v in compiled),
        " ".join(f"{v:.1f}" for v in first),
    )
    console.print(table)
    console.print(
        f"compiled / eager: [bold]{c / e:.2f}[/bold]; resumed compiled run bit-equal to the "
        f"uninterrupted one: [bold]{'yes' if exact else 'NO'}[/bold]. The first step compiles "
        "(cold on-disk cache: about 30 s; warm: a few s), in every process."
    )


@contextmanager
def phase_timers() -> Iterator[dict[str, list[float]]]:
    """Seconds of each call of the model's forward, ``Tensor.backward`` and AdamW's
    update function, by phase, while the context is open (the same wrappers in any loop)."""
    import torch.optim.adam as adam_module

    from lit_spikes.demo.model import TinyGPT

    calls: dict[str, list[float]] = {"forward": [], "backward": [], "adamw": []}
    targets: list[tuple[Any, str, str]] = [
        (TinyGPT, "forward", "forward"),
        (torch.Tensor, "backward", "backward"),
        (adam_module, "adam", "adamw"),  # AdamW's step calls adam() (decoupled decay)
    ]
    originals = [getattr(owner, attribute) for owner, attribute, _ in targets]

    def timed(function: Any, phase: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                calls[phase].append(time.perf_counter() - start)

        return wrapper

    for (owner, attribute, phase), original in zip(targets, originals, strict=True):
        setattr(owner, attribute, timed(original, phase))
    try:
        yield calls
    finally:
        for (owner, attribute, _), original in zip(targets, originals, strict=True):
            setattr(owner, attribute, original)


def bench_phases(console: Console, steps: int, warmup: int, repeats: int) -> None:
    """Part 8: the median per step of each phase in each loop of part 1."""
    import lit_spikes.demo.module as module_code
    import lit_spikes.demo.plain as plain_code

    kinds = ("plain", "demos", "alone")
    per_kind: dict[str, dict[str, list[float]]] = {kind: {} for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for kind in kinds if repeat % 2 == 0 else tuple(reversed(kinds)):
                with (
                    phase_timers() as calls,
                    step_stamps(plain_code if kind == "plain" else module_code) as starts,
                ):
                    if kind == "plain":
                        train_plain(GPTConfig(), OptimConfig(), DataConfig(), steps)
                    else:
                        features = kind == "demos"
                        spec = RunSpec(
                            Path(tmp) / f"{repeat}-{kind}",
                            "bench",
                            steps,
                            checkpoint_every=DEMO_CHECKPOINT_EVERY if features else None,
                            callbacks=[SpikeDetector()] if features else [],
                            progress_bar=False,
                            trainer_kwargs={"limit_val_batches": 0}
                            | ({} if features else {"logger": False}),
                        )
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            spec.trainer().fit(TinyGPTModule(), datamodule=StepDataModule())
                intervals = [b - a for a, b in itertools.pairwise(starts[warmup:])]
                phases = {"step": statistics.median(intervals)}
                for phase, seconds in calls.items():
                    phases[phase] = statistics.median(seconds[warmup:])
                phases["rest"] = phases["step"] - sum(phases[p] for p in calls)
                for phase, value in phases.items():
                    per_kind[kind].setdefault(phase, []).append(1000 * value)
    table = Table(
        title=f"8. Where a step's time goes ({repeats} interleaved repeats of {steps} steps; "
        "medians per step, ms)"
    )
    phases = list(per_kind["plain"])
    table.add_column("loop")
    for phase in phases:
        table.add_column(phase, justify="right")
    medians = {k: {p: statistics.median(v) for p, v in per_kind[k].items()} for k in kinds}
    for kind in kinds:
        table.add_row(kind, *(f"{medians[kind][p]:.2f}" for p in phases))
    console.print(table)
    for kind in ("alone", "demos"):
        extra = {p: medians[kind][p] - medians["plain"][p] for p in phases}
        console.print(
            f"{kind} - plain: "
            + ", ".join(f"{p} {v:+.2f} ms" for p, v in extra.items())
            + f" (the rest: {100 * extra['rest'] / medians['plain']['step']:+.1f}% of a step)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    parser.add_argument(
        "--repeats",
        type=int,
        default=30,
        help="part 1's interleaved repeats (parts 6 and 7 take at most 3)",
    )
    parser.add_argument("--skip-main-job", action="store_true", help="leave part 2 out")
    parser.add_argument(
        "--main-job-repeats", type=int, default=3, help="part 2's pairs (about 150 s each)"
    )
    parser.add_argument(
        "--parts", default="1,2,3,4,5,6,7", help="comma-separated parts to run (default: all)"
    )
    parser.add_argument("--ddp-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker is not None:
        ddp_worker(args.ddp_worker, args.steps, args.warmup, args.root)
        return
    if args.main_job_repeats < 1:
        parser.error(f"--main-job-repeats={args.main_job_repeats} must be >= 1")
    if not 0 <= args.warmup < args.steps - 1:
        parser.error(f"--warmup={args.warmup} must be in [0, --steps - 1)")
    console = Console()
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric"):  # "GPU available: ...", tips
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")
    console.print(
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
        f"lightning {pl.__version__}"
    )
    parts = {int(part) for part in args.parts.split(",") if part.strip()}
    if args.skip_main_job:
        parts.discard(2)
    step_ms = bench_loop(console, args.steps, args.warmup, args.repeats) if 1 in parts else 33.0
    if 2 in parts:
        bench_main_job(console, args.main_job_repeats)
    if 3 in parts:
        bench_checkpoints(console)
    if 4 in parts:
        bench_detector(console, step_ms)
    if 5 in parts:
        bench_model(console)
    if 6 in parts:
        bench_ddp(console, args.steps, args.warmup, min(args.repeats, 3))
    if 7 in parts:
        bench_compile(console, args.steps, args.warmup, min(args.repeats, 3))
    if 8 in parts:
        bench_phases(console, 120, args.warmup, min(args.repeats, 10))


def bench_loop(console: Console, steps: int, warmup: int, repeats: int) -> float:
    """Part 1; returns the plain loop's median ms/step. Each repeat times the plain loop,
    Lightning as the demos run it and Lightning's loop alone, in alternating order."""
    runs: dict[str, list[float]] = {"plain": [], "demos": [], "alone": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            for kind in order:  # a drift of the VM favours none of them
                root = Path(tmp) / f"{repeat}-{kind}"
                if kind == "plain":
                    runs[kind].append(time_plain(steps, warmup)[0])
                else:
                    every = DEMO_CHECKPOINT_EVERY
                    runs[kind].append(time_lightning(steps, warmup, root, every, kind == "demos"))
    medians = {kind: statistics.median(values) for kind, values in runs.items()}
    table = Table(
        title=f"1. Loop overhead ({repeats} interleaved repeats in alternating order, medians)"
    )
    table.add_column("loop")
    table.add_column("ms/step", justify="right")
    table.add_column("/ plain", justify="right")
    table.add_column("all repeats", justify="right")
    saves = steps // DEMO_CHECKPOINT_EVERY - warmup // DEMO_CHECKPOINT_EVERY
    labels = {
        "plain": "plain PyTorch",
        "demos": f"Lightning as the demos run it (TensorBoard every step, spike detector, "
        f"checkpoint every {DEMO_CHECKPOINT_EVERY}: {saves} in the {steps - 1 - warmup} "
        "timed steps)",
        "alone": "Lightning's loop alone (no logger, checkpoints or callbacks)",
    }
    # Each repeat takes its runs seconds apart; the median of the ratios to the plain run
    # of the same repeat is robust to this VM's drift over a minute.
    paired = {
        kind: [b / a for a, b in zip(runs["plain"], values, strict=True)]
        for kind, values in runs.items()
    }
    ratios = {kind: statistics.median(values) for kind, values in paired.items()}
    # The VM's noise in one figure: repeats of the same loop scatter by a few %.
    low, high = median_interval(paired["demos"])
    for kind, values in runs.items():
        ratio = "" if kind == "plain" else f"{ratios[kind]:.3f}"
        table.add_row(
            labels[kind], f"{medians[kind]:.1f}", ratio, " ".join(f"{v:.1f}" for v in values)
        )
    console.print(table)
    console.print(
        f"Lightning as the demos run it / plain: [bold]{ratios['demos']:.3f}[/bold] (median "
        f"of paired ratios, 95% interval of that median {low:.3f}-{high:.3f}; ratio of "
        f"medians {medians['demos'] / medians['plain']:.3f}); Lightning's loop alone / "
        f"plain: {ratios['alone']:.3f}"
    )
    return medians["plain"]


def bench_main_job(console: Console, repeats: int) -> None:
    """Part 2: ``repeats`` pairs of (make demo's training, the seed's serial way), taken
    one after the other, in alternating order so that a drift of this VM's speed does not
    favour one side; the median of the pair ratios is robust to what drift is left."""
    jobs, serials = [], []
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            setup = DemoSetup(log_root=Path(tmp) / "runs")
            if repeat % 2:
                serial_s, serial_steps = seed_way_serial(setup, DEMO_BRANCHES)
            job = run_main_job(setup, console=Console(quiet=True))
            if not repeat % 2:
                serial_s, serial_steps = seed_way_serial(setup, DEMO_BRANCHES)
        jobs.append(job)
        serials.append(serial_s)
    train = [job.train_s for job in jobs]
    table = Table(
        title=f"2. Main job against the seed's way ({repeats} pairs in alternating order, medians)"
    )
    table.add_column("way")
    table.add_column("steps", justify="right")
    table.add_column("training wall time (s)", justify="right")
    table.add_column("all pairs", justify="right")
    table.add_row(
        "make demo: parallel branches from real checkpoints",
        str(serial_steps),
        f"{statistics.median(train):.1f}",
        " ".join(f"{t:.1f}" for t in train),
    )
    table.add_row(
        "plain loop, serial, branching from an in-memory snapshot",
        str(serial_steps),
        f"{statistics.median(serials):.1f}",
        " ".join(f"{t:.1f}" for t in serials),
    )
    console.print(table)
    ratios = [t / s for t, s in zip(train, serials, strict=True)]
    extra = statistics.median(job.wall_s - job.train_s for job in jobs)
    console.print(
        f"make demo / seed's way: [bold]{statistics.median(ratios):.2f}[/bold] (median of "
        f"paired ratios {' '.join(f'{r:.2f}' for r in ratios)}; training only: make demo's "
        f"tables and figures took {extra:.1f} s more)"
    )


if __name__ == "__main__":
    main()
