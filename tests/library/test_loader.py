"""``StepLoader``: the batch of every global step from its seed alone, on plain Lightning
Trainers and modules written for the tests; a resume at the saved step, skip sets, ranks,
workers, and the refusals."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lit_spikes.loader as loader_module
from lit_spikes import StepLoader
from lit_spikes.callbacks import BatchSkipper, ExactResume, RollbackRestore
from tests.modules.drawing_runs import NoisyRows
from tests.modules.guarantee_modules import (
    AdamWRegressor,
    MomentumRegressor,
    step_loader,
)
from tests.modules.guarantee_runs import (
    GUARANTEE_STEPS,
    guarantee_differences,
    same_inputs,
    train_guarded,
)
from tests.modules.plain_runs import (
    BATCH,
    RESUME_AT,
    STEPS,
    loader,
    resume_pair,
    states_equal,
    train,
    trainer,
)
from tests.modules.user_modules import (
    DropoutRegressor,
    LoggingRegressor,
    regression_data,
)

# Lightning's warnings about what a test below does on purpose (each run of a pair writes
# into its own folder: the dirpath change is filtered in pyproject.toml).
NOT_RESUMABLE = (
    "ignore:You're resuming from a checkpoint that ended before the epoch ended:UserWarning"
)


NO_EXACT_RESUME = "ignore:Be aware that when using `ckpt_path`.*'ExactResume\\{}':UserWarning"


def test_gradient_accumulation_with_a_step_loader_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\) with a StepLoader"):
        train(tmp_path, LoggingRegressor(), loader(), 4, [ExactResume()], accumulate_grad_batches=2)


@pytest.mark.filterwarnings(NOT_RESUMABLE)  # the plain loader is the control
def test_a_plain_shuffled_loader_resumes_on_other_batches(tmp_path: Path) -> None:
    """The data control: Lightning restarts a plain DataLoader at its first batch."""

    def plain() -> DataLoader[Any]:
        return DataLoader(regression_data(), BATCH, shuffle=True, drop_last=True)

    with pytest.warns(UserWarning, match="ExactResume: the train loader .* cannot be positioned"):
        whole, resumed = resume_pair(tmp_path, LoggingRegressor, plain)
    assert whole.lightning_module.losses[RESUME_AT:] != resumed.lightning_module.losses


def test_a_datamodule_returning_a_step_loader_resumes_exactly(tmp_path: Path) -> None:
    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> StepLoader:
            return loader()

    runs = []
    for name, steps, ckpt in (("a", STEPS, None), ("b", RESUME_AT, None), ("c", STEPS, "b")):
        run = trainer(tmp_path / name, steps, [ExactResume()])
        path = tmp_path / ckpt / f"step={RESUME_AT}.ckpt" if ckpt else None
        run.fit(DropoutRegressor(), datamodule=Data(), ckpt_path=path)
        runs.append(run)
    assert states_equal(runs[0], runs[2]) == []


def test_workers_give_the_batches_of_the_main_process(tmp_path: Path) -> None:
    in_main = train(tmp_path / "0", LoggingRegressor(), loader(), 14, [ExactResume()])
    workers = train(tmp_path / "2", LoggingRegressor(), loader(num_workers=2), 14, [ExactResume()])
    assert states_equal(in_main, workers) == []
    assert in_main.lightning_module.losses == workers.lightning_module.losses


def test_a_skip_set_changes_exactly_the_batches_it_names() -> None:
    plain = list(itertools.islice(loader().iter_from(0), 20))
    skipping = list(itertools.islice(loader(skip=[3, 4, 15]).iter_from(0), 17))
    positions = [p for p in range(20) if p not in (3, 4, 15)]
    for batch, position in zip(skipping, positions, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(batch, plain[position], strict=True))


def test_the_order_is_a_permutation_per_epoch_seeded_by_the_seed() -> None:
    data = loader()
    rows = [row for step in range(data.batches_per_epoch) for row in data.rows_of_step(step)]
    assert sorted(rows) == list(range(len(rows)))  # one epoch: each row once
    nxt = [r for s in range(12, 24) for r in data.rows_of_step(s)]
    assert nxt != rows and sorted(nxt) == sorted(rows)  # the next epoch: another order
    assert StepLoader(regression_data(), BATCH, seed=8).rows_of_step(0) != data.rows_of_step(0)


def test_each_rank_takes_its_rows_of_the_global_batch() -> None:
    data = loader()
    halves = [data.rows_of_step(5, rank, 2) for rank in (0, 1)]
    assert halves[0] + halves[1] == data.rows_of_step(5)
    with pytest.raises(ValueError, match="must divide by world_size=3"):
        data.rows_of_step(5, 0, 3)


def test_augmentation_is_keyed_by_position_and_shard_whoever_reads_it() -> None:
    """Issue 53: a row's draws in ``__getitem__`` (torch, NumPy, random) come from (seed,
    data position, shard of the global batch): the same under 2 ranks as under 1, in
    workers as in this process, at any reseeding of the global RNGs; this process's RNGs
    are left as they were; another seed or step draws otherwise."""
    data = StepLoader(NoisyRows(), batch_size=8, seed=5)
    torch.manual_seed(0)
    whole = data.batch_of_step(7)
    after = torch.rand(2)
    torch.manual_seed(0)
    halves = [data.batch_of_step(7, rank, 2) for rank in (0, 1)]
    assert torch.equal(torch.rand(2), after)  # the reads drew nothing from the global RNG
    assert torch.equal(torch.cat([halves[0][0], halves[1][0]]), whole[0])
    torch.manual_seed(123)
    assert torch.equal(data.batch_of_step(7)[0], whole[0])
    in_workers = StepLoader(NoisyRows(), batch_size=8, seed=5, num_workers=2)
    assert torch.equal(next(in_workers.iter_from(7))[0], whole[0])
    assert not torch.equal(data.batch_of_step(1)[0], data.batch_of_step(7)[0])
    rows = data.rows_of_step(7)
    plain = torch.stack([NoisyRows().x[i] for i in rows])
    assert not torch.allclose(whole[0], plain)  # (the rows are augmented at all)


def test_without_keyed_reads_a_row_augments_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: with the loader's per-row seeds off, a row's augmentation
    draws from whatever state the reading process holds."""
    monkeypatch.setattr(loader_module, "seed_all", lambda seed: None)
    data = StepLoader(NoisyRows(), batch_size=8, seed=5)
    torch.manual_seed(0)
    first = data.batch_of_step(7)[0]
    torch.manual_seed(1)
    assert not torch.equal(data.batch_of_step(7)[0], first)


