"""Training runs ("branches") that scripts launch, alone or in parallel worker processes.

A branch is a picklable description of one Trainer run: what to train, from which real
``.ckpt`` file, with which callbacks. ``run_branches`` runs independent branches in
worker processes (one CPU thread each, so both cores are busy and every branch computes
exactly what it would alone) and shows one overall progress display.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from typing_extensions import override

from lit_spikes.data import DataConfig, StepDataModule
from lit_spikes.model import GPTConfig
from lit_spikes.module import DEFAULT_MODEL_SEED, OptimConfig, TinyGPTModule
from lit_spikes.training import RunSpec


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

    def losses(self) -> dict[int, float]:
        return {int(r["step"]): r["loss"] for r in self.history}

    def window(self, lo: int, hi: int, key: str = "loss") -> float:
        """Largest ``key`` over steps in ``[lo, hi)``."""
        return max(r[key] for r in self.history if lo <= r["step"] < hi)

    def at(self, step: int, key: str = "loss") -> float:
        return next(r[key] for r in self.history if r["step"] == step)


class _ProgressReporter(Callback):
    """Sends (branch, global step) to the parent's progress display."""

    def __init__(self, name: str, queue: Any, every: int = 5) -> None:
        self.name, self.queue, self.every = name, queue, every

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0 or trainer.global_step == trainer.max_steps:
            self.queue.put((self.name, trainer.global_step))


def run_branch(
    branch: Branch, log_root: Path, progress_queue: Any = None, progress_bar: bool = True
) -> BranchResult:
    """Train one branch to its end and collect its results."""
    start = time.perf_counter()
    module = TinyGPTModule(gpt=branch.gpt, optim=branch.optim, model_seed=branch.model_seed)
    datamodule = StepDataModule(branch.data)
    callbacks = list(branch.callbacks)
    if progress_queue is not None:
        callbacks.append(_ProgressReporter(branch.name, progress_queue))
    spec = RunSpec(
        log_root=log_root,
        name=branch.name,
        max_steps=branch.max_steps,
        checkpoint_every=branch.checkpoint_every,
        val_every=branch.val_every,
        callbacks=callbacks,
        progress_bar=progress_bar and progress_queue is None,
        trainer_kwargs=branch.trainer_kwargs,
    )
    trainer = spec.trainer()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, datamodule=datamodule, ckpt_path=branch.ckpt_path)
    bpc = trainer.callback_metrics.get("val/bpc")
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
    )


def _worker(branch: Branch, log_root: Path, queue: Any) -> BranchResult:
    torch.set_num_threads(1)
    return run_branch(branch, log_root, queue)


def run_branches(
    branches: Sequence[Branch], log_root: Path, workers: int = 2
) -> dict[str, BranchResult]:
    """Run independent branches, ``workers`` at a time, each in its own process."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    if workers == 1:
        return {b.name: run_branch(b, log_root) for b in branches}
    context = mp.get_context("spawn")
    manager = context.Manager()
    queue = manager.Queue()
    results: dict[str, BranchResult] = {}
    columns = (
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns) as progress, ProcessPoolExecutor(workers, mp_context=context) as pool:
        tasks = {}
        for b in branches:
            first = _ckpt_step(b.ckpt_path)
            tasks[b.name] = (progress.add_task(b.name, total=b.max_steps - first), first)
        futures = {pool.submit(_worker, b, log_root, queue): b.name for b in branches}
        pending = set(futures)
        while pending:
            try:
                name, step = queue.get(timeout=0.2)
                task, first = tasks[name]
                progress.update(task, completed=step - first)
            except Empty:
                pass
            for future in [f for f in pending if f.done()]:
                pending.discard(future)
                result = future.result()
                results[result.name] = result
                task, first = tasks[result.name]
                progress.update(task, completed=progress.tasks[task].total)
    manager.shutdown()
    return {b.name: results[b.name] for b in branches}


def _ckpt_step(path: Path | None) -> int:
    """The global step a branch starts at: that of its checkpoint, or 0."""
    if path is None:
        return 0
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])
