"""The elastic bit-exact resume (issue 68), in steps: the fixed-order sum of the shards'
gradients (``tree``) and its exchange between processes (``exchange``), the same bits on
any process count that divides the shards."""

from lit_spikes.elastic.exchange import exchanged_sum
from lit_spikes.elastic.tree import check_world, finish, rank_part, shards_of, subtrees, tree_sum

__all__ = [
    "check_world",
    "exchanged_sum",
    "finish",
    "rank_part",
    "shards_of",
    "subtrees",
    "tree_sum",
]
