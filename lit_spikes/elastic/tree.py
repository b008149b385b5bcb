"""The fixed-order sum of the elastic resume (issue 68): the global batch of a step is cut
into V fixed shards, each shard's gradient computed into a fresh buffer, and the V shard
gradients summed in one balanced binary tree over the shards, whichever process computed
each. A process holding shards ``[r * V/W, (r + 1) * V/W)`` sums its part of the tree; the
parts are exchanged and the tree finished in the same order on every process. The same
adds happen in the same order for every process count W that divides V, so the sum is
the same to the bit (floating-point addition is not associative: an all-reduce of W
per-process sums, or a running sum into ``.grad``, gives other bits for another W).

Where a process's shards are a whole subtree (W a power of two dividing V), it sends one
tensor, its subtree's sum; otherwise it sends its shards' gradients and the tree is
summed from the leaves (more to exchange, the same bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _split(lo: int, hi: int) -> int:
    """Where the tree cuts the shards ``[lo, hi)``: in the middle (the left half the
    smaller by one where the count is odd)."""
    return lo + (hi - lo) // 2


def tree_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of ``tensors`` in the fixed balanced binary tree over their order."""
    if not tensors:
        raise ValueError("tree_sum of no tensors: give at least one")
    return _sum(tensors, 0, len(tensors))


def _sum(tensors: Sequence[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    if hi - lo == 1:
        return tensors[lo]
    middle = _split(lo, hi)
    return _sum(tensors, lo, middle) + _sum(tensors, middle, hi)


def check_world(num_shards: int, world_size: int) -> None:
    """The shards split evenly over the processes.

    Raises:
        ValueError: naming both counts and the process counts that fit.
    """
    if num_shards < 1 or world_size < 1 or num_shards % world_size:
        fits = [w for w in range(1, num_shards + 1) if num_shards % w == 0]
        raise ValueError(
            f"{world_size} processes cannot share {num_shards} elastic shards evenly: run on "
            f"a process count that divides {num_shards} ({fits}), or start the run with "
            "another number of shards"
        )


def shards_of(rank: int, num_shards: int, world_size: int) -> range:
    """The shards process ``rank`` computes: a contiguous block, in rank order."""
    check_world(num_shards, world_size)
    block = num_shards // world_size
    return range(rank * block, (rank + 1) * block)


def _is_node(lo: int, hi: int, num_shards: int) -> bool:
    """Whether the shards ``[lo, hi)`` are one node (a whole subtree) of the tree."""
    start, end = 0, num_shards
    while (start, end) != (lo, hi):
        if end - start == 1 or not start <= lo < hi <= end:
            return False
        middle = _split(start, end)
        if hi <= middle:
            end = middle
        elif lo >= middle:
            start = middle
        else:
            return False
    return True


def subtrees(num_shards: int, world_size: int) -> bool:
    """Whether every process's block of shards is a whole subtree of the tree (true for
    a power-of-two process count that divides the shards)."""
    return all(
        _is_node(s.start, s.stop, num_shards)
        for s in (shards_of(r, num_shards, world_size) for r in range(world_size))
    )


def rank_part(
    leaves: Sequence[torch.Tensor], num_shards: int, world_size: int
) -> list[torch.Tensor]:
    """What a process sends of its shards' gradients ``leaves`` (in shard order): their
    subtree's sum where its block is a subtree, else the leaves themselves."""
    if len(leaves) != num_shards // world_size:
        raise ValueError(
            f"a process of {world_size} holds {num_shards // world_size} of {num_shards} "
            f"shards, not {len(leaves)}"
        )
    return [tree_sum(leaves)] if subtrees(num_shards, world_size) else list(leaves)


def finish(
    parts: Sequence[Sequence[torch.Tensor]], num_shards: int, world_size: int
) -> torch.Tensor:
    """The tree's sum from every process's part (``rank_part``), in rank order: the same
    bits as ``tree_sum`` of all the shards' gradients."""
    if len(parts) != world_size:
        raise ValueError(f"finish: {len(parts)} parts for {world_size} processes")
    if not subtrees(num_shards, world_size):
        return tree_sum([leaf for part in parts for leaf in part])
    block = num_shards // world_size
    sums = {(r * block, (r + 1) * block): part[0] for r, part in enumerate(parts)}
    return _finish(sums, 0, num_shards)


def _finish(sums: dict[tuple[int, int], torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    if (lo, hi) in sums:
        return sums[(lo, hi)]
    middle = _split(lo, hi)
    return _finish(sums, lo, middle) + _finish(sums, middle, hi)
