"""The elastic resume's fixed-order sum (issue 68, its first step): the shards' gradients
summed in one balanced tree give the same bits for every process count that divides the
shards, where a running sum or a sum of per-process sums does not; on a module written
for the test, each shard's gradient computed into a fresh buffer with its randomness
keyed by (seed, step, shard), the processes simulated in one."""

from __future__ import annotations

import functools

import pytest
import torch

from lit_spikes.elastic import check_world, finish, rank_part, shards_of, subtrees, tree_sum
from tests.modules.elastic_modules import DropoutNet, accumulated, added, shard_grads

SHARDS = (1, 2, 4, 6, 8, 12)


def _leaves(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Float32 vectors of magnitudes over eight decades: their sum's bits depend on the
    order of the adds."""
    generator = torch.Generator().manual_seed(seed)
    scale = 10 ** (8 * torch.rand(count, 1, generator=generator) - 4)
    return list(torch.randn(count, 4096, generator=generator) * scale)


def _combined(leaves: list[torch.Tensor], num_shards: int, world_size: int) -> torch.Tensor:
    parts = [
        rank_part([leaves[i] for i in shards_of(r, num_shards, world_size)], num_shards, world_size)
        for r in reversed(range(world_size))  # computed in any order, finished in rank order
    ]
    return finish(parts[::-1], num_shards, world_size)


@pytest.mark.parametrize("num_shards", SHARDS)
def test_every_process_count_that_divides_the_shards_gives_the_same_bits(num_shards: int) -> None:
    leaves = _leaves(num_shards)
    whole = tree_sum(leaves)
    for world_size in [w for w in range(1, num_shards + 1) if num_shards % w == 0]:
        assert torch.equal(_combined(leaves, num_shards, world_size), whole), world_size


def test_the_order_of_the_adds_shows_in_the_bits() -> None:
    """The control: with these leaves, a running sum (as ``.grad`` accumulates) and a sum
    of 4 per-process running sums (as an all-reduce of them adds) each differ from the
    tree's, so the test above can fail."""
    leaves = _leaves(8)
    running = functools.reduce(torch.add, leaves)
    per_process = functools.reduce(torch.add, [leaves[i] + leaves[i + 1] for i in (0, 2, 4, 6)])
    assert not torch.equal(running, tree_sum(leaves))
    assert not torch.equal(per_process, running)


def test_a_process_sends_its_subtree_or_its_leaves() -> None:
    """A power-of-two process count's blocks are subtrees: one tensor each to exchange;
    3 processes of 12 shards (blocks of 4 in a tree cut 6 + 6, 3 + 3) send their leaves."""
    assert all(subtrees(8, w) for w in (1, 2, 4, 8)) and subtrees(12, 4)
    assert not subtrees(12, 3) and not subtrees(6, 3)
    leaves = _leaves(4)
    assert len(rank_part(leaves[:2], 8, 4)) == 1 and len(rank_part(leaves, 12, 3)) == 4
    assert list(shards_of(2, 12, 3)) == [8, 9, 10, 11]


def test_a_process_count_that_does_not_divide_the_shards_is_refused() -> None:
    with pytest.raises(ValueError, match=r"3 processes cannot share 8 .* \(\[1, 2, 4, 8\]\)"):
        check_world(8, 3)
    with pytest.raises(ValueError, match="cannot share"):
        shards_of(0, 8, 3)


@pytest.mark.parametrize("num_shards", [4, 8])
def test_a_modules_gradient_is_the_same_on_1_2_and_4_processes(num_shards: int) -> None:
    """The processes simulated in one: each shard's gradient into fresh buffers, each
    process's part, the tree finished; the control accumulates into ``.grad`` and adds
    the processes' sums, as DDP's all-reduce of ``.grad`` does."""
    model = DropoutNet()
    leaves = [shard_grads(model, 3, s, num_shards) for s in range(num_shards)]
    params = range(len(leaves[0]))
    sums = {}
    for world_size in (1, 2, 4):
        parts: list[list[list[torch.Tensor]]] = []
        for rank in range(world_size):
            mine = [leaves[s] for s in shards_of(rank, num_shards, world_size)]
            sent = [rank_part([g[p] for g in mine], num_shards, world_size) for p in params]
            assert all(len(one) == 1 for one in sent)  # a subtree's sum, not its leaves
            parts.append(sent)
        sums[world_size] = [
            finish([part[p] for part in parts], num_shards, world_size) for p in params
        ]
    for world_size in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(sums[1], sums[world_size], strict=True))
    one = accumulated(model, range(num_shards), num_shards)
    two = added([accumulated(model, shards_of(r, num_shards, 2), num_shards) for r in (0, 1)])
    assert not all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
