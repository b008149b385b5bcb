"""``StepLoader``'s shards (issue 62, case 4): a batch's augmentation keyed once a shard of
the global batch instead of once a row, the same for any rank count, worker count or
resume; files from before shards refused by name, and read as they were with
``shards=batch_size``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

import lit_spikes.loader as loader_module
from lit_spikes import StepLoader
from lit_spikes.loader import default_shards
from lit_spikes.randomness import ROW, derive, kept_rng_states, seed_all
from tests.modules.drawing_runs import NoisyRows, Watch, differences, fit_drawing


@pytest.mark.parametrize(
    ("batch", "shards"), [(8, 1), (48, 1), (63, 1), (64, 2), (96, 2), (128, 4), (256, 8),
                          (1000, 8), (4096, 128)],
)  # fmt: skip
def test_default_shards_are_the_most_powers_of_two_of_32_rows_or_more(
    batch: int, shards: int
) -> None:
    assert default_shards(batch) == shards
    assert StepLoader(NoisyRows(max(batch, 48)), batch).shards == shards


def test_a_batch_seeds_once_a_shard_and_reads_its_rows_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cost: one seed a shard, not a row; the keys are (seed, position, shard)."""
    seeds: list[int] = []
    monkeypatch.setattr(loader_module, "seed_all", seeds.append)
    data = StepLoader(NoisyRows(256), 64, seed=5)
    data.batch_of_step(3)
    position = data.position_of_step(3)
    assert seeds == [derive(5, ROW, position, shard) for shard in range(2)]
    seeds.clear()
    StepLoader(NoisyRows(256), 64, seed=5, shards=64).batch_of_step(3)
    assert len(seeds) == 64


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_rank_draws_its_rows_as_one_process_does(shards: int, world_size: int) -> None:
    """A rank whose rows start inside a shard reads the shard's rows before its own: its
    augmentation is the one process's, whatever the shards and the rank count."""
    data = StepLoader(NoisyRows(), batch_size=8, seed=5, shards=shards)
    whole = data.batch_of_step(7)
    parts = [data.batch_of_step(7, rank, world_size) for rank in range(world_size)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole[0])
    assert torch.equal(torch.cat([y for _, y in parts]), whole[1])


def test_workers_of_a_rank_draw_as_one_process_does() -> None:
    """The same through the inner DataLoader's workers: 4 ranks of a batch of 8 rows in 2
    shards, two ranks to a shard."""
    data = StepLoader(NoisyRows(), batch_size=8, seed=5, shards=2)
    whole = [data.batch_of_step(step)[0] for step in (7, 8)]
    for rank in range(4):
        workers = StepLoader(NoisyRows(), batch_size=8, seed=5, shards=2, num_workers=2)
        batches = workers.iter_from(7, rank, 4)
        for step in range(2):
            assert torch.equal(next(batches)[0], whole[step][2 * rank : 2 * rank + 2])


def test_shards_of_one_row_read_as_files_from_before_shards() -> None:
    """``shards=batch_size`` keys each row by (seed, position, slot): the old design's
    keys, so a run from an old file goes on as it drew."""
    data = StepLoader(NoisyRows(), batch_size=8, seed=5, shards=8)
    rows, position = data.rows_of_step(7), data.position_of_step(7)
    with kept_rng_states():
        old = []
        for slot, index in enumerate(rows):
            seed_all(derive(5, ROW, position, slot))
            old.append(NoisyRows()[index])
    batch = data.batch_of_step(7)
    expected = default_collate(old)
    assert torch.equal(batch[0], expected[0]) and torch.equal(batch[1], expected[1])
    assert not torch.equal(StepLoader(NoisyRows(), 8, seed=5).batch_of_step(7)[0], batch[0])


def test_a_file_from_before_shards_is_refused_unless_its_rows_are_keyed_alike() -> None:
    old = StepLoader(NoisyRows(), 8, seed=5).state_dict() | {"step": 5}
    del old["shards"]
    refusing = StepLoader(NoisyRows(), 8, seed=5)
    with pytest.raises(ValueError, match=r"shards: checkpoint 8 \(a file from before shards"):
        refusing.load_state_dict(old)
    assert refusing.next_step == 0
    reading = StepLoader(NoisyRows(), 8, seed=5, shards=8)
    reading.load_state_dict(old)
    assert reading.next_step == 5


def test_a_file_of_other_shards_is_refused_by_name() -> None:
    saved = StepLoader(NoisyRows(), 8, seed=5, shards=2).state_dict() | {"step": 5}
    with pytest.raises(ValueError, match=r"orders its data otherwise.*shards: checkpoint 2, now 1"):
        StepLoader(NoisyRows(), 8, seed=5).load_state_dict(saved)


def test_ranks_that_split_a_shard_are_told_the_cost_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loader_module, "world", lambda: (0, 4))
    data = StepLoader(NoisyRows(), 8, seed=5, shards=2)
    with pytest.warns(UserWarning, match=r"up to 4 rows a step for its 2.*StepLoader\(shards=4\)"):
        next(iter(data))
    fitting = StepLoader(NoisyRows(), 8, seed=5, shards=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(fitting))


@pytest.mark.parametrize(
    ("shards", "message"),
    [
        (3, r"shards=3 must divide batch_size=8 \(equal shards of the global batch\), e.g. "
            r"shards=2"),
        (0, "shards=0 must be an integer >= 1"),
        (True, "shards=True must be an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_shards_are_refused_by_name(shards: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepLoader(NoisyRows(), 8, shards=shards)


def test_a_resume_with_shards_and_workers_is_the_run(tmp_path: Path) -> None:
    """Through the Trainer: rows augmented in 2 workers, 4 shards of 2 rows, a file every
    4 steps; the run resumed from step 4 equals the uninterrupted one."""
    watch = Watch(every=4, workers=2, shards=4)
    whole = fit_drawing(tmp_path / "whole", watch)
    resumed = fit_drawing(tmp_path / "resumed", watch, ckpt=tmp_path / "whole/every/step=4.ckpt")
    assert differences(whole, resumed) == []
    other = fit_drawing(tmp_path / "other", Watch(every=4, workers=2))
    assert differences(whole, other) != []  # (the shards key the rows' draws at all)


def test_a_file_from_before_shards_resumes_only_with_its_keys(tmp_path: Path) -> None:
    """Through the Trainer: a file whose loader state has no shards (as before them) is
    refused by name with the default shards, and resumes the run with ``shards=8`` (one
    row a shard, the keys its run drew with)."""
    watch = Watch(every=4, shards=8)
    whole = fit_drawing(tmp_path / "whole", watch)
    path = tmp_path / "whole/every/step=4.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    for state in checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]:
        del state["shards"]
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=r"shards: checkpoint 8 \(a file from before shards"):
        fit_drawing(tmp_path / "refused", Watch(every=4), ckpt=path)
    resumed = fit_drawing(tmp_path / "resumed", watch, ckpt=path)
    assert differences(whole, resumed) == []
