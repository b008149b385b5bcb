"""A module written for the elastic resume's tests and the worker its multi-process tests
spawn (module level: a spawned process imports it by name)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lit_spikes.elastic import shards_of
from lit_spikes.elastic.exchange import exchanged_sum
from lit_spikes.randomness import derive


class DropoutNet(nn.Module):
    """An MLP whose dropout draws from the global RNG."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch(rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(rows, 16, generator=generator), torch.randn(rows, 4, generator=generator)


def shard_loss(model: nn.Module, step: int, shard: int, num_shards: int) -> torch.Tensor:
    """One shard's loss: its rows and its dropout drawn from (seed, step, shard), its mean
    over the shards' count."""
    x, y = batch()
    rows = x.shape[0] // num_shards
    torch.manual_seed(derive(0, step, shard) & (2**63 - 1))
    part = slice(shard * rows, (shard + 1) * rows)
    return nn.functional.mse_loss(model(x[part]), y[part]) / num_shards


def shard_grads(model: nn.Module, step: int, shard: int, num_shards: int) -> list[torch.Tensor]:
    """One shard's gradient, into fresh buffers."""
    loss = shard_loss(model, step, shard, num_shards)
    return list(torch.autograd.grad(loss, list(model.parameters())))


def worker(rank: int, world: int, init_file: str, out: str, num_shards: int, mode: str) -> None:
    """One process of ``world``: its shards' gradients summed with the others' by the
    fixed tree (``mode="tree"``) or accumulated into ``.grad`` and all-reduced (the
    control); the sum saved to ``out/<mode>-<world>-<rank>.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = DropoutNet()
        mine = shards_of(rank, num_shards, world)
        if mode == "tree":
            total = exchanged_sum([shard_grads(model, 3, s, num_shards) for s in mine], num_shards)
        else:
            total = accumulated(model, mine, num_shards)
            for grad in total:
                dist.all_reduce(grad)
        torch.save(total, Path(out) / f"{mode}-{world}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def accumulated(model: nn.Module, shards: range, num_shards: int) -> list[torch.Tensor]:
    """The shards' gradients accumulated into ``.grad`` one after another."""
    model.zero_grad()
    for shard in shards:
        shard_loss(model, 3, shard, num_shards).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def added(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per-process sums added in rank order."""
    return [functools.reduce(torch.add, g) for g in zip(*parts, strict=True)]
