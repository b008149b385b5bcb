"""Step-indexed loading for any map-style dataset: the batch of global step ``k`` is a pure
function of (seed, the data position of ``k``), so a resumed run needs no sampler state.

The path is ``step -> data position -> rows``. Steps count optimizer updates; positions
count batches of data. They are equal until a position is skipped (PaLM's remedy): then
the pointer jumps past it while the step, and with it the LR schedule, goes on. Position
``p`` lies in data epoch ``p // batches_per_epoch``, whose order is a permutation seeded
by (seed, epoch); under several processes each rank takes its rows of the same global
batch. Augmentation draws are keyed by (seed, data position, shard of the global batch).
"""

from __future__ import annotations

import bisect
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from lit_spikes.randomness import GOLDEN, MASK64, ROW, derive_in, kept_rng_states, mix64, seed_all


def mix_seed(seed: int, index: int) -> int:
    """A 32-bit generator seed from (seed, index), well spread (splitmix64 finaliser).

    torch's CPU generator keeps only the low 32 bits of a seed, so ``seed * 2**32 +
    index`` would make every seed give the same stream.
    """
    return mix64((seed * GOLDEN + index) & MASK64) & 0xFFFFFFFF


def normalize_skip(skip: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated data positions, each checked to be a non-negative integer."""
    values = []
    for value in skip:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"skip position {value!r} must be a non-negative integer")
        values.append(value)
    return tuple(sorted(set(values)))


def position_of_step(step: int, skip: tuple[int, ...]) -> int:
    """The data position that global step ``step`` trains on: the ``step``-th (0-based)
    position that is not in the sorted tuple ``skip``."""
    position = step
    for skipped in skip:  # sorted: each skipped position at or below the pointer pushes it on
        if skipped <= position:
            position += 1
        else:
            break
    return position


def check_new_skips(saved: tuple[int, ...], added: Iterable[int], step: int) -> None:
    """Raises ``ValueError`` for skip positions added at a resume from ``step`` that lie
    before the position it resumes at: they were trained on already, and the restored
    steps would map to other data than they were trained on."""
    passed = position_of_step(step, saved)
    new = sorted(set(added) - set(saved))
    early = new[: bisect.bisect_left(new, passed)]
    if early:
        raise ValueError(
            f"skip positions {early} lie before data position {passed}, where the "
            f"checkpoint resumes: they were already trained on; skip positions >= {passed}"
        )


@runtime_checkable
class PositionedData(Protocol):
    """Data whose batches are found by global step through a skip set: what
    ``BatchSkipper``, ``RollbackRestore`` and the tools need of a loader or DataModule
    (``StepLoader`` and the demo's ``StepDataModule`` both are)."""

    skip: tuple[int, ...]

    def add_skip(self, positions: Iterable[int]) -> None: ...

    def position_of_step(self, step: int) -> int: ...


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process in the default process group, or (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_shard(batch_size: int, rank: int, world_size: int, name: str = "batch_size") -> None:
    """Raises ``ValueError`` unless rank ``rank`` of ``world_size`` processes can take an
    equal, whole share of a global batch of ``batch_size`` rows."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if batch_size % world_size:
        fits = [w for w in range(world_size - 1, 0, -1) if batch_size % w == 0]
        raise ValueError(
            f"{name}={batch_size} is the global batch (rows per step, summed over all "
            f"processes) and must divide by world_size={world_size} (num_nodes x devices): "
            f"train on {fits[0]} processes (the same global batch), or change it to a "
            f"multiple of {world_size}, e.g. "
            f"{max(world_size, batch_size - batch_size % world_size)} (another data stream)"
        )


MIN_SHARD_ROWS = 32
"""A default shard has at least this many rows: its seeds (~11 us) then cost a few percent
of its rows' reads (~6 us a row of a small tensor dataset, collated)."""


def default_shards(batch_size: int) -> int:
    """The most shards, a power of two, that cut a global batch of ``batch_size`` rows into
    equal shards of at least ``MIN_SHARD_ROWS`` rows (1 for a batch under twice that)."""
    shards = 1
    while batch_size % (2 * shards) == 0 and batch_size // (2 * shards) >= MIN_SHARD_ROWS:
        shards *= 2
    return shards


def check_shards(shards: int, batch_size: int) -> int:
    """``shards``, checked to cut a global batch of ``batch_size`` rows into equal shards;
    else a ValueError naming it and a count that does."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards={shards!r} must be an integer >= 1")
    if batch_size % shards:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        near = min(divisors, key=lambda d: (abs(d - shards), d))
        raise ValueError(
            f"shards={shards} must divide batch_size={batch_size} (equal shards of the "
            f"global batch), e.g. shards={near}"
        )
    return shards


ShardRead = tuple[int, int, list[int], int]
"""(data position, shard of the global batch, dataset indices from the shard's first row
to the reader's last, how many of them lead up to the reader's own rows)."""


class _KeyedShards(Dataset[Any]):
    """``dataset``'s rows, read shard by shard with the process's RNGs set once a shard
    from (seed, data position, shard) and the shard's rows read in order: augmentation in
    ``__getitem__`` draws the same whichever rank, worker or resume reads the shard."""

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __getitem__(self, read: ShardRead) -> list[Any]:
        position, shard, rows, lead = read
        seed_all(derive_in(self.seed, ROW, position, shard))
        dataset = self.dataset
        return [dataset[index] for index in rows][lead:]

    def __getitems__(self, reads: list[ShardRead]) -> list[Any]:
        """A batch's rows (torch's fetcher calls it with what ``_StepSampler`` yields)."""
        return [row for read in reads for row in self[read]]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


class _StepSampler(Sampler[list[ShardRead]]):
    """The reads of this rank's rows, step after step from ``start``."""

    def __init__(self, loader: StepLoader, start: int, rank: int, world_size: int) -> None:
        self.loader, self.start, self.rank, self.world_size = loader, start, rank, world_size

    def __iter__(self) -> Iterator[list[ShardRead]]:
        step = self.start
        while True:
            yield self.loader.reads_of_step(step, self.rank, self.world_size)
            step += 1


class StepLoader:
    """Batches of any map-style dataset, indexed by global step, for ``Trainer.fit``.

    The batch of global step ``k`` is ``collate_fn([dataset[i] for i in rows])`` where
    ``rows`` is this rank's share of position ``position_of_step(k, skip)`` in data epoch
    ``position // batches_per_epoch``, whose order is a permutation seeded by (``seed``,
    epoch) (``shuffle=False``: the dataset's order). The last ``len(dataset) %
    batch_size`` rows of each epoch's order are left out, as ``drop_last=True`` does.

    It starts at the global step Lightning restores: it saves ``{"step", "skip", ...}``
    through Lightning's loader-state protocol (``state_dict``/``load_state_dict``), and
    ``ExactResume`` seeks it to ``trainer.global_step`` at every fit's start. It has a
    length (one data epoch), so Lightning fetches no batch ahead and its count of batches
    given is the step count. ``num_workers`` and ``pin_memory`` go to an inner
    ``DataLoader``, which draws no seed from the global torch RNG (dropout's).

    Under several processes ``batch_size`` is the global batch and each rank takes rows
    ``[r * b, (r + 1) * b)`` of it (``b = batch_size // world_size``), so the data of a
    step does not depend on the world size.

    The global batch is cut into ``shards`` equal shards of consecutive rows; each is read
    in order with torch's, Python's and NumPy's RNGs set once from (``seed``, data
    position, shard), so random augmentation in ``__getitem__`` is part of the pure
    function too, whatever the worker count, the rank or a resume; read in this process,
    the RNGs are put back afterwards (``restores_rng``). A rank whose rows start inside a
    shard reads the shard's rows before its own too (and warns once where that is more
    than its share). Rows are read one by one: a dataset's ``__getitems__`` is not called.

    Args:
        dataset: any map-style dataset (``__getitem__`` and ``__len__``); its item must be a
            function of the index and of the global RNGs' draws for the batches to be
            reproducible.
        batch_size: rows per step, summed over all processes.
        seed: with the epoch, the only input of the order.
        shuffle: permute each data epoch (False: the dataset's order every epoch).
        collate_fn: as ``DataLoader`` takes it (default: ``default_collate``).
        num_workers: worker processes of the inner ``DataLoader``.
        pin_memory: as ``DataLoader`` takes it.
        skip: data positions never trained on (``BatchSkipper`` adds to them).
        shards: how many shards the global batch's augmentation is keyed by (default:
            ``default_shards(batch_size)``, shards of at least 32 rows); it must divide
            ``batch_size``, and a multiple of the process count lets every rank read only
            its own rows. One seed a shard: ``shards=batch_size`` keys every row, as files
            from before shards were.

    Raises:
        ValueError: a dataset that is not map-style or has fewer rows than ``batch_size``,
            a ``batch_size``, ``seed``, ``num_workers`` or ``shards`` out of range, a
            ``shuffle`` that is not a bool, a bad skip position.

    Example:
        >>> loader = StepLoader(TensorDataset(x, y), batch_size=32, seed=0)
        >>> trainer = Trainer(max_steps=1000, callbacks=[ExactResume()])
        >>> trainer.fit(model, train_dataloaders=loader, ckpt_path="last")
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        skip: Iterable[int] = (),
        shards: int | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed={seed!r} must be an integer in [0, 2**63)")
        if isinstance(dataset, IterableDataset):
            # It inherits Dataset's __getitem__ (which raises) and may define __len__: the
            # check below would pass it, and the fit would fail at its first batch.
            raise ValueError(
                f"dataset={type(dataset).__name__} is an IterableDataset: StepLoader reads "
                "row k of a step, which a stream has no way back to. Give a map-style "
                "Dataset (__getitem__(index) and __len__), e.g. its rows materialized in a "
                "TensorDataset or a list, or feed the stream to a torchdata "
                "StatefulDataLoader instead"
            )
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ValueError(
                f"dataset={type(dataset).__name__}: StepLoader needs a map-style dataset "
                "(__getitem__ and __len__) to find the rows of a step; an IterableDataset has "
                "no row k to go back to"
            )
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle={shuffle!r} must be True or False")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0")
        shards = check_shards(default_shards(batch_size) if shards is None else shards, batch_size)
        rows = len(dataset)
        if rows < batch_size:
            raise ValueError(
                f"the dataset has {rows} rows, fewer than batch_size={batch_size}: no step "
                "has a whole batch"
            )
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.collate_fn, self.num_workers, self.pin_memory = collate_fn, num_workers, pin_memory
        self.skip, self.shards = normalize_skip(skip), shards
        self.batches_per_epoch = rows // batch_size
        self.next_step = 0
        """The global step whose batch comes next."""
        self._orders: dict[int, np.ndarray[Any, Any]] = {}
        self._keyed = _KeyedShards(dataset, seed)
        self._warned_reads = False
        self.restores_rng = True
        """Put this process's RNGs back after reading a batch here (``num_workers=0``), so
        that the rows' keyed draws do not reach the training's. ``ExactResume`` turns it
        off for the loaders of its fit: it sets every RNG at each step's start anyway, and
        NumPy's state alone costs ~80 us to save and put back."""

    def __len__(self) -> int:
        return self.batches_per_epoch

    def position_of_step(self, step: int) -> int:
        """The data position global step ``step`` trains on under the current skip set."""
        return position_of_step(step, self.skip)

    def add_skip(self, positions: Iterable[int]) -> None:
        """Skip more data positions from the next batch on (``BatchSkipper``).

        Raises:
            ValueError: a position before the one the next batch comes from (trained on
                already).
        """
        check_new_skips(self.skip, normalize_skip(positions), self.next_step)
        self.skip = normalize_skip((*self.skip, *positions))

    def seek(self, step: int) -> None:
        """Give the batch of global step ``step`` next (``ExactResume`` calls it at fit
        start with ``trainer.global_step``)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an integer >= 0")
        self.next_step = step

    def order(self, epoch: int) -> np.ndarray[Any, Any]:
        """The dataset indices of data epoch ``epoch`` in training order (shuffled only)."""
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            full = torch.randperm(len(self.dataset), generator=generator)
            # As NumPy: a step's rows are then Python ints without a tensor read each step.
            self._orders = {epoch: full.numpy()}  # one epoch kept: steps walk forward
        return self._orders[epoch]

    def rows_of_step(self, step: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """Dataset indices of rank ``rank``'s rows of the global batch of ``step``."""
        check_shard(self.batch_size, rank, world_size)
        share = self.batch_size // world_size
        return self._rows(self.position_of_step(step), rank * share, (rank + 1) * share)

    def _rows(self, position: int, first: int, stop: int) -> list[int]:
        """Dataset indices of slots ``[first, stop)`` of the global batch at ``position``."""
        epoch, index = divmod(position, self.batches_per_epoch)
        start = index * self.batch_size
        if not self.shuffle:  # no order to build: a dataset may be far larger than memory
            return list(range(start + first, start + stop))
        rows: list[int] = self.order(epoch)[start + first : start + stop].tolist()
        return rows

    def reads_of_step(self, step: int, rank: int = 0, world_size: int = 1) -> list[ShardRead]:
        """What rank ``rank`` reads for its rows of ``step``: each shard its rows lie in,
        from the shard's first row (whose draws lead up to its own) to its last row."""
        check_shard(self.batch_size, rank, world_size)
        share, size = self.batch_size // world_size, self.batch_size // self.shards
        first, stop = rank * share, (rank + 1) * share
        begin = first - first % size  # the first shard's first slot
        position = self.position_of_step(step)
        rows = self._rows(position, begin, stop)
        return [
            (
                position,
                start // size,
                rows[start - begin : min(start + size, stop) - begin],
                max(first - start, 0),
            )
            for start in range(begin, stop, size)
        ]

    def batch_of_step(self, step: int, rank: int = 0, world_size: int = 1) -> Any:
        """Rank ``rank``'s batch of global step ``step``, collated, in this process (whose
        RNGs it leaves as they were)."""
        collate = self.collate_fn or torch.utils.data.default_collate
        reads = self.reads_of_step(step, rank, world_size)
        if not self.restores_rng:
            return collate(self._keyed.__getitems__(reads))
        with kept_rng_states():
            return collate(self._keyed.__getitems__(reads))

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing is read before the first batch is asked for, after Lightning
        # restored the step and ExactResume sought it.
        rank, world_size = world()
        check_shard(self.batch_size, rank, world_size)
        self._warn_of_reads(rank, world_size)
        while True:
            skip = self.skip
            for batch in self.iter_from(self.next_step, rank, world_size):
                self.next_step += 1
                yield batch
                if self.skip != skip:
                    break  # workers drew rows ahead under the old skip set: start anew

    def _warn_of_reads(self, rank: int, world_size: int) -> None:
        """Once, on rank 0: where a rank reads rows before its own to key its shard."""
        if rank != 0 or self._warned_reads or self.shards % world_size == 0:
            return
        self._warned_reads = True
        share, size = self.batch_size // world_size, self.batch_size // self.shards
        most = share + max(rank * share % size for rank in range(world_size))
        fits = world_size * self.shards // math.gcd(world_size, self.shards)
        warnings.warn(
            f"StepLoader(shards={self.shards}) cuts the global batch of {self.batch_size} "
            f"rows into shards that {world_size} processes cannot share: a process reads up "
            f"to {most} rows a step for its {share}, the rows of its shard before its own, "
            f"so that augmentation draws as one process would. StepLoader(shards={fits}) "
            "reads only each process's own rows, but keys the augmentation otherwise: set it "
            "at a run's start",
            stacklevel=2,
        )

    def iter_from(self, step: int, rank: int = 0, world_size: int = 1) -> Iterator[Any]:
        """Rank ``rank``'s batches of steps ``step, step + 1, ...``, endless, outside of any
        Trainer (plain loops, tests); ``next_step`` is left as it is.

        Raises:
            ValueError: a rank or world size that cannot share the global batch (at once).
        """
        check_shard(self.batch_size, rank, world_size)
        if self.num_workers == 0:
            return (self.batch_of_step(s, rank, world_size) for s in itertools.count(step))
        loader = DataLoader(
            self._keyed,
            batch_sampler=_StepSampler(self, step, rank, world_size),
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(self.seed),  # not the global RNG
        )
        return iter(loader)

    def state_dict(self) -> dict[str, Any]:
        """Lightning saves it in the checkpoint's loop state (a resume restores it)."""
        return {
            "step": self.next_step,
            "skip": list(self.skip),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "rows": len(self.dataset),
            "shuffle": self.shuffle,
            "shards": self.shards,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Go on where the checkpoint's run was; another order is refused by name."""
        here, saved_shards = self.state_dict(), _saved_shards(state_dict)
        differ = [
            f"{key}: checkpoint {state_dict[key]!r}, now {here[key]!r}"
            for key in ("seed", "batch_size", "rows", "shuffle")
            if key in state_dict and state_dict[key] != here[key]
        ]
        if saved_shards is not None and saved_shards != self.shards:
            older = (
                "" if "shards" in state_dict else " (a file from before shards: every row keyed)"
            )
            differ.append(f"shards: checkpoint {saved_shards}{older}, now {self.shards}")
        if differ:
            raise ValueError(
                "this StepLoader orders its data otherwise than the one the checkpoint was "
                f"trained with ({'; '.join(differ)}): the resumed steps would train on other "
                "batches. Build it with the checkpoint's settings"
            )
        saved, step = normalize_skip(state_dict["skip"]), int(state_dict["step"])
        check_new_skips(saved, self.skip, step)
        self.skip = normalize_skip((*saved, *self.skip))
        self.next_step = step


def _saved_shards(state_dict: dict[str, Any]) -> int | None:
    """The shards a file's loader keyed its reads by: files from before shards keyed every
    row (``shards=batch_size``)."""
    if "shards" in state_dict:
        return int(state_dict["shards"])
    return int(state_dict["batch_size"]) if "batch_size" in state_dict else None


def positioned(trainer: Any) -> PositionedData | None:
    """The Trainer's step-indexed data: its DataModule if that is one, else its train
    loader (``trainer.train_dataloader``, set once the fit loop built it) if that is one."""
    datamodule = getattr(trainer, "datamodule", None)
    if isinstance(datamodule, PositionedData):
        return datamodule
    loaders: Any = getattr(trainer, "train_dataloader", None)
    for loader in loaders if isinstance(loaders, Sequence) else [loaders]:
        if isinstance(loader, PositionedData):
            return loader
    return None
