"""The exchange of the elastic resume's parts between processes: every process gathers
every process's part of the tree (``tree.rank_part``), in rank order, and finishes the
same tree, so every process holds the same bits. An all-gather, never an all-reduce: an
all-reduce adds in an order of its backend's and of the process count's choosing.

The gradients of all parameters travel as one flat vector a part (fewer, larger messages);
the adds are elementwise, so flattening changes no bit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lit_spikes.elastic.tree import finish, rank_part


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as one flat vector (their order kept)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``vector`` cut back into tensors shaped as ``like``."""
    out, start = [], 0
    for tensor in like:
        out.append(vector[start : start + tensor.numel()].view_as(tensor))
        start += tensor.numel()
    return out


def exchanged_sum(
    shard_grads: Sequence[Sequence[torch.Tensor]], num_shards: int
) -> list[torch.Tensor]:
    """The tree's sum of every shard's gradients, the same bits on every process and for
    every process count that divides ``num_shards``.

    Args:
        shard_grads: this process's shards' gradients, in shard order (each a list of one
            tensor per parameter): the shards ``tree.shards_of(rank, ...)`` names.
        num_shards: V, the fixed shards of a global batch.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    like = list(shard_grads[0])
    mine = rank_part([flatten(g) for g in shard_grads], num_shards, world)
    if world == 1:
        return unflatten(finish([mine], num_shards, 1), like)
    parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for piece in mine:  # every process sends as many pieces, each of one shape
        gathered = [torch.empty_like(piece) for _ in range(world)]
        dist.all_gather(gathered, piece.contiguous())
        for rank, tensor in enumerate(gathered):
            parts[rank].append(tensor)
    return unflatten(finish(parts, num_shards, world), like)
