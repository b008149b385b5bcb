"""The same training step as ``TinyGPTModule``, in a plain PyTorch loop.

The benchmark's baseline and a cross-check: with the same configs, seeds and thread
count, the Lightning run and this loop produce bit-identical weights (a test says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lit_spikes.data import DataConfig, StepDataModule
from lit_spikes.model import GPTConfig, TinyGPT, build_model
from lit_spikes.module import DEFAULT_MODEL_SEED, OptimConfig, grad_norm, seed_rngs


@dataclass
class PlainResult:
    model: TinyGPT
    optimizer: torch.optim.AdamW
    history: list[dict[str, float]] = field(default_factory=list)


def train_plain(
    model_config: GPTConfig,
    optim_config: OptimConfig,
    data_config: DataConfig,
    steps: int,
    model_seed: int = DEFAULT_MODEL_SEED,
    train_seed: int = 0,
    num_threads: int = 1,
    record: bool = True,
) -> PlainResult:
    """Train ``steps`` steps from scratch, exactly as ``TinyGPTModule`` does under a Trainer
    without clipping. ``record=False`` skips the per-step bookkeeping (for timing)."""
    torch.set_num_threads(num_threads)
    model = build_model(model_config, model_seed)
    optimizer, scheduler = optim_config.build(model.parameters())
    batches = iter(StepDataModule(data_config).stream(0))
    seed_rngs(train_seed)
    result = PlainResult(model, optimizer)
    model.train()
    for step in range(steps):
        batch = next(batches)
        out = model(batch["x"], batch["y"])
        assert out.loss is not None
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        norm = grad_norm(model.parameters())
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
    return result
