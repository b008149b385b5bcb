"""`make bench`: figures measured side by side in one run, on this machine.

1. Loop overhead: ms/step of the Lightning loop as the demos run it (TensorBoard logging
   every step, spike detector on, progress bar off) against a plain PyTorch loop on the
   same model, batches and thread count; interleaved repetitions, medians, their ratio.
2. Main job against the seed's way: the training of `make demo` (reference + all branches
   of demos 1 and 2, in parallel workers from real checkpoints) against the same steps run
   serially by a plain loop branching from an in-memory snapshot (``--skip-main-job``
   leaves this part out).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from rich.console import Console
from rich.table import Table

from callbacks import SpikeDetector
from lit_spikes.data import DataConfig, StepDataModule
from lit_spikes.demos import DemoSetup, demo1_branches
from lit_spikes.main_job import run_main_job
from lit_spikes.model import GPTConfig
from lit_spikes.module import DEFAULT_MODEL_SEED, OptimConfig, TinyGPTModule
from lit_spikes.plain import train_plain
from lit_spikes.training import RunSpec


class StepTimer(Callback):
    """Wall time of each training step (from one step's start to the next's)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def ms_per_step(starts: list[float], warmup: int) -> float:
    return 1000 * (starts[-1] - starts[warmup]) / (len(starts) - 1 - warmup)


def time_plain(steps: int, warmup: int) -> float:
    starts: list[float] = []
    import lit_spikes.plain as plain

    original = plain.grad_norm

    def timed(parameters: Any) -> torch.Tensor:  # one call per step: a step boundary
        starts.append(time.perf_counter())
        return original(parameters)

    plain.grad_norm = timed
    try:
        train_plain(GPTConfig(), OptimConfig(), DataConfig(), steps, DEFAULT_MODEL_SEED)
    finally:
        plain.grad_norm = original
    return ms_per_step(starts, warmup)


def time_lightning(steps: int, warmup: int, root: Path) -> float:
    timer = StepTimer()
    spec = RunSpec(
        root,
        "bench",
        steps,
        callbacks=[timer, SpikeDetector()],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0},
    )
    module = TinyGPTModule()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec.trainer().fit(module, datamodule=StepDataModule())
    return ms_per_step(timer.starts, warmup)


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
    for _ in range(branch_count):
        train_plain(
            setup.gpt,
            setup.optim,
            setup.data,
            setup.steps,
            setup.model_seed,
            record=True,
            resume=reference.snapshot,
        )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--skip-main-job", action="store_true", help="leave part 2 out")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps - 1:
        parser.error(f"--warmup={args.warmup} must be in [0, --steps - 1)")
    console = Console()
    torch.set_num_threads(1)
    console.print(
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
        f"lightning {pl.__version__}"
    )
    plain_ms, lightning_ms = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            plain_ms.append(time_plain(args.steps, args.warmup))
            lightning_ms.append(time_lightning(args.steps, args.warmup, Path(tmp) / str(repeat)))
    p, lt = statistics.median(plain_ms), statistics.median(lightning_ms)
    table = Table(title=f"1. Loop overhead ({args.repeats} interleaved repeats, medians)")
    table.add_column("loop")
    table.add_column("ms/step", justify="right")
    table.add_column("all repeats", justify="right")
    table.add_row("plain PyTorch", f"{p:.1f}", " ".join(f"{v:.1f}" for v in plain_ms))
    table.add_row(
        "Lightning (TensorBoard every step, spike detector)",
        f"{lt:.1f}",
        " ".join(f"{v:.1f}" for v in lightning_ms),
    )
    console.print(table)
    # Each repeat pairs two runs taken seconds apart; the median of the pair ratios is
    # robust to this VM's drift over a minute.
    pair = statistics.median(b / a for a, b in zip(plain_ms, lightning_ms, strict=True))
    console.print(
        f"Lightning / plain: [bold]{pair:.3f}[/bold] (median of paired ratios; "
        f"ratio of medians {lt / p:.3f})"
    )
    if args.skip_main_job:
        return
    with tempfile.TemporaryDirectory() as tmp:
        setup = DemoSetup(log_root=Path(tmp) / "runs")
        quiet = Console(quiet=True)
        job = run_main_job(setup, console=quiet)
        branches = len(demo1_branches(setup)) + 4
        serial_s, serial_steps = seed_way_serial(setup, branches)
    table = Table(title="2. Main job against the seed's way (training of demos 1 and 2)")
    table.add_column("way")
    table.add_column("steps", justify="right")
    table.add_column("wall time (s)", justify="right")
    table.add_row(
        "make demo: parallel branches from real checkpoints", str(serial_steps), f"{job.wall_s:.1f}"
    )
    table.add_row(
        "plain loop, serial, branching from an in-memory snapshot",
        str(serial_steps),
        f"{serial_s:.1f}",
    )
    console.print(table)
    console.print(f"make demo / seed's way: [bold]{job.wall_s / serial_s:.2f}[/bold]")


if __name__ == "__main__":
    main()