@pytest.mark.filterwarnings(NO_EXACT_RESUME)  # the StepLoader refuses, without ExactResume
@pytest.mark.parametrize(
    ("other", "named"),
    [
        (lambda: StepLoader(regression_data(), BATCH, seed=8), "seed: checkpoint 7, now 8"),
        (lambda: StepLoader(regression_data(), BATCH // 2, seed=7), "batch_size: checkpoint 8"),
    ],
)
def test_another_order_at_a_resume_is_refused_by_name(
    tmp_path: Path, other: Callable[[], StepLoader], named: str
) -> None:
    """Through the Trainer: a user's module resumed with another data order."""
    train(tmp_path / "a", LoggingRegressor(), loader(), 5, [ExactResume()])
    with pytest.raises(ValueError, match=named):
        train(tmp_path / "b", LoggingRegressor(), other(), 10, [], tmp_path / "a" / "step=5.ckpt")


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (lambda: StepLoader(regression_data(), BATCH * 2, seed=7), "batch_size: checkpoint 8"),
        (lambda: StepLoader(regression_data(rows=48), BATCH, seed=7), "rows: checkpoint"),
        (lambda: StepLoader(regression_data(), BATCH, seed=7, shuffle=False), "shuffle:"),
    ],
)
def test_a_loader_of_another_size_length_or_shuffle_is_refused_at_a_resume(
    other: Callable[[], StepLoader], named: str
) -> None:
    """Issue 44's gap: only another seed was tested. Each is another order of the data:
    the resumed steps would train on other batches. Refused by name, the state unchanged."""
    saved = loader().state_dict() | {"step": 5}
    refusing = other()
    with pytest.raises(ValueError, match=f"orders its data otherwise.*{named}"):
        refusing.load_state_dict(saved)
    assert refusing.next_step == 0


def test_each_seed_gives_its_own_order_in_every_epoch() -> None:
    """The order depends on the seed in every epoch, not only in the first (issue 44)."""
    orders = {seed: StepLoader(regression_data(), BATCH, seed=seed) for seed in (7, 8)}
    for epoch in range(3):
        first, second = (orders[s].order(epoch).tolist() for s in (7, 8))
        assert first != second and sorted(first) == sorted(second), epoch
    assert (
        orders[7].order(1).tolist()
        == StepLoader(regression_data(), BATCH, seed=7).order(1).tolist()
    )


