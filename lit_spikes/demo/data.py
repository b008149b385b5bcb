"""The demo's data: random windows of the built-in world's text, served by ``StepLoader``.

The batch of global step ``k`` is a pure function of (data seed, the data position of
``k``): the rows at position ``p`` are windows drawn by a generator seeded from (data
seed, ``p``) alone (``batch_at``). ``StepLoader`` maps steps to positions through the
skip set (PaLM's remedy) and resumes at the restored step, as it does for any dataset.
"""

from __future__ import annotations

__all__ = ["check_shard", "mix_seed", "normalize_skip", "position_of_step"]

import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lit_spikes.callbacks.batch_skipper import BatchSkipper
from lit_spikes.checkpoints import load_checkpoint
from lit_spikes.demo.world import ALPHABET, CharTokenizer, WorldConfig, build_world
from lit_spikes.loader import (
    StepLoader,
    check_new_skips,
    mix_seed,
    normalize_skip,
    position_of_step,
)
from lit_spikes.loader import check_shard as _check_shard
from lit_spikes.shared.plain import flat_config, plain_config
from lit_spikes.stacklevel import outside_lightning

Batch = dict[str, torch.Tensor]


def batch_at(
    tokens: torch.Tensor, position: int, seed: int, batch_size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets at data ``position``: ``batch_size`` random windows of the text,
    drawn by a generator seeded from (seed, position) alone. Returns two (B, T) tensors."""
    generator = torch.Generator().manual_seed(mix_seed(seed, position))
    starts = torch.randint(0, tokens.numel() - block_size - 1, (batch_size,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(block_size + 1)]  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def poisoned_batch(
    vocab_size: int, position: int, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random characters in place of the text at ``position``."""
    generator = torch.Generator().manual_seed(mix_seed(0xBAD, position))
    windows = torch.randint(0, vocab_size, (shape[0], shape[1] + 1), generator=generator)
    return windows[:, :-1], windows[:, 1:]


@dataclass(frozen=True)
class DataConfig:
    """Where the batches come from."""

    seed: int = 0
    """Data seed: with the step, the only input of a batch (the seed's 'data order')."""
    batch_size: int = 16
    """Global batch size: rows per step, summed over all processes."""
    block_size: int = 64
    """Characters per row; must match the model's context."""
    skip: tuple[int, ...] = ()
    """Data positions never trained on (PaLM's remedy)."""
    world: WorldConfig = field(default_factory=WorldConfig)
    """The synthetic world the text comes from."""
    val_batch_size: int = 64
    """Rows per validation batch (validation covers the whole validation text)."""
    poison: tuple[int, ...] = ()
    """Data positions whose batch is replaced by uniformly random characters: a planted
    bad batch, for tests and for the data-caused spikes the diagnosis must recognise."""
    poison_rows: Literal["all", "first_half"] = "all"
    """Which rows of a poisoned global batch are replaced: ``"all"``, or ``"first_half"``
    (rows ``[0, batch_size // 2)``; the rest stay text). Under 2 processes the first half
    is exactly rank 0's shard: a bad batch planted in one rank only."""

    def __post_init__(self) -> None:
        if self.seed < 0 or self.seed >= 2**31:
            raise ValueError(f"DataConfig.seed={self.seed} must be in [0, 2**31)")
        for name in ("batch_size", "block_size", "val_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DataConfig.{name}={getattr(self, name)} must be >= 1")
        if self.poison_rows not in ("all", "first_half"):
            raise ValueError(
                f"DataConfig.poison_rows={self.poison_rows!r} must be 'all' or 'first_half'"
            )
        if self.poison_rows == "first_half" and self.batch_size < 2:
            raise ValueError(
                f"DataConfig.poison_rows='first_half' needs batch_size >= 2, got "
                f"batch_size={self.batch_size}: half of one row is no row"
            )
        object.__setattr__(self, "skip", normalize_skip(self.skip))
        object.__setattr__(self, "poison", normalize_skip(self.poison))


RESUME_DATA_CHANGES = ("seed", "skip", "val_batch_size")
"""Data settings a resume may change without a warning about the config: the seed warns
on its own, skips join the checkpoint's, validation batches do not touch training."""


def data_config_from_dict(values: dict[str, Any]) -> DataConfig:
    """A ``DataConfig`` from its plain form (lists for tuples, a dict for the world)."""
    values = dict(values)
    if "world" in values:
        values["world"] = WorldConfig(**values["world"])
    for key in ("skip", "poison"):
        if key in values:
            values[key] = tuple(values[key])
    return DataConfig(**values)


def data_config_from_checkpoint(checkpoint: dict[str, Any]) -> DataConfig:
    """The data config a checkpoint was trained with: the whole one where the file holds
    it, else (a file from before) the defaults with its data seed."""
    saved = checkpoint.get(StepDataModule.__qualname__, {})
    if "config" in saved:
        return data_config_from_dict(saved["config"])
    return DataConfig(seed=int(saved.get("seed", 0)))


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], ignore: Iterable[str] = ()
) -> list[str]:
    """``"<field>: checkpoint <a>, now <b>"`` for every field of two config dicts that
    differs, nested fields dotted (``world.num_chars``), top-level fields in ``ignore``
    left out."""
    skipped = set(ignore)
    saved_flat, now = flat_config(plain_config(saved)), flat_config(plain_config(current))
    return [
        f"{key}: checkpoint {saved_flat.get(key)!r}, now {now.get(key)!r}"
        for key in sorted(set(saved_flat) | set(now))
        if key.split(".")[0] not in skipped and saved_flat.get(key) != now.get(key)
    ]


