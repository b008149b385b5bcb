"""The elastic resume's exchange between processes (issue 68): 1, 2 and 4 gloo processes
each compute their shards' gradients of a module written for the test and gather the
others' parts; every process of every count holds the same bits. The control, each
process's shards accumulated into ``.grad`` and all-reduced, gives other bits at 4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.modules.elastic_modules import worker

pytestmark = pytest.mark.slow
SHARDS = 4


def _run(tmp_path: Path, world: int, mode: str) -> list[list[torch.Tensor]]:
    """Every process's saved sum, in rank order."""
    init = tmp_path / f"init-{mode}-{world}"
    mp.start_processes(
        worker,
        args=(world, str(init), str(tmp_path), SHARDS, mode),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return [torch.load(tmp_path / f"{mode}-{world}-{r}.pt") for r in range(world)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_every_process_of_every_count_holds_the_same_sum(tmp_path: Path) -> None:
    sums = {world: _run(tmp_path, world, "tree") for world in (1, 2, 4)}
    reference = sums[1][0]
    for world, by_rank in sums.items():
        assert all(_same(reference, mine) for mine in by_rank), world
    control = {world: _run(tmp_path, world, "allreduce")[0] for world in (1, 4)}
    assert not _same(control[1], control[4])  # all-reduce adds in another order at 4