@pytest.mark.filterwarnings(NO_EXACT_RESUME)  # the rollback refuses, without ExactResume
@pytest.mark.parametrize("remedy", ["rollback", "skip"])
def test_remedies_refuse_a_loader_that_cannot_be_positioned(tmp_path: Path, remedy: str) -> None:
    """A plain DataLoader restarts at its first batch: a rollback or skip on it would train
    the wrong batches and look like it worked."""
    plain = DataLoader(regression_data(), BATCH)
    train(tmp_path / "a", LoggingRegressor(), plain, 6, [ExactResume()])
    if remedy == "rollback":
        rollback = RollbackRestore(tmp_path / "a", spike_step=5, distance=2)
        run = trainer(tmp_path / "b", 10, [rollback])
        with pytest.raises(TypeError, match="StepLoader"):
            rollback.fit(run, LoggingRegressor(), train_dataloaders=plain)
    else:
        with pytest.raises(TypeError, match="StepLoader"):
            train(tmp_path / "b", LoggingRegressor(), plain, 10, [BatchSkipper(positions=[8])])


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(10))


class _SizedStream(_Stream):
    """A stream that says its length: Dataset's __getitem__ (which raises) and __len__."""

    def __len__(self) -> int:
        return 10


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StepLoader(regression_data(), 0), r"batch_size=0 must be an integer >= 1"),
        (lambda: StepLoader(regression_data(rows=4), 8), r"has 4 rows, fewer than batch_size=8"),
        (lambda: StepLoader(regression_data(), 8, num_workers=-1), r"num_workers=-1"),
        (lambda: StepLoader(regression_data(), 8, shuffle="no"), r"shuffle='no' must be True"),
        (lambda: StepLoader(regression_data(), 8, skip=[-2]), r"skip position -2"),
        (lambda: StepLoader(_Stream(), 8), r"dataset=_Stream is an IterableDataset"),
        (
            lambda: StepLoader(_SizedStream(), 8),
            r"dataset=_SizedStream is an IterableDataset.*"
            r"map-style",
        ),
        (lambda: StepLoader([1.0] * 10, 8, seed=-1), r"seed=-1"),
        (lambda: StepLoader(object(), 8), r"dataset=object: StepLoader needs a map-style"),
    ],
)
def test_bad_loader_arguments_are_refused_by_name(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.filterwarnings(NO_EXACT_RESUME)
def test_a_step_loader_resumes_at_the_saved_step_without_exact_resume(tmp_path: Path) -> None:
    """Lightning restores the loader's state through the fit loop: no ExactResume needed
    for the data of a module that draws nothing."""
    whole = train_guarded(tmp_path / "a", MomentumRegressor(), GUARANTEE_STEPS)
    train_guarded(tmp_path / "b", MomentumRegressor(), 5)
    resumed = train_guarded(
        tmp_path / "c", MomentumRegressor(), GUARANTEE_STEPS, ckpt=tmp_path / "b" / "step=5.ckpt"
    )
    loader = step_loader()
    for step in range(5, GUARANTEE_STEPS):
        assert torch.equal(resumed.lightning_module.inputs[step], loader.batch_of_step(step)[0])
    assert guarantee_differences(whole, resumed) == []


class _Reloaded(pl.LightningDataModule):
    """A new StepLoader at each epoch (``reload_dataloaders_every_n_epochs=1``)."""

    def train_dataloader(self) -> Any:
        return step_loader()


def test_a_loader_built_anew_each_epoch_goes_on_at_the_global_step(tmp_path: Path) -> None:
    """A loader built at an epoch's start starts at its first batch: ExactResume seeks it
    to the global step, in the uninterrupted run and after a resume."""
    reload = {"reload_dataloaders_every_n_epochs": 1}
    whole = train_guarded(
        tmp_path / "a", AdamWRegressor(), 30, [ExactResume()], loader=_Reloaded(), **reload
    )
    loader = step_loader()
    for step in (0, 12, 25, 29):  # three data epochs
        assert torch.equal(whole.lightning_module.inputs[step], loader.batch_of_step(step)[0])
    train_guarded(
        tmp_path / "b", AdamWRegressor(), 14, [ExactResume()], loader=_Reloaded(), **reload
    )
    resumed = train_guarded(
        tmp_path / "c", AdamWRegressor(), 30, [ExactResume()], tmp_path / "b" / "step=14.ckpt",
        loader=_Reloaded(), **reload,
    )  # fmt: skip
    assert same_inputs(whole.lightning_module, resumed.lightning_module, range(14, 30))
    assert guarantee_differences(whole, resumed) == []