def data_config_differences(saved: dict[str, Any] | None, current: DataConfig) -> list[str]:
    """``config_differences`` of a checkpoint's data config (``None``: a file from before
    it was stored) and ``current``, ``RESUME_DATA_CHANGES`` left out."""
    if saved is None:
        return []
    return config_differences(saved, asdict(current), RESUME_DATA_CHANGES)


def check_shard(batch_size: int, rank: int, world_size: int) -> None:
    """``StepLoader``'s check of a rank's share, naming the data config's field."""
    _check_shard(batch_size, rank, world_size, name="DataConfig.batch_size")


VIRTUAL_POSITIONS = 2**40
"""Data positions of the endless window stream: every step's batch exists, as far as any
run goes (an epoch of StepLoader's would take 2**40 steps)."""


class _WindowRows(Dataset[Batch]):
    """Row ``r`` of the window batch at data position ``p`` is item ``p * batch_size + r``,
    so ``StepLoader(shuffle=False)`` serves the batch of each position whole, or each
    rank its rows of it."""

    def __init__(self, tokens: Callable[[], torch.Tensor], config: DataConfig) -> None:
        self.tokens, self.config = tokens, config
        self._cached: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return VIRTUAL_POSITIONS * self.config.batch_size

    def windows(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch at ``position`` (drawn once for all its rows)."""
        if self._cached is None or self._cached[0] != position:
            config = self.config
            x, y = batch_at(
                self.tokens(), position, config.seed, config.batch_size, config.block_size
            )
            if position in config.poison:
                bad_x, bad_y = poisoned_batch(len(ALPHABET), position, x.shape)
                rows = x.size(0) if config.poison_rows == "all" else x.size(0) // 2
                x, y = torch.cat((bad_x[:rows], x[rows:])), torch.cat((bad_y[:rows], y[rows:]))
            self._cached = (position, x, y)
        return self._cached[1], self._cached[2]

    def __getitem__(self, index: int) -> Batch:
        position, row = divmod(index, self.config.batch_size)
        x, y = self.windows(position)
        return {"x": x[row], "y": y[row], "position": torch.tensor(position)}


class _WindowLoader(StepLoader):
    """The DataModule's loader: the DataModule's own state restores it (its skip set, and
    a data seed that a resume may change on purpose, as diagnose's replays do)."""

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_step = int(state_dict["step"])  # train_dataloader() seeks it anyway


def collate_rows(rows: list[Batch]) -> Batch:
    """One step's rows as a batch: ``x`` and ``y`` (B, T), ``position`` a scalar."""
    return {
        "x": torch.stack([row["x"] for row in rows]),
        "y": torch.stack([row["y"] for row in rows]),
        "position": rows[0]["position"],
    }


class _ValWindows(Dataset[Batch]):
    """Non-overlapping windows of the validation text, in order."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        count = (tokens.numel() - 1) // block_size
        self.x = tokens[: count * block_size].view(count, block_size)
        self.y = tokens[1 : count * block_size + 1].view(count, block_size)

    def __len__(self) -> int:
        return self.x.size(0)

    def __getitem__(self, index: int) -> Batch:
        return {"x": self.x[index], "y": self.y[index]}


def check_text_lengths(config: DataConfig, train_chars: int, val_chars: int) -> None:
    """Raises ``ValueError`` when a row of ``config.block_size`` characters cannot be cut
    from the training text (a random window needs ``block_size + 2``) or not one window
    from the validation text (validation would log nothing, silently)."""
    world, rows = config.world, config.block_size
    problems = [
        f"the {what} text has {chars} characters, fewer than DataConfig.block_size={rows} + "
        f"{need - rows}"
        for what, chars, need in (
            ("training", train_chars, rows + 2),
            ("validation", val_chars, rows + 1),
        )
        if chars < need
    ]
    if problems:
        raise ValueError(
            f"{'; '.join(problems)} (WorldConfig.num_chars={world.num_chars}, "
            f"val_fraction={world.val_fraction}): raise num_chars or val_fraction, or lower "
            "block_size"
        )


@functools.lru_cache(maxsize=4)
def world_tokens(config: WorldConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of a world's training and validation text. Built and encoded once per
    process and world (about 45 ms for the built-in one): every DataModule of a process
    shares them, and nothing writes to them."""
    world, tokenizer = build_world(config), CharTokenizer()
    return tokenizer.encode(world.train_text()), tokenizer.encode(world.val_text())


def check_ends(trainer: pl.Trainer) -> None:
    """The train stream has no end (the batch of step k exists for every k), so neither
    has an epoch of it: refuse a fit that only epochs would end, and warn of a validation
    scheduled at an epoch's end.

    Raises:
        ValueError: no ``max_steps``, no int ``limit_train_batches`` and no ``max_time``.
    """
    epochs_end = isinstance(trainer.limit_train_batches, int)
    callbacks: list[Any] = getattr(trainer, "callbacks", [])  # set on it, untyped
    timed = any(isinstance(callback, Timer) for callback in callbacks)  # max_time
    if trainer.max_steps == -1 and not epochs_end and not timed:
        raise ValueError(
            "StepDataModule's train stream never ends (the batch of step k exists for "
            "every k), so an epoch never ends and this fit would train forever: give "
            "Trainer(max_steps=...) (TinyGPTModule's schedule ends at "
            "OptimConfig.max_steps), or an int limit_train_batches for epochs of that "
            "many steps"
        )
    # Lightning sets no val_check_interval for a time-based one (a str, dict, timedelta):
    # that one validates mid-epoch
    interval = getattr(trainer, "val_check_interval", None)
    every_epochs = trainer.check_val_every_n_epoch
    validating = trainer.limit_val_batches != 0 and interval is not None
    # An endless stream is one epoch (epoch 0): a float interval waits for its end, and
    # check_val_every_n_epoch=n > 1 for an epoch n-1 that never comes.
    never = every_epochs is not None and (not isinstance(interval, int) or every_epochs > 1)
    if validating and never and not epochs_end:
        warnings.warn(
            f"val_check_interval={interval!r} with check_val_every_n_epoch={every_epochs} "
            "validates at the end of an epoch, or in an epoch after the first, which "
            "StepDataModule's endless train stream never reaches: this fit will not "
            "validate. Give val_check_interval=<steps> and check_val_every_n_epoch=None",
            stacklevel=2,
        )


class StepDataModule(pl.LightningDataModule):
    """DataModule whose train batch at global step ``k`` is a pure function of (seed, k).

    Its train loader is a ``StepLoader`` over the window rows (``shuffle=False``: position
    ``p`` is the batch drawn for (seed, ``p``)), which ``train_dataloader()`` seeks to
    ``trainer.global_step``: Lightning calls it after a checkpoint is restored, so a resumed
    run continues at exactly the right batch. The skip set and the whole data config are
    part of the checkpoint (``state_dict``).

    Under several processes (DDP), ``DataConfig.batch_size`` stays the global batch: each
    rank trains on its contiguous share of the same global batch, so the data of a step is
    the same whatever the world size; ``setup`` refuses a batch size that does not divide
    by the world size. Validation gives each rank every
    ``world_size``-th window, none repeated.

    Args:
        config: where the batches come from (data seed, batch size, skip set, world).

    Example:
        >>> dm = StepDataModule(DataConfig(seed=2))
        >>> trainer.fit(module, datamodule=dm, ckpt_path="runs/x/checkpoints/step=100.ckpt")
    """

    def __init__(self, config: DataConfig = DataConfig()) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = CharTokenizer()
        self._train_tokens: torch.Tensor | None = None
        self._val_tokens: torch.Tensor | None = None
        # Not a lambda: ddp_spawn pickles the data module into its worker.
        rows = _WindowRows(functools.partial(getattr, self, "train_tokens"), config)
        self.loader = _WindowLoader(
            rows, config.batch_size, seed=config.seed, shuffle=False, collate_fn=collate_rows
        )
        self.loader.skip = config.skip  # normalized by DataConfig; at step 0 any skip is new

    @property
    def skip(self) -> tuple[int, ...]:
        """The data positions never trained on (the loader's)."""
        return self.loader.skip

    @override
    def setup(self, stage: str) -> None:
        if self._train_tokens is None:
            train, val = world_tokens(self.config.world)
            check_text_lengths(self.config, train.numel(), val.numel())
            self._train_tokens, self._val_tokens = train, val
        if self.trainer is not None:  # before any process trains on a ragged shard
            check_shard(self.config.batch_size, self.trainer.global_rank, self.trainer.world_size)
            if self.trainer.state.fn == TrainerFn.FITTING:  # a fit, not a setup by hand
                # Here, not in train_dataloader(): Lightning leaves its recording wrappers on
                # DataLoader when that hook raises (docs/private-apis.md, row 11).
                check_ends(self.trainer)

    def check_run(
        self,
        stage: str,
        trainer: pl.Trainer,
        *,
        model: Any,
        datamodule: Any,
        checkpoint: dict[str, Any] | None,
    ) -> None:
        """``lit_spikes.ChecksItsRun``, before ``lit-spikes fit`` writes a file: a batch
        that does not shard over the Trainer's processes (each would fail in ``setup``),
        a skip the resumed run already passed (``load_state_dict``'s refusal, at the
        restore); and ``max_epochs`` honoured as Lightning does (``epoch_steps``)."""
        check_shard(self.config.batch_size, 0, trainer.world_size)
        if stage != "fit":
            return
        state = None if checkpoint is None else checkpoint.get(type(self).__qualname__)
        if state:
            probe = type(self)(self.config)
            # A BatchSkipper adds its skip in setup: the probe takes it now
            for callback in getattr(trainer, "callbacks", []):
                if isinstance(callback, BatchSkipper):
                    probe.add_skip(callback.skip)
            with warnings.catch_warnings():  # its seed and config warnings: at the restore
                warnings.simplefilter("ignore")
                probe.load_state_dict(state)
        self.epoch_steps(trainer)

    def epoch_steps(self, trainer: pl.Trainer) -> None:
        """The run ends at the first of ``max_steps`` and ``max_epochs``, as Lightning's
        does: the stream is endless, so an epoch here is as many steps as it takes to draw
        the training text's tokens (``trainer.limit_train_batches``), unless an int
        ``limit_train_batches`` sets its length."""
        epochs = trainer.max_epochs
        if epochs is None or epochs < 1 or isinstance(trainer.limit_train_batches, int):
            return
        rows = self.config.batch_size * self.config.block_size
        tokens = int(self.train_tokens.numel())
        steps = max(1, math.ceil(tokens / rows))
        trainer.limit_train_batches = steps  # a Trainer attribute its fit loop reads
        end = epochs * steps if trainer.max_steps == -1 else min(trainer.max_steps, epochs * steps)
        # The rank the launcher gave this process (Lightning reads it at import; the
        # Trainer's own is 0 until the processes start); an attribute mypy cannot see
        if getattr(rank_zero_only, "rank", 0) == 0:
            print(
                f"lit-spikes: --trainer.max_epochs {epochs}: an epoch here is {steps} steps "
                f"(the training text's {tokens} tokens / batch {self.config.batch_size} x "
                f"{self.config.block_size}); the run ends at step {end}, the first of "
                "max_steps and max_epochs",
                file=sys.stderr,
            )

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_path: str | Path,
        map_location: Any = None,
        hparams_file: Any = None,
        **kwargs: Any,
    ) -> StepDataModule:
        """The data module a checkpoint of ``TinyGPTModule``'s was trained with: its whole
        ``DataConfig`` (a file from before it held one: the defaults with its data seed)
        and its skip set. Lightning's own would build one from hyperparameters this data
        module does not save (the config travels in its ``state_dict``): the defaults.

        Args:
            checkpoint_path: the ``.ckpt`` file.
            map_location: unused (no tensors); accepted as Lightning's is.
            hparams_file: not supported (the file holds the config).
            **kwargs: ``config=`` another ``DataConfig`` (``load_state_dict`` warns where it
                differs, as at a resume), or a mapping of some of its fields over the file's.

        Raises:
            TypeError: ``hparams_file`` or another keyword argument.
            CheckpointError: the file is unreadable or not a checkpoint.
        """
        unknown = sorted(set(kwargs) - {"config"})
        if hparams_file is not None or unknown:
            given = ["hparams_file"] * (hparams_file is not None) + unknown
            raise TypeError(
                f"StepDataModule.load_from_checkpoint takes config= only, not {given}: the "
                "checkpoint holds the whole DataConfig"
            )
        checkpoint = load_checkpoint(checkpoint_path, weights_enough=True)
        saved = data_config_from_checkpoint(checkpoint)
        config = kwargs.get("config") or saved
        if isinstance(config, Mapping):  # some fields, over the file's ("world" merged)
            base = plain_config(asdict(saved))
            world = {**base.get("world", {}), **config.get("world", {})}
            config = data_config_from_dict(base | dict(config) | {"world": world})
        datamodule = cls(config)
        state = checkpoint.get(cls.__qualname__)
        if state is not None:
            datamodule.load_state_dict(state)
        return datamodule

    def add_skip(self, positions: Iterable[int]) -> None:
        """Skip more data positions from now on (used by ``lit_spikes.callbacks.BatchSkipper``)."""
        self.loader.add_skip(positions)

    def position_of_step(self, step: int) -> int:
        """The data position global step ``step`` trains on under the current skip set."""
        return self.loader.position_of_step(step)

    @property
    def train_tokens(self) -> torch.Tensor:
        if self._train_tokens is None:
            self.setup("fit")
        assert self._train_tokens is not None
        return self._train_tokens

    def stream(self, start_step: int = 0, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """The batches from ``start_step`` on, outside of any Trainer (plain loops, tests)."""
        return self.loader.iter_from(start_step, rank, world_size)

    @override
    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        # This DataModule's batches are dicts of CPU tensors: for a CPU run there is nothing
        # to move, and Lightning's walk over them to call .to() (a no-op) cost a few
        # hundredths of a millisecond every step.
        on_cpu = device.type == "cpu" and isinstance(batch, dict)
        if on_cpu and all(isinstance(v, torch.Tensor) and v.is_cpu for v in batch.values()):
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    @override
    def train_dataloader(self) -> StepLoader:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("train_dataloader() needs a Trainer; use stream(step) outside one")
        # Lightning asks for it after restoring a checkpoint: the restored step is known.
        self.loader.seek(trainer.global_step)
        return self.loader

    @override
    def val_dataloader(self) -> DataLoader[Batch]:
        """Every validation window once. Under several processes rank ``r`` takes windows
        ``r, r + world_size, ...``, unpadded: Lightning's default ``DistributedSampler``
        would repeat windows to even out the shards and count them twice in ``val/bpc``."""
        if self._val_tokens is None:
            self.setup("validate")
        assert self._val_tokens is not None
        windows = _ValWindows(self._val_tokens, self.config.block_size)
        trainer = self.trainer
        sampler = None
        if trainer is not None and trainer.world_size > 1:
            if len(windows) < trainer.world_size:
                # A rank without a window would never log val/bpc, and the others would
                # wait for it forever in the metric's sync.
                raise ValueError(
                    f"the validation text has {len(windows)} windows of block_size="
                    f"{self.config.block_size}, fewer than world_size={trainer.world_size}: "
                    "every process needs at least one"
                )
            sampler = UnrepeatedDistributedSampler(
                windows, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
            )
        return DataLoader(
            windows,
            batch_size=self.config.val_batch_size,
            sampler=sampler,
            generator=torch.Generator(),
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        step = self.trainer.global_step if self.trainer is not None else 0
        # The whole config too (plain values): a resume can check it, and the CLI can
        # resume with it.
        config = plain_config(asdict(self.config))
        return {"seed": self.config.seed, "skip": list(self.skip), "step": step, "config": config}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_seed = int(state_dict["seed"])
        if saved_seed != self.config.seed:
            warnings.warn(
                f"the checkpoint was trained with data seed {saved_seed}, this run uses "
                f"{self.config.seed}: from here on it sees other data than the original run",
                stacklevel=outside_lightning(),  # the fit call, not Lightning's hook call
            )
        differ = data_config_differences(state_dict.get("config"), self.config)
        if differ:
            warnings.warn(
                f"the checkpoint was trained with another data config ({'; '.join(differ)}): "
                "from here on the batches are not those of the original run",
                stacklevel=outside_lightning(),
            )
        saved = normalize_skip(state_dict["skip"])
        step = int(state_dict["step"])  # the trainer's own step is restored only later
        check_new_skips(saved, self.skip, step)
        self.loader.skip = normalize_skip((*saved, *self.skip))
