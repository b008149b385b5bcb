"""The same training step as ``TinyGPTModule``, in a plain PyTorch loop.

The benchmark's baseline and a cross-check: with the same configs, seeds and thread
count, the Lightning run and this loop produce bit-identical weights (a test says so).
It can branch the seed's way too: keep an in-memory snapshot at one step and resume
from it (``lit_spikes.demo.snapshot`` copies, so the snapshot survives every resume).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from lit_spikes.demo.data import DataConfig, StepDataModule
from lit_spikes.demo.model import GPTConfig, TinyGPT, build_model
from lit_spikes.demo.module import (
    DEFAULT_MODEL_SEED,
    OptimConfig,
    grad_norm,
    optimized_parameters,
    seed_rngs,
    set_flush_denormal,
)
from lit_spikes.demo.snapshot import Snapshot, restore_snapshot, take_snapshot


@dataclass
class PlainResult:
    model: TinyGPT
    optimizer: torch.optim.AdamW
    history: list[dict[str, float]] = field(default_factory=list)
    snapshot: Snapshot | None = None


def train_plain(
    model_config: GPTConfig,
    optim_config: OptimConfig,
    data_config: DataConfig,
    steps: int,
    model_seed: int = DEFAULT_MODEL_SEED,
    train_seed: int = 0,
    num_threads: int = 1,
    flush_denormal: bool = True,
    record: bool = True,
    resume: Snapshot | None = None,
    snapshot_at: int | None = None,
    compile_model: bool = False,
) -> PlainResult:
    """Train to global step ``steps`` exactly as ``TinyGPTModule`` does under a Trainer
    without clipping: from scratch, or from ``resume``. ``snapshot_at`` keeps a snapshot
    of that step; ``record=False`` skips the per-step bookkeeping (for timing);
    ``compile_model`` compiles the model in place (``torch.compile``; the benchmark's
    trial of it: not bit-equal to eager, and not faster here)."""
    torch.set_num_threads(num_threads)
    set_flush_denormal(flush_denormal)  # as TinyGPTModule.setup: left so, for evaluate_bpc
    model = build_model(model_config, model_seed)
    if compile_model:
        model.compile()  # in place: the state_dict keys stay those of the eager model
    optimizer, scheduler = optim_config.build(model.parameters())
    start = 0
    if resume is not None:
        restore_snapshot(resume, model, optimizer)
        start = resume.step
        with warnings.catch_warnings():  # replaying, no optimizer step is missing
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer")
            for _ in range(start):  # the schedule is a function of the step: replay it
                scheduler.step()
    batches = iter(StepDataModule(data_config).stream(start))
    if resume is None:
        seed_rngs(train_seed)
    result = PlainResult(model, optimizer)
    model.train()
    for step in range(start, steps):
        batch = next(batches)
        out = model(batch["x"], batch["y"])
        assert out.loss is not None
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        norm = grad_norm(optimized_parameters(optimizer))
        if record:
            result.history.append(
                {
                    "step": step,
                    "loss": out.loss.item(),
                    "max_logit": out.max_logit.item(),
                    "lr": optimizer.param_groups[0]["lr"],
                    "grad_norm": norm.item(),
                }
            )
        optimizer.step()
        scheduler.step()
        if snapshot_at is not None and step + 1 == snapshot_at:
            result.snapshot = take_snapshot(model, optimizer, snapshot_at)
    return result


@torch.no_grad()
def evaluate_bpc(model: TinyGPT, data_config: DataConfig, batch_size: int = 64) -> float:
    """Validation bits per character over the whole validation text, as the Trainer's
    validation computes it (the seed's ``eval_bpc``)."""
    dm = StepDataModule(data_config)
    dm.setup("validate")
    was_training = model.training
    model.eval()
    nats, count = 0.0, 0
    for batch in dm.val_dataloader():
        out = model(batch["x"], batch["y"])
        assert out.loss is not None
        nats += out.loss.double().item() * batch["y"].numel()
        count += batch["y"].numel()
    model.train(was_training)
    return nats / count / math.log(2.0)
