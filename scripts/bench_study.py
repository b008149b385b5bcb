"""The study's pool against one run alone (issue #34; docs/performance.md, "The study").

Measured side by side in one run, on this machine, with the cells of ``make study``
(configs/study/demo.yaml):

1. One 400-step reference cell (``run_cell``: its Lightning run, checkpoints, TensorBoard
   run, ``final_state.pt``, ``update_norms.json``, ``cell.json``) alone in the study's
   pool with one worker, one torch thread: steps per second.
2. Two of the same cell at once in the study's pool with two workers (each in its own
   log root, so both compute the same thing): aggregate steps per second, and the ratio
   to part 1 (issue #34's target: at least 1.8 on 2 cores), cells per minute.
3. Each cell's fixed overhead: its wall time (``run_cell``, as ``cell.json``'s ``wall_s``)
   minus its training time (first batch start to last batch end, timed by a callback
   added for the bench alone), and the pool's own cost (submit to result, minus that).

Usage: ``python scripts/bench_study.py [--seed 1] [--repeats 2]`` (about 1 minute a
repeat on 2 cores). Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import yaml
from lightning.pytorch.callbacks import Callback

from lit_spikes.tools.study import cells, jobs
from lit_spikes.tools.study.config import StudyConfig

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "study" / "demo.yaml"


class _Clock(Callback):
    """When the first training batch starts and the last one ends."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.last = time.perf_counter()


def _timed_cell(config: StudyConfig, cell: jobs.Cell) -> dict[str, float]:
    """``run_cell`` in a worker of the pool, with ``_Clock`` among the cell's callbacks
    (a callback that only reads the clock: the cell computes the same numbers)."""
    clock, wrap = _Clock(), cells.with_exact_resume

    def with_clock(callbacks: list[Callback], exact: Any) -> list[Callback]:
        return wrap([*callbacks, clock], exact)

    with mock.patch.object(cells, "with_exact_resume", with_clock):
        result = jobs.run_cell(cells.plan(config), cell)
    assert clock.first is not None
    return {"wall": result["wall_s"], "train": clock.last - clock.first, "steps": cell.cost}


def _round(pool: ProcessPoolExecutor, roots: list[Path], seed: int) -> dict[str, Any]:
    """The reference cell of ``seed`` once in each of ``roots``, all submitted at once."""
    configs = []
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
        demo = yaml.safe_load(CONFIG.read_text())
        demo["sweep"]["seeds"] = 1  # one seed: the sweep is not run here
        configs.append(StudyConfig(**demo | {"log_root": root, "seeds": [seed]}))
    cell = cells.first_cells(configs[0])[0]
    assert cell.kind == "reference"
    start = time.perf_counter()
    futures = [pool.submit(_timed_cell, config, cell) for config in configs]
    timings = [future.result() for future in futures]
    elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "cells": timings, "steps": sum(t["steps"] for t in timings)}


def _pool(workers: int) -> ProcessPoolExecutor:
    """The study's pool: its start method, preload and worker setup (one torch thread)."""
    context = jobs._context(cells.__name__)
    pool = ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=jobs._start_worker,
        initargs=(context.Queue(),),
    )
    list(pool.map(time.sleep, [0.2] * workers))  # every worker started before the clock
    return pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="the reference cell's model seed")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of parts 1 and 2")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    alone, pair = [], []
    with tempfile.TemporaryDirectory(prefix="bench-study-") as temp:
        one, two = _pool(1), _pool(2)
        try:
            for _ in range(args.repeats):  # interleaved: drift in the machine hits both
                alone.append(_round(one, [Path(temp) / "alone"], args.seed))
                pair.append(_round(two, [Path(temp) / "a", Path(temp) / "b"], args.seed))
        finally:
            one.shutdown()
            two.shutdown()
    alone_rate = statistics.median(r["steps"] / r["elapsed"] for r in alone)
    pair_rate = statistics.median(r["steps"] / r["elapsed"] for r in pair)
    every = [c for r in alone + pair for c in r["cells"]]
    overhead = [c["wall"] - c["train"] for c in every]
    pool_cost = [r["elapsed"] - max(c["wall"] for c in r["cells"]) for r in alone + pair]
    print(f"reference cell (seed {args.seed}, 400 steps), {args.repeats} repeats, medians")
    print(f"load average at the start: {load:.2f}, cores: {os.cpu_count()}")
    print(f"one cell alone, 1 worker:          {alone_rate:6.1f} steps/s")
    print(f"two cells at once, 2 workers:      {pair_rate:6.1f} steps/s (aggregate)")
    print(f"ratio (target >= 1.8 on 2 cores):  {pair_rate / alone_rate:6.2f}")
    cells_per_min = statistics.median(60 * len(r["cells"]) / r["elapsed"] for r in pair)
    print(f"cells per minute, 2 workers:       {cells_per_min:6.1f}")
    print(
        f"per-cell fixed overhead (wall - training): median {statistics.median(overhead):.2f} s "
        f"(range {min(overhead):.2f}-{max(overhead):.2f}), of a cell's "
        f"{statistics.median(c['wall'] for c in every):.1f} s"
    )
    print(f"the pool's own cost a round (submit to last result - cell): {max(pool_cost):.2f} s")


if __name__ == "__main__":
    main()
