"""Automatic spike recovery: a closed loop around Lightning runs (``lit-spikes recover``).

Training runs with a ``SpikeDetector`` and writes ``step=<k>.ckpt`` files. When a spike
stops a run, the loop picks the newest valid checkpoint at least ``rollback_distance``
steps before the spike's onset (``RollbackRestore``), and tries remedies from that real
file, one branch each, in the order of a configurable ladder:

1. ``skip_data``: skip the data positions around the spike (PaLM);
2. ``scale_lr``: multiply the LR by ``lr_factor`` from the checkpoint's step on (OPT);
3. ``skip_step``: skip the update of outlier steps (``lit_spikes.callbacks.SkipStep``, OLMo-core);
4. ``clip``: clip the gradient norm.

A branch is accepted once it passes the spike's step plus ``accept_margin`` steps without
a new spike; a branch that spikes earlier is rejected and the next remedy is tried from
the same checkpoint. The accepted branch does not stop there: it trains on to the end
with its remedy callbacks (the remedy stays on) and its own detector, and a later spike
goes through the loop again, from that branch's checkpoints. The number of interventions
and of remedy branches is bounded; when a bound or the ladder is exhausted, the lineage
trains on to the end as it was, its spikes recorded as unrecovered.

Everything the loop decides is in its ledger, ``<log_root>/ledger.json``, rewritten
atomically after every event. A run interrupted at any moment (Ctrl-C, SIGTERM, SIGKILL)
and started again with the same arguments continues from the ledger: finished branches
are not run again, and the branch that was running resumes from its own newest
checkpoint, bit-exactly (its per-step records are kept in ``history.jsonl`` beside it).

TensorBoard: every branch is its own run, ``<log_root>/<branch>``, on the shared step
axis; the accepted lineage is also written as one stitched run, ``<log_root>/accepted``,
each step once. With ``compare=True`` two more rows show what the loop bought: doing
nothing (the first run continued through its spike) and the cause-aimed fix, QK-norm at
the same LR, trained from scratch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typing_extensions import override

from lit_spikes.callbacks import (
    BatchSkipper,
    LRScaler,
    PreemptionCheckpoint,
    RunDirectoryBusy,
    SkipStep,
    SpikeDetector,
)
from lit_spikes.callbacks._common import module_history, trainer_callbacks
from lit_spikes.callbacks.rollback import RollbackRestore
from lit_spikes.callbacks.run_lock import LOCK_NAME, RunDirectoryLock
from lit_spikes.checkpoints import (
    CheckpointError,
    atomic_write,
    newest_valid_checkpoint,
    wait_for_writes,
)
from lit_spikes.data import (
    DataConfig,
    StepDataModule,
    data_config_from_dict,
    plain_config,
)
from lit_spikes.model import GPTConfig
from lit_spikes.module import (
    DEFAULT_MODEL_SEED,
    LOGGED_AS,
    STEP_SCALARS,
    OptimConfig,
    TinyGPTModule,
    destroy_process_group,
)
from lit_spikes.training import (
    CHECKPOINT_DIRNAME,
    RunSpec,
    checkpoint_path,
    quiet_branches,
    unwritable_directory,
)

REMEDIES = ("skip_data", "scale_lr", "skip_step", "clip")
"""The remedies a ladder may name, in the default order."""
LEDGER_NAME = "ledger.json"
HISTORY_NAME = "history.jsonl"
ACCEPTED_RUN = "accepted"
"""TensorBoard run of the stitched accepted lineage, ``<log_root>/accepted``."""
LEDGER_VERSION = 1


# ----------------------------------------------------------------------------- config


def _names(value: Any) -> tuple[str, ...]:
    """A sequence of names; one name alone is a sequence of one (``ladder: scale_lr``),
    not of its letters."""
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class DetectorConfig:
    """The ``SpikeDetector`` every branch runs (see its docstring for the meaning)."""

    metrics: tuple[str, ...] = ("loss",)
    window: int = 20
    warmup: int = 20
    ratio: float | None = 1.4
    z_score: float | None = None
    min_step: int | None = None
    """No flag before this global step (None: the end of the LR warm-up)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", _names(self.metrics))
        if self.min_step is not None and self.min_step < 0:
            raise ValueError(f"DetectorConfig.min_step={self.min_step} must be >= 0 or None")
        self.build(0)  # the detector's own checks, with its own messages

    def build(self, default_min_step: int) -> SpikeDetector:
        """A detector that records spikes; stopping is the loop's gate's job."""
        return SpikeDetector(
            metrics=self.metrics,
            window=self.window,
            warmup=self.warmup,
            ratio=self.ratio,
            z_score=self.z_score,
            action="log",
            min_step=default_min_step if self.min_step is None else self.min_step,
        )


@dataclass(frozen=True)
class RecoverConfig:
    """What to train and how the recovery loop reacts to spikes. The defaults are the
    project's default run (the seed's unstable setup) and the demos' choices."""

    log_root: Path = Path("runs/recover")
    """Root of every branch's run (``<log_root>/<branch>``), of the ledger and of the
    stitched ``accepted`` run."""
    gpt: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model_seed: int = DEFAULT_MODEL_SEED
    max_steps: int | None = None
    """Global step at which training ends (None: where the LR schedule ends)."""
    checkpoint_every: int = 50
    """Every branch writes ``step=<k>.ckpt`` every this many steps."""
    val_every: int | None = 100
    """Validate every this many steps (None: only at the end)."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    rollback_distance: int = 20
    """The checkpoint a remedy resumes from is at least this many steps before the spike
    (at least 1: from the spike's own step, only skipping its data could change its loss)."""
    ladder: tuple[str, ...] = REMEDIES
    """Remedies to try for each spike, in order, each from the same checkpoint."""
    skip_before: int = 5
    """``skip_data`` skips data positions from the spike's position minus this ..."""
    skip_length: int = 30
    """... and this many positions (the seed's 30; PaLM skipped 200-500 batches)."""
    lr_factor: float = 0.5
    """``scale_lr`` multiplies the LR by this from the checkpoint's step on (OPT)."""
    skip_step_sigma: float = 6.0
    """``skip_step`` skips updates of losses above mean + this many std (OLMo-core: 6)."""
    skip_step_window: int = 50
    """Rolling window of ``skip_step``; it starts filled with the lineage's losses."""
    clip_norm: float = 1.0
    """``clip`` clips the gradient norm to this."""
    accept_margin: int = 20
    """A remedy is accepted once it trains this many steps past the spike without one."""
    max_interventions: int = 3
    """Spikes the loop handles; later ones are recorded as unrecovered."""
    max_branches: int = 8
    """Remedy branches the loop may start over the whole run."""
    compare: bool = False
    """Also run 'do nothing' (the first run continued through its spike) and the
    cause-aimed fix (QK-norm at the same LR, from scratch) as rows of the report."""
    devices: int = 1
    """Processes per machine. More than one trains every branch with Lightning's DDP
    across them (gloo on CPU), each taking its shard of the step's global batch."""
    num_nodes: int = 1
    """Machines, each running this same command (``torchrun``, SLURM ``srun``)."""
    strategy: str = "auto"
    """``"auto"`` or ``"ddp"``: with several processes both mean DDP, whose processes
    the loop starts once and keeps for every branch (``ddp_spawn`` would start new ones
    for each branch and lose the callbacks' decisions on the way back)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_root", Path(self.log_root))
        object.__setattr__(self, "ladder", _names(self.ladder))
        steps = self.steps
        if steps < 1:
            raise ValueError(f"RecoverConfig.max_steps={self.max_steps} must be >= 1")
        unknown = [r for r in self.ladder if r not in REMEDIES]
        if unknown:
            raise ValueError(
                f"RecoverConfig.ladder={self.ladder!r}: unknown remedy {unknown[0]!r}; "
                f"choose from {REMEDIES}"
            )
        if not self.ladder or len(set(self.ladder)) != len(self.ladder):
            raise ValueError(
                f"RecoverConfig.ladder={self.ladder!r}: name each of {REMEDIES} at most once"
            )
        positive = ("checkpoint_every", "skip_length", "skip_step_window", "max_branches")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"RecoverConfig.{name}={getattr(self, name)} must be >= 1")
        if self.rollback_distance < 1:
            raise ValueError(
                f"RecoverConfig.rollback_distance={self.rollback_distance} must be >= 1: the "
                "checkpoint of the spike's own step holds the weights that make its loss, so "
                "a lower LR or clipping from there cannot change it (each such branch is spent "
                "on the same spike)"
            )
        for name in ("skip_before", "accept_margin", "max_interventions"):
            if getattr(self, name) < 0:
                raise ValueError(f"RecoverConfig.{name}={getattr(self, name)} must be >= 0")
        if self.val_every is not None and (self.val_every < 1 or steps % self.val_every):
            raise ValueError(
                f"RecoverConfig.val_every={self.val_every} must be None or divide the run's "
                f"{steps} steps (so every run ends validated); None (--val-every 0) "
                "validates at the end only"
            )
        if not 0 < self.lr_factor < 1:
            raise ValueError(f"RecoverConfig.lr_factor={self.lr_factor} must be in (0, 1)")
        if not self.skip_step_sigma > 0:
            raise ValueError(f"RecoverConfig.skip_step_sigma={self.skip_step_sigma} must be > 0")
        if self.skip_step_window < 2:
            raise ValueError(f"RecoverConfig.skip_step_window={self.skip_step_window} must be >= 2")
        if not self.clip_norm > 0:
            raise ValueError(f"RecoverConfig.clip_norm={self.clip_norm} must be > 0")
        if self.gpt.block_size != self.data.block_size:
            raise ValueError(
                f"RecoverConfig: gpt.block_size={self.gpt.block_size} and "
                f"data.block_size={self.data.block_size} must be equal"
            )
        for name in ("devices", "num_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RecoverConfig.{name}={value!r} must be an integer >= 1")
        if self.strategy not in ("auto", "ddp"):
            raise ValueError(
                f"RecoverConfig.strategy={self.strategy!r} must be 'auto' or 'ddp' (the loop "
                "keeps one set of DDP processes for all its branches)"
            )
        if self.world_size > 1:  # "auto" means DDP then: one ledger identity for both
            object.__setattr__(self, "strategy", "ddp")
        if self.data.batch_size % self.world_size:
            raise ValueError(
                f"RecoverConfig: data.batch_size={self.data.batch_size} must divide by the "
                f"world size devices x num_nodes = {self.world_size}"
            )

    @property
    def steps(self) -> int:
        return self.optim.max_steps if self.max_steps is None else self.max_steps

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def trainer_kwargs(self) -> dict[str, Any]:
        """The Trainer arguments every branch adds for its processes (none for one)."""
        if self.world_size == 1 and self.strategy == "auto":
            return {}
        return {"devices": self.devices, "num_nodes": self.num_nodes, "strategy": "ddp"}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (``from_dict`` reads it back)."""
        data: dict[str, Any] = plain_config(asdict(self))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecoverConfig:
        """A config from ``to_dict``'s output, or any part of it (the rest: defaults).

        Raises:
            ValueError: an unknown key (named), or a value its dataclass refuses.
        """
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown RecoverConfig keys {unknown}; known: {sorted(known)}")
        builders: dict[str, Callable[..., Any]] = {
            "gpt": lambda values: GPTConfig(**values),
            "optim": lambda values: OptimConfig(**values),
            "data": data_config_from_dict,
            "detector": lambda values: DetectorConfig(**values),
        }
        nested: dict[str, Any] = {}
        for key, build in builders.items():
            if key not in data:
                continue
            values = data.pop(key)
            if values is None:  # "data:" left empty in a YAML file: the defaults
                continue
            if not isinstance(values, dict):  # a list, a scalar
                raise ValueError(
                    f"RecoverConfig {key}: {values!r} is not a mapping of its fields "
                    f"(e.g. {key}: {{...}}); leave it out for the defaults"
                )
            nested[key] = build(values)
        return cls(**data, **nested)

    def identity(self) -> dict[str, Any]:
        """What a restart must repeat to continue a ledger: everything but the location."""
        plain = self.to_dict()
        plain.pop("log_root")
        return plain


# ----------------------------------------------------------------------------- ledger


BranchKind = Literal["base", "remedy", "continue", "compare"]
BranchStatus = Literal["pending", "running", "spiked", "finished"]


@dataclass
class BranchRecord:
    """One Trainer run of the loop (resumed, possibly, across interruptions)."""

    name: str
    """Its run directory under the log root, and its TensorBoard run."""
    kind: BranchKind
    start_step: int
    """Global step of the checkpoint it starts from (0: from scratch)."""
    ckpt_path: str | None
    parent: str | None
    """The branch whose checkpoint it starts from: the lineage goes through it."""
    remedies: list[dict[str, Any]] = field(default_factory=list)
    """Every remedy active on this lineage, inherited ones first (JSON specs)."""
    remedy: str | None = None
    """The remedy this branch tries (remedy branches)."""
    intervention: int | None = None
    """Index of the intervention it belongs to."""
    gate: Literal["stop", "log"] = "stop"
    """``stop``: a new spike stops it; ``log``: spikes are recorded, training goes on."""
    accept_after: int | None = None
    """A remedy branch is accepted once it has trained this step without a spike."""
    gpt_changes: dict[str, Any] = field(default_factory=dict)
    """Model changes against the config (the QK-norm row)."""
    status: BranchStatus = "pending"
    accepted_at: int | None = None
    spike: dict[str, Any] | None = None
    """The spike that stopped it."""
    end_step: int | None = None
    """Last global step it trained."""
    steps_trained: int = 0
    """Steps it trained (each once: steps redone after an interruption are not counted)."""
    steps_repeated: int = 0
    """Steps trained again after an interruption (bit-exact recomputation)."""
    restarts: int = 0
    batches_skipped: int = 0
    """Data positions its skip set made it jump over."""
    skip_stepped: list[int] = field(default_factory=list)
    """Steps whose update ``SkipStep`` dropped."""
    absorbed: list[dict[str, Any]] = field(default_factory=list)
    """Spikes whose update ``SkipStep`` dropped: they never reached the weights."""
    unrecovered: list[dict[str, Any]] = field(default_factory=list)
    """Spikes a ``log`` gate recorded."""
    val_bpc: float | None = None
    max_logit: float | None = None
    wall_s: float = 0.0
    note: str = ""
    """Why it exists, for the ones the loop adds when it gives up."""


@dataclass
class Intervention:
    """One spike on the lineage and what the loop did about it."""

    index: int
    spike: dict[str, Any]
    """step, metric, value, reference, data position, and the branch it stopped."""
    ckpt_step: int
    ckpt_path: str | None
    owner: str | None
    """The branch whose checkpoint it is (None: from scratch)."""
    refused: list[str] = field(default_factory=list)
    """Newer checkpoints passed over (broken, or written after a non-finite step)."""
    tried: list[str] = field(default_factory=list)
    """Remedy branches, in ladder order."""
    outcomes: dict[str, str] = field(default_factory=dict)
    """Branch -> ``accepted`` or why it was rejected."""
    status: Literal["open", "accepted", "gave_up"] = "open"
    accepted: str | None = None
    reason: str = ""

    @property
    def steps_rolled_back(self) -> int:
        """Steps from the checkpoint to the spike, inclusive: trained again by every branch."""
        return int(self.spike["step"]) + 1 - self.ckpt_step


@dataclass
class Totals:
    """The loop's cost, computed from the branches' own records when it finishes."""

    lineage: list[str]
    """Branches of the accepted lineage, oldest first."""
    steps_final: int
    """Steps of the finished run (the lineage)."""
    steps_trained: int
    """Steps trained by all branches of the loop (comparison rows left out)."""
    steps_recomputed: int
    """``steps_trained - steps_final``: trained and then discarded by a rollback."""
    steps_repeated: int
    """Steps trained again after interruptions (not part of ``steps_trained``)."""
    batches_skipped: int
    """Data positions the final run jumped over."""
    skip_stepped: list[int]
    """Steps of the final run whose update SkipStep dropped."""
    unrecovered: list[dict[str, Any]]
    """Spikes of the final run that no remedy removed."""
    val_bpc: float | None
    final_ckpt: str


@dataclass
class Ledger:
    """Everything the loop did, as written to ``ledger.json``."""

    config: dict[str, Any]
    version: int = LEDGER_VERSION
    status: Literal["running", "done"] = "running"
    branches: list[BranchRecord] = field(default_factory=list)
    interventions: list[Intervention] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    """Wall time of the loop over all its sessions."""
    sessions: int = 0
    totals: Totals | None = None
    comparison: list[dict[str, Any]] = field(default_factory=list)

    def branch(self, name: str) -> BranchRecord:
        for record in self.branches:
            if record.name == name:
                return record
        raise KeyError(f"no branch {name!r} in the ledger")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = plain_config(asdict(self))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        data = dict(data)
        if data.get("version") != LEDGER_VERSION:
            raise ValueError(
                f"ledger version {data.get('version')!r} is not {LEDGER_VERSION}: it was "
                "written by another lit-spikes; start over with --fresh"
            )
        data["branches"] = [BranchRecord(**b) for b in data.get("branches", [])]
        data["interventions"] = [Intervention(**i) for i in data.get("interventions", [])]
        if data.get("totals") is not None:
            data["totals"] = Totals(**data["totals"])
        return cls(**data)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so ``path`` holds the old file or the whole new one, durably."""
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def _round_trips(value: Any) -> bool:
    """Whether ``value`` survives pickling there and back (to reach the other ranks)."""
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return False
    return True


class LedgerMismatch(ValueError):
    """A ledger written with other arguments than this run's."""


class LedgerUnreadable(ValueError):
    """A ledger this version cannot read (another version, a damaged file)."""


class NotALogRoot(ValueError):
    """A log root that holds files but no recovery ledger: ``--fresh`` would clear it, a
    first start would delete what it names like its branch directories."""


class RankZeroStopped(RuntimeError):
    """Raised on the other ranks when rank 0 stopped the loop (an error or a signal):
    rank 0 reports it; the command exits 0 on the other ranks."""


def read_ledger(log_root: str | Path) -> Ledger:
    """The ledger of a recovery loop run under ``log_root``.

    Raises:
        FileNotFoundError: there is none.
        LedgerUnreadable: it is not a ledger this version can read.
    """
    path = Path(log_root) / LEDGER_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no recovery ledger at {path}")
    try:
        return Ledger.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as error:
        raise LedgerUnreadable(
            f"ledger {path} is unreadable ({error}); start over with --fresh"
        ) from None
    except ValueError as error:  # another version's (Ledger.from_dict says so)
        raise LedgerUnreadable(f"ledger {path}: {error}") from None


def read_history(path: Path) -> list[dict[str, Any]]:
    """The records of a branch's ``history.jsonl`` (a torn last line is dropped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the process died mid-line: that record is recomputed on resume
    return records


# ----------------------------------------------------------------------------- callbacks


class _HistoryLog(Callback):
    """Appends each step's record, and each validation's bits/char, to ``history.jsonl``
    as it happens, so a branch killed at any moment keeps what it trained.

    Under DDP every rank runs it (the records hold the global values: the loss averaged
    over the ranks' shards, the largest ``max_logit``, as the detector judges them, from
    one ``all_gather`` per step) and rank 0 alone writes."""

    def __init__(self, path: Path, write: bool = True) -> None:
        self.path, self.write = path, write
        self._handle: Any = None

    def _write(self, record: dict[str, Any]) -> None:
        if not self.write:
            return
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        record: dict[str, Any] = dict(module_history(pl_module)[-1])
        if trainer.world_size > 1:
            local = torch.tensor([record["loss"], record["max_logit"]], dtype=torch.float64)
            ranks = trainer.strategy.all_gather(local).reshape(trainer.world_size, 2).tolist()
            losses = [loss for loss, _ in ranks]
            logits = [logit for _, logit in ranks]
            record["loss"] = sum(losses) / len(losses)
            record["max_logit"] = math.nan if any(map(math.isnan, logits)) else max(logits)
            record["rank_loss"] = losses
        self._write(record)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bpc = trainer.callback_metrics.get("val/bpc")
        if bpc is not None and not trainer.sanity_checking:
            self._write({"val_step": trainer.global_step, "val_bpc": float(bpc)})

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.close()


class _SpikeGate(Callback):
    """Reads the detector's new spikes each step, after it. With ``mode="stop"`` a spike
    stops the Trainer at that step, unless ``SkipStep`` dropped that step's update (the
    spike never reached the weights); with ``mode="log"`` training goes on. Calls
    ``on_accept(step)`` once the branch has trained step ``accept_after`` without a spike.

    A branch resumed from its own checkpoint may find a spike of its own (at or after
    ``start_step``) among the detector's restored ones: it was stopped there but ended
    before the ledger heard of it (a signal in the spike's step, a kill after the
    checkpoint). It stops at once, spiked there, as the uninterrupted branch did."""

    def __init__(
        self,
        detector: SpikeDetector,
        mode: Literal["stop", "log"],
        accept_after: int | None,
        on_accept: Callable[[int], None],
        start_step: int = 0,
    ) -> None:
        self.detector, self.mode = detector, mode
        self.accept_after, self.on_accept = accept_after, on_accept
        self.start_step = start_step
        self.stop_spike: dict[str, Any] | None = None
        self.accepted = accept_after is None
        self._seen = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored = self.detector.spikes
        self._seen = len(restored)  # from now on, only the spikes of the steps to come
        if self.mode != "stop":
            return
        dropped = set(skip_stepped(trainer_callbacks(trainer)))
        own = [s for s in restored if int(s["step"]) >= self.start_step]
        own = [s for s in own if int(s["step"]) not in dropped]
        if own:
            datamodule = getattr(trainer, "datamodule", None)  # typed loosely by Lightning
            assert isinstance(datamodule, StepDataModule)
            step = int(own[0]["step"])
            self.stop_spike = {**own[0], "position": datamodule.position_of_step(step)}
            trainer.should_stop = True  # Lightning then trains no step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        record = module_history(pl_module)[-1]
        step = int(record["step"])
        new = self.detector.spikes[self._seen :]
        self._seen = len(self.detector.spikes)
        dropped = set(skip_stepped(trainer_callbacks(trainer))) if new else set()
        for spike in new:
            if self.mode == "stop" and int(spike["step"]) not in dropped:
                self.stop_spike = self.stop_spike or {**spike, "position": record["position"]}
                trainer.should_stop = True
        if not self.accepted and self.stop_spike is None:
            assert self.accept_after is not None
            if step >= self.accept_after:
                self.accepted = True
                self.on_accept(step)


def skip_stepped(callbacks: Sequence[Callback]) -> list[int]:
    """Steps whose update a ``SkipStep`` among ``callbacks`` dropped (its restored state
    included)."""
    return sorted({s for cb in callbacks if isinstance(cb, SkipStep) for s in cb.skipped_steps})


def dedupe_spikes(spikes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (step, metric), in step order."""
    unique = {(int(s["step"]), s["metric"]): s for s in spikes}
    return [unique[key] for key in sorted(unique)]


class _Interrupted(Exception):
    """A signal stopped a branch (its checkpoint is written); the ledger says where."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


# ----------------------------------------------------------------------------- remedies


def remedy_callbacks(specs: Sequence[dict[str, Any]]) -> tuple[list[Callback], dict[str, Any]]:
    """The callbacks and Trainer arguments of a lineage's remedies (JSON specs)."""
    callbacks: list[Callback] = []
    trainer_kwargs: dict[str, Any] = {}
    for spec in specs:
        kind = spec["kind"]
        if kind == "skip_data":
            callbacks.append(BatchSkipper(ranges=[tuple(r) for r in spec["ranges"]]))
        elif kind == "scale_lr":
            callbacks.append(LRScaler(spec["factor"], start_step=spec["start_step"]))
        elif kind == "skip_step":
            callbacks.append(
                SkipStep(
                    window=spec["window"],
                    sigma=spec["sigma"],
                    warmup=spec["warmup"],
                    start_step=spec["start_step"],
                    initial=spec["initial"],
                )
            )
        elif kind == "clip":
            trainer_kwargs["gradient_clip_val"] = spec["value"]
        else:
            raise ValueError(f"unknown remedy kind {kind!r} in {spec!r}")
    return callbacks, trainer_kwargs


def describe_remedy(spec: dict[str, Any]) -> str:
    kind = spec["kind"]
    if kind == "skip_data":
        return ", ".join(f"skip data {a}-{b - 1}" for a, b in spec["ranges"])
    if kind == "scale_lr":
        return f"LR x{spec['factor']:g} from step {spec['start_step']}"
    if kind == "skip_step":
        return f"skip-step ({spec['sigma']:g} sigma) from step {spec['start_step']}"
    return f"clip grad norm at {spec['value']:g}"


# ----------------------------------------------------------------------------- the loop


@dataclass
class RecoverResult:
    """What ``recover`` returns: the ledger, the stitched lineage and the final weights."""

    ledger: Ledger
    lineage: list[dict[str, Any]]
    """Per-step records of the accepted lineage, each step once (and validations)."""
    final_ckpt: Path
    """Checkpoint of the finished run (last step of the lineage's last branch)."""
    val_bpc: float | None


_T = TypeVar("_T")


class _Ranks:
    """The loop's processes. One: rank 0 of 1. Several (``config.world_size > 1``): they
    are started here, before the loop reads or writes a file, through Lightning Fabric's
    launcher (it runs this same command again for the other local ranks, as the Trainer's
    DDP strategy does; under ``torchrun`` or SLURM they exist already), and joined in one
    process group that every branch's Trainer then reuses."""

    def __init__(self, config: RecoverConfig) -> None:
        self.fabric: Any = None
        if config.world_size > 1:
            from lightning.fabric import Fabric

            self.fabric = Fabric(
                accelerator="cpu",
                devices=config.devices,
                num_nodes=config.num_nodes,
                strategy="ddp",
            )
            self.fabric.launch()

    @property
    def leader(self) -> bool:
        return self.fabric is None or self.fabric.global_rank == 0

    def from_leader(self, value: _T) -> _T:
        """Rank 0's ``value``, on every rank."""
        if self.fabric is None:
            return value
        shared: _T = self.fabric.broadcast(value, src=0)
        return shared

    def close(self) -> None:
        """Tear the process group down now, not at exit (``destroy_process_group``)."""
        if self.fabric is not None:
            destroy_process_group()


class RecoveryLoop:
    """The loop behind ``recover``; its state is the ledger, rewritten after every event.

    Under DDP every rank runs the loop and trains every branch, and rank 0 alone plans,
    reads and writes files (ledger, histories, TensorBoard's stitched run): after each of
    its turns the other ranks take its ledger (``_on_leader``). The branches' own
    decisions (a spike stopping one, SkipStep, preemption) are agreed by the callbacks.

    Args:
        config: what to train and how to react.
        console: where events and tables go (None: a quiet console).
        progress_bar: Lightning's progress bar in each branch.
        extra_callbacks: called with each branch record before it runs, returns callbacks
            to add (a seam for tests that break a run on purpose).
        fresh: discard an existing ledger and runs under the log root.
    """

    def __init__(
        self,
        config: RecoverConfig,
        console: Console | None = None,
        progress_bar: bool = False,
        extra_callbacks: Callable[[BranchRecord], Sequence[Callback]] | None = None,
        fresh: bool = False,
    ) -> None:
        self.config, self.progress_bar = config, progress_bar
        self.ranks = _Ranks(config)
        self.console = console or Console(quiet=True)
        if not self.ranks.leader:
            self.console = Console(quiet=True)
        self.extra_callbacks = extra_callbacks
        self.root = config.log_root
        self.path = self.root / LEDGER_NAME
        self.ledger = Ledger(config=config.to_dict())
        self._clock = time.perf_counter()
        # The whole log root, before its ledger is read or anything in it removed: a second
        # recover started into it would restart (delete) branches this one is training.
        self.root_lock = RunDirectoryLock(self.root)
        try:
            self._on_leader(lambda: self._open(fresh))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the log root and leave the process group (when done or failed)."""
        self.root_lock.release()
        self.ranks.close()

    def _open(self, fresh: bool) -> None:
        self.root_lock.acquire()
        if fresh:
            others = sorted(e.name for e in self.root.iterdir() if e.name != LOCK_NAME)
            if others and not self.path.is_file():
                raise NotALogRoot(
                    f"--fresh would delete everything in {self.root}, but it holds no "
                    f"{LEDGER_NAME}: it is not a recovery log root ({len(others)} entries: "
                    f"{', '.join(others[:5])}{', ...' if len(others) > 5 else ''}). Choose "
                    "another --log-root, or empty this one yourself"
                )
            for entry in self.root.iterdir():
                if entry.name == LOCK_NAME:  # stays: another recover would find it locked
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        resumed = self.path.is_file()
        if resumed:
            self.ledger = read_ledger(self.root)
            self._check_same_config()
        else:  # the ledger is written at once: anything else here is not this loop's
            others = sorted(e.name for e in self.root.iterdir() if e.name != LOCK_NAME)
            if others:
                raise NotALogRoot(
                    f"{self.root} holds no {LEDGER_NAME} but {len(others)} entries "
                    f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}): a new "
                    "recovery loop there would delete its branch directories (base, "
                    "accepted, spike*, compare) if they are among them. Choose another "
                    "--log-root, or empty this one yourself"
                )
        self.ledger.sessions += 1
        self.event("resume" if resumed else "start", sessions=self.ledger.sessions)

    def _on_leader(self, work: Callable[[], _T]) -> _T:
        """Run ``work`` on rank 0 only; then every rank holds rank 0's ledger and
        ``work``'s result, or raises its error (one process: just ``work()``)."""
        result: _T | None = None
        error: BaseException | None = None
        if self.ranks.leader:
            try:
                result = work()
            except BaseException as caught:  # every rank must hear of it, or they would hang
                error = caught
        if self.ranks.fabric is not None:
            message = None if error is None else f"{type(error).__name__}: {error}"
            payload = (self.ledger, result, message)
            if not _round_trips(payload):
                payload = (self.ledger, None, message or "rank 0's result cannot be sent")
            self.ledger, result, message = self.ranks.from_leader(payload)
            if message is not None and not self.ranks.leader:
                raise RankZeroStopped(f"rank 0 stopped the loop: {message}")
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    # -- ledger

    def _check_same_config(self) -> None:
        saved = dict(self.ledger.config)
        saved.pop("log_root", None)
        # A ledger of an older lit-spikes lacks newer fields: they hold their defaults.
        # Unknown or refused fields: compared as written, and named below.
        with suppress(ValueError, TypeError):
            saved = RecoverConfig.from_dict({**saved, "log_root": str(self.root)}).identity()
        now = self.config.identity()
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if differ:
            detail = "; ".join(f"{k}: ledger {saved.get(k)!r}, now {now.get(k)!r}" for k in differ)
            raise LedgerMismatch(
                f"{self.path} was written with other arguments ({detail}): restart with the "
                "same arguments to continue it, or pass --fresh (fresh=True) to start over"
            )

    def save(self) -> None:
        if not self.ranks.leader:
            return
        now = time.perf_counter()
        self.ledger.wall_s += now - self._clock
        self._clock = now
        atomic_write_text(self.path, json.dumps(self.ledger.to_dict(), indent=1) + "\n")

    def event(self, kind: str, save: bool = True, **detail: Any) -> None:
        """Record an event and (unless ``save=False``: a decision that the next saved
        event completes, so an interruption between them leaves no half of it) write
        the ledger."""
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        self.ledger.events.append({"time": stamp, "event": kind, **plain_config(detail)})
        if save:
            self.save()
        text = ", ".join(f"{k}={v}" for k, v in detail.items())
        self.console.print(f"[bold]{kind}[/bold] {escape(text)}")

    # -- driving

    def run(self) -> RecoverResult:
        while self.ledger.status != "done":
            active = [b for b in self.ledger.branches if b.status in ("pending", "running")]
            if active:
                self.run_branch(active[0])
            else:
                self._on_leader(self._plan_or_finish)
        return self._on_leader(self.result)  # it reads the histories: rank 0's files

    def _plan_or_finish(self) -> None:
        if not self.plan_next():
            self.finish()

    def _main_branches(self) -> list[BranchRecord]:
        return [b for b in self.ledger.branches if b.kind != "compare"]

    def _remedy_count(self) -> int:
        return sum(b.kind == "remedy" for b in self.ledger.branches)

    def plan_next(self) -> bool:
        """Add the next branch the ledger calls for; False when only finishing is left."""
        main = self._main_branches()
        if not main:
            self.add_branch(
                BranchRecord(name="base", kind="base", start_step=0, ckpt_path=None, parent=None)
            )
            return True
        last = main[-1]
        if last.status == "spiked":
            if last.kind == "remedy" and last.accepted_at is None:
                self.reject(last)
            else:
                self.intervene(last)
            return True
        assert last.status == "finished"
        return self.plan_comparison()

    def add_branch(self, record: BranchRecord) -> None:
        self.ledger.branches.append(record)
        self.event(
            "branch_planned",
            branch=record.name,
            start_step=record.start_step,
            remedies=[describe_remedy(r) for r in record.remedies],
        )

    def intervene(self, spiked: BranchRecord) -> None:
        """A spike on the lineage: roll back and try the first remedy, or give up."""
        assert spiked.spike is not None
        spike = {**spiked.spike, "branch": spiked.name}
        if len(self.ledger.interventions) >= self.config.max_interventions:
            self.give_up(spiked, None, f"max_interventions={self.config.max_interventions} used")
            return
        if self._remedy_count() >= self.config.max_branches:
            self.give_up(spiked, None, f"max_branches={self.config.max_branches} used")
            return
        step, path, owner, refused = self.choose_rollback(spiked, int(spike["step"]))
        intervention = Intervention(
            index=len(self.ledger.interventions),
            spike=spike,
            ckpt_step=step,
            ckpt_path=path,
            owner=owner,
            refused=refused,
        )
        self.ledger.interventions.append(intervention)
        self.event(
            "spike",
            save=False,
            intervention=intervention.index + 1,
            step=spike["step"],
            metric=spike["metric"],
            value=round(float(spike["value"]), 4),
            branch=spiked.name,
            rollback_to=step,
        )
        self.try_remedy(intervention, self.config.ladder[0])

    def reject(self, branch: BranchRecord) -> None:
        assert branch.intervention is not None and branch.spike is not None
        intervention = self.ledger.interventions[branch.intervention]
        why = (
            f"spike at step {branch.spike['step']} ({branch.spike['metric']} "
            f"{float(branch.spike['value']):.3f})"
        )
        intervention.outcomes[branch.name] = f"rejected: {why}"
        self.event("rejected", save=False, branch=branch.name, reason=why)
        tried = len(intervention.tried)
        if tried >= len(self.config.ladder):
            self.give_up_intervention(intervention, "every remedy of the ladder spiked")
        elif self._remedy_count() >= self.config.max_branches:
            self.give_up_intervention(intervention, f"max_branches={self.config.max_branches} used")
        else:
            self.try_remedy(intervention, self.config.ladder[tried])

    def give_up_intervention(self, intervention: Intervention, reason: str) -> None:
        intervention.status, intervention.reason = "gave_up", reason
        spiked = self.ledger.branch(intervention.spike["branch"])
        self.give_up(spiked, intervention, reason)

    def give_up(self, spiked: BranchRecord, intervention: Intervention | None, reason: str) -> None:
        """Train the lineage on to the end as it was, spikes recorded, never stopped."""
        step, path, owner = self.newest_on_lineage(spiked)
        index = intervention.index + 1 if intervention else len(self.ledger.interventions) + 1
        self.event("gave_up", save=False, branch=spiked.name, reason=reason, continue_from=step)
        self.add_branch(
            BranchRecord(
                name=f"spike{index}/continue",
                kind="continue",
                start_step=step,
                ckpt_path=path,
                parent=owner,
                remedies=list(spiked.remedies),
                gate="log",
                note=f"gave up on the spike at step {spiked.spike['step']} ({reason})"
                if spiked.spike
                else reason,
            )
        )

    def try_remedy(self, intervention: Intervention, remedy: str) -> None:
        spiked = self.ledger.branch(intervention.spike["branch"])
        spec = self.remedy_spec(remedy, intervention, spiked)
        # One instance per kind and window: a newer one replaces an inherited one of the
        # same state key (SkipStep, clipping); LR scalers and skip windows accumulate.
        replaced = remedy in ("skip_step", "clip")
        inherited = [r for r in spiked.remedies if not (replaced and r["kind"] == remedy)]
        name = f"spike{intervention.index + 1}/{remedy}"
        intervention.tried.append(name)
        self.add_branch(
            BranchRecord(
                name=name,
                kind="remedy",
                start_step=intervention.ckpt_step,
                ckpt_path=intervention.ckpt_path,
                parent=intervention.owner,
                remedies=[*inherited, spec],
                remedy=remedy,
                intervention=intervention.index,
                accept_after=min(
                    int(intervention.spike["step"]) + self.config.accept_margin,
                    self.config.steps - 1,
                ),
            )
        )

    def remedy_spec(
        self, remedy: str, intervention: Intervention, spiked: BranchRecord
    ) -> dict[str, Any]:
        """The JSON spec of ``remedy`` for this spike and checkpoint."""
        k, config = intervention.ckpt_step, self.config
        if remedy == "skip_data":
            records = {r["step"]: r for r in self.lineage_records(spiked.name) if "step" in r}
            first = int(records[k]["position"]) if k in records else k
            start = max(first, int(intervention.spike["position"]) - config.skip_before)
            return {"kind": "skip_data", "ranges": [[start, start + config.skip_length]]}
        if remedy == "scale_lr":
            current = [r["factor"] for r in spiked.remedies if r["kind"] == "scale_lr"]
            factor = (current[-1] if current else 1.0) * config.lr_factor
            return {"kind": "scale_lr", "factor": factor, "start_step": k}
        if remedy == "skip_step":
            losses = [
                float(r["loss"])
                for r in self.lineage_records(spiked.name)
                if "step" in r and r["step"] < k and math.isfinite(r["loss"])
            ][-config.skip_step_window :]
            return {
                "kind": "skip_step",
                "window": config.skip_step_window,
                "sigma": config.skip_step_sigma,
                "warmup": min(10, config.skip_step_window),  # the window starts filled
                "start_step": k,
                "initial": losses,
            }
        clips = [r["value"] for r in spiked.remedies if r["kind"] == "clip"]
        return {"kind": "clip", "value": min([config.clip_norm, *clips])}

    # -- lineage and checkpoints

    def lineage(self, head: str) -> list[tuple[BranchRecord, int, int | None]]:
        """``(branch, first step, end step or None)`` segments from the first run to
        ``head``: each branch's steps in ``[first, end)`` are on the lineage."""
        segments: list[tuple[BranchRecord, int, int | None]] = []
        record: BranchRecord | None = self.ledger.branch(head)
        end: int | None = None
        while record is not None:
            segments.append((record, record.start_step, end))
            end = record.start_step
            record = self.ledger.branch(record.parent) if record.parent else None
        return segments[::-1]

    def lineage_records(self, head: str) -> list[dict[str, Any]]:
        """The per-step records (and validations) of the lineage ending in ``head``."""
        records: list[dict[str, Any]] = []
        for branch, first, end in self.lineage(head):
            for record in read_history(self.root / branch.name / HISTORY_NAME):
                if "step" in record:
                    keep = record["step"] >= first and (end is None or record["step"] < end)
                else:
                    step = record["val_step"]
                    keep = step > first and (end is None or step <= end)
                if keep:
                    records.append(record)
        return records

    def choose_rollback(
        self, spiked: BranchRecord, onset: int
    ) -> tuple[int, str | None, str | None, list[str]]:
        """The newest valid checkpoint of the lineage at least ``rollback_distance`` steps
        before ``onset``: ``RollbackRestore``'s choice in this branch's checkpoints, then in
        each ancestor's up to where the lineage left it. Returns ``(step, path, owner
        branch, refused files)``; ``(0, None, None, ...)``: from scratch."""
        distance = min(self.config.rollback_distance, onset)
        refused: list[str] = []
        bound = onset - distance
        for record, first, end in reversed(self.lineage(spiked.name)):
            limit = self.scheduled(bound if end is None else min(bound, end))
            directory = self.root / record.name / CHECKPOINT_DIRNAME
            if not directory.is_dir() or limit <= first:
                continue
            rollback = RollbackRestore(directory, spike_step=limit + distance, distance=distance)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    step, path = rollback.ckpt_step, rollback.ckpt_path
                    refused.extend(rollback.refused)
                    while step != self.scheduled(step):
                        # A Ctrl-C's file, reached past a refused scheduled one: passed over
                        # too, or an interrupted loop would decide otherwise
                        rollback = RollbackRestore(
                            directory, spike_step=self.scheduled(step) + distance, distance=distance
                        )
                        step, path = rollback.ckpt_step, rollback.ckpt_path
                        refused.extend(rollback.refused)
            except FileNotFoundError:
                continue
            if step > first:  # absolute: the ledger goes on from any working directory
                return step, str(Path(path).resolve()), record.name, refused
        return 0, None, None, refused

    def scheduled(self, step: int) -> int:
        """The newest step at or before ``step`` with a scheduled checkpoint. Rollback
        targets are chosen among those, so the extra file a Ctrl-C writes never changes
        a decision: an interrupted loop decides as the uninterrupted one."""
        return step - step % self.config.checkpoint_every

    def newest_on_lineage(self, branch: BranchRecord) -> tuple[int, str | None, str | None]:
        """The newest valid scheduled checkpoint on the lineage through ``branch``:
        ``(step, path, owner branch)``; ``(0, None, None)``: none, from scratch."""
        for record, first, end in reversed(self.lineage(branch.name)):
            directory = self.root / record.name / CHECKPOINT_DIRNAME
            if not directory.is_dir():
                continue
            limit = self.scheduled(self.config.steps if end is None else end)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    step, path, _ = newest_valid_checkpoint(directory, limit)
                    while step != self.scheduled(step):  # a Ctrl-C's file: passed over
                        step, path, _ = newest_valid_checkpoint(directory, self.scheduled(step))
            except FileNotFoundError:
                continue
            if step > first:
                return step, str(Path(path).resolve()), record.name
        return 0, None, None

    # -- one branch

    def run_branch(self, record: BranchRecord) -> None:
        """Train one branch until it ends or its gate stops it at a spike."""
        ckpt, start = self._on_leader(lambda: self._prepare(record))
        record = self.ledger.branch(record.name)  # rank 0's record, on every rank
        config = self.config
        run_dir = self.root / record.name
        detector = config.detector.build(config.optim.warmup_steps)

        def accept(step: int) -> None:
            self.accept(record, step)

        gate = _SpikeGate(detector, record.gate, record.accept_after, accept, record.start_step)
        if record.accepted_at is not None:
            gate.accepted = True
        history_log = _HistoryLog(run_dir / HISTORY_NAME, write=self.ranks.leader)
        remedies, trainer_kwargs = remedy_callbacks(record.remedies)
        extra = list(self.extra_callbacks(record)) if self.extra_callbacks else []
        gpt = replace(config.gpt, **record.gpt_changes)
        module = TinyGPTModule(gpt=gpt, optim=config.optim, model_seed=config.model_seed)
        datamodule = StepDataModule(config.data)
        spec = RunSpec(
            log_root=self.root,
            name=record.name,
            max_steps=config.steps,
            checkpoint_every=config.checkpoint_every,
            val_every=config.val_every,
            callbacks=[detector, *remedies, gate, history_log, *extra],
            progress_bar=self.progress_bar,
            trainer_kwargs={**config.trainer_kwargs(), **trainer_kwargs},
            resume_step=start if ckpt else None,
        )
        clock = time.perf_counter()
        try:
            with quiet_branches():
                trainer = spec.trainer()
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
        finally:
            history_log.close()
            record.wall_s += time.perf_counter() - clock
        preemption = next(
            cb for cb in trainer_callbacks(trainer) if isinstance(cb, PreemptionCheckpoint)
        )  # RunSpec adds one for a run with checkpoints, as every branch is
        if preemption.saved_path is not None:  # every rank saved and stopped at one step
            self._stop_on_signal(record, preemption)
        if gate.stop_spike is None and trainer.global_step >= config.steps:
            final = checkpoint_path(run_dir, config.steps)
            if self._on_leader(lambda: not final.is_file()):
                trainer.save_checkpoint(final)  # every rank: a collective under DDP
                wait_for_writes()  # on disk (or its error raised) before the ledger names it
        self._on_leader(lambda: self._conclude(record, detector, trainer, gate))
        if preemption.ended_by_signal:  # in the branch's last step (every rank agreed)
            self._stop_on_signal(record, preemption)  # concluded, then stop

    def _stop_on_signal(self, record: BranchRecord, preemption: PreemptionCheckpoint) -> None:
        """Record the interruption and stop the loop with rank 0's signal on every rank."""
        saved, received = preemption.saved_path, int(preemption.received or signal.SIGINT)

        def interrupted() -> int:
            self.event("interrupted", branch=record.name, checkpoint=saved)
            return received

        raise _Interrupted(self._on_leader(interrupted))

    def _prepare(self, record: BranchRecord) -> tuple[str | None, int]:
        """Rank 0's part of a branch's start: where it starts (its checkpoint and step:
        an interrupted branch continues from its own newest file), and its history file
        cut back to that step."""
        config = self.config
        run_dir = self.root / record.name
        history_path = run_dir / HISTORY_NAME
        ckpt: str | None = record.ckpt_path
        start = record.start_step
        previous = [r for r in read_history(history_path) if "step" in r]
        if record.status == "running":  # interrupted: continue from its own newest file
            record.restarts += 1
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    step, path, _ = newest_valid_checkpoint(
                        run_dir / CHECKPOINT_DIRNAME, config.steps - 1, refuse_nonfinite=False
                    )
            except FileNotFoundError:
                step, path = -1, None
            if path is not None and step > record.start_step:
                ckpt, start = str(path), step
        if start == record.start_step:  # a first start, or nothing of its own to resume
            record.steps_repeated += len(previous)
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            kept = [
                r
                for r in read_history(history_path)
                if ("step" in r and r["step"] < start)
                or ("val_step" in r and r["val_step"] <= start)
            ]
            record.steps_repeated += len(previous) - sum("step" in r for r in kept)
            atomic_write_text(history_path, "".join(json.dumps(r) + "\n" for r in kept))
        record.status = "running"
        self.event(
            "branch_start" if start == record.start_step else "branch_resume",
            branch=record.name,
            from_step=start,
        )
        return ckpt, start

    def _conclude(
        self, record: BranchRecord, detector: SpikeDetector, trainer: pl.Trainer, gate: _SpikeGate
    ) -> None:
        """Rank 0's part of a branch's end: its counts, and spiked or finished."""
        config = self.config
        datamodule = getattr(trainer, "datamodule", None)  # typed loosely by Lightning
        assert isinstance(datamodule, StepDataModule)
        self.summarize(record, detector, trainer_callbacks(trainer), datamodule)
        if gate.stop_spike is not None:
            record.status, record.spike = "spiked", gate.stop_spike
            self.event(
                "branch_spiked",
                branch=record.name,
                step=gate.stop_spike["step"],
                value=round(float(gate.stop_spike["value"]), 4),
            )
            return
        if trainer.global_step < config.steps:
            raise RuntimeError(
                f"branch {record.name} stopped at step {trainer.global_step} of "
                f"{config.steps} without a spike or a signal"
            )
        record.status = "finished"
        if record.accepted_at is None and record.accept_after is not None:
            self.accept(record, config.steps - 1)
        self.event("branch_finished", branch=record.name, val_bpc=record.val_bpc)

    def accept(self, record: BranchRecord, step: int) -> None:
        record.accepted_at = step
        if record.intervention is not None:
            intervention = self.ledger.interventions[record.intervention]
            intervention.status, intervention.accepted = "accepted", record.name
            intervention.outcomes[record.name] = (
                f"accepted: no spike from step {record.start_step} through step {step}"
            )
        self.event("accepted", branch=record.name, at_step=step)

    def summarize(
        self,
        record: BranchRecord,
        detector: SpikeDetector,
        callbacks: Sequence[Callback],
        datamodule: StepDataModule,
    ) -> None:
        """The branch's counts, from its own records, its callbacks' states and its data
        module's skip set, which hold every session's steps (a resumed run restored them
        from its checkpoint)."""
        records = read_history(self.root / record.name / HISTORY_NAME)
        steps = [r for r in records if "step" in r]
        vals = [r for r in records if "val_step" in r]
        positions = {int(r["step"]): int(r["position"]) for r in steps}
        record.steps_trained = len(steps)
        record.end_step = int(steps[-1]["step"]) if steps else None
        if steps:
            first, last = steps[0], steps[-1]
            # The offset before the branch's first step: a window the branch skips from
            # that very step on (its start clamped to the checkpoint's position) is already
            # in the first step's position.
            before = int(first["step"]) - 1
            offset = datamodule.position_of_step(before) - before if before >= 0 else 0
            record.batches_skipped = int(last["position"] - last["step"]) - offset
            record.max_logit = max(float(r["max_logit"]) for r in steps)
        record.val_bpc = float(vals[-1]["val_bpc"]) if vals else None
        record.skip_stepped = [s for s in skip_stepped(callbacks) if s >= record.start_step]
        own = [
            {**s, "position": positions.get(int(s["step"]))}
            for s in detector.spikes
            if int(s["step"]) >= record.start_step
        ]
        dropped = set(record.skip_stepped)
        record.absorbed = dedupe_spikes([s for s in own if int(s["step"]) in dropped])
        if record.gate == "log":
            record.unrecovered = dedupe_spikes([s for s in own if int(s["step"]) not in dropped])

    def lineage_spikes(self, head: str) -> list[dict[str, Any]]:
        """Spikes on the lineage ending in ``head`` that reached the weights: stops of
        its branches and spikes their ``log`` gates recorded, each step once."""
        found = []
        for branch, first, end in self.lineage(head):
            for spike in [*branch.unrecovered, *([branch.spike] if branch.spike else [])]:
                if int(spike["step"]) >= first and (end is None or int(spike["step"]) < end):
                    found.append(spike)
        return dedupe_spikes(found)

    # -- comparison rows and the end

    def plan_comparison(self) -> bool:
        if not self.config.compare:
            return False
        names = {b.name for b in self.ledger.branches}
        base = self.ledger.branch("base")
        if base.status == "spiked" and "compare/do_nothing" not in names:
            step, path, owner = self.newest_on_lineage(base)
            self.add_branch(
                BranchRecord(
                    name="compare/do_nothing",
                    kind="compare",
                    start_step=step,
                    ckpt_path=path,
                    parent=owner,
                    gate="log",
                )
            )
            return True
        if "compare/qk_norm" not in names:
            self.add_branch(
                BranchRecord(
                    name="compare/qk_norm",
                    kind="compare",
                    start_step=0,
                    ckpt_path=None,
                    parent=None,
                    gate="log",
                    gpt_changes={"qk_norm": True},
                )
            )
            return True
        return False

    def final_head(self) -> BranchRecord:
        return self._main_branches()[-1]

    def finish(self) -> None:
        head = self.final_head()
        segments = self.lineage(head.name)
        records = self.lineage_records(head.name)
        steps = [r for r in records if "step" in r]
        vals = [r for r in records if "val_step" in r]
        main = self._main_branches()
        lineage_spikes = self.lineage_spikes(head.name)
        last = steps[-1]
        self.ledger.totals = Totals(
            lineage=[b.name for b, _, _ in segments],
            steps_final=len(steps),
            steps_trained=sum(b.steps_trained for b in main),
            steps_recomputed=sum(b.steps_trained for b in main) - len(steps),
            steps_repeated=sum(b.steps_repeated for b in self.ledger.branches),
            batches_skipped=int(last["position"] - last["step"]),
            skip_stepped=sorted(int(r["step"]) for r in steps if r.get("skipped")),
            unrecovered=lineage_spikes,
            val_bpc=float(vals[-1]["val_bpc"]) if vals else None,
            final_ckpt=str(checkpoint_path(self.root / head.name, self.config.steps)),
        )
        self.ledger.comparison = self.comparison_rows()
        write_stitched_run(self.root / ACCEPTED_RUN, records, lineage_spikes)
        self.ledger.status = "done"
        self.event("done", val_bpc=self.ledger.totals.val_bpc, lineage=self.ledger.totals.lineage)

    def comparison_rows(self) -> list[dict[str, Any]]:
        """Rows of the report: the recovered run, and with ``compare`` doing nothing and
        QK-norm. ``spikes`` counts flagged steps (the recovered run: those on its lineage
        that no remedy removed; a rejected branch's spike is not on it)."""
        totals = self.ledger.totals
        assert totals is not None
        head = self.final_head()
        records = [r for r in self.lineage_records(head.name) if "step" in r]
        first = int(self.ledger.interventions[0].spike["step"]) if self.ledger.interventions else 0
        rows = [
            {
                "run": "recovered (accepted lineage)",
                "val_bpc": totals.val_bpc,
                "spikes": len(totals.unrecovered),
                "max_logit_after": max(
                    (float(r["max_logit"]) for r in records if r["step"] >= first), default=None
                ),
            }
        ]
        for name, label in (
            ("compare/do_nothing", "do nothing (continue through the spike)"),
            ("compare/qk_norm", "QK-norm at the same LR (from scratch)"),
        ):
            if name not in {b.name for b in self.ledger.branches}:
                continue
            kept = [r for r in self.lineage_records(name) if "step" in r]
            vals = [r for r in self.lineage_records(name) if "val_step" in r]
            spikes = self.lineage_spikes(name)
            rows.append(
                {
                    "run": label,
                    "val_bpc": float(vals[-1]["val_bpc"]) if vals else None,
                    "spikes": len(spikes),
                    "max_logit_after": max(
                        (float(r["max_logit"]) for r in kept if r["step"] >= first), default=None
                    ),
                }
            )
        return rows

    def result(self) -> RecoverResult:
        totals = self.ledger.totals
        assert totals is not None
        return RecoverResult(
            ledger=self.ledger,
            lineage=self.lineage_records(self.final_head().name),
            final_ckpt=Path(totals.final_ckpt),
            val_bpc=totals.val_bpc,
        )


TAGS = {"loss": "train/loss", **{key: LOGGED_AS.get(key, key) for key in STEP_SCALARS}}
"""The per-step tags of the stitched run: those every branch logs (``TinyGPTModule``)."""


def write_stitched_run(
    run_dir: Path, records: Sequence[dict[str, Any]], spikes: Sequence[dict[str, Any]] = ()
) -> None:
    """Write the accepted lineage as one TensorBoard run, each step once: the same tags
    as the branches, validation at the index of its last step (as Lightning logs it)."""
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(run_dir, ignore_errors=True)
    steps = [int(r["step"]) for r in records if "step" in r]
    if len(steps) != len(set(steps)):
        raise RuntimeError(f"the stitched lineage holds a step twice: {sorted(steps)}")
    writer = SummaryWriter(log_dir=str(run_dir))
    try:
        for record in records:
            if "step" in record:
                for key, tag in TAGS.items():
                    if key in record:
                        writer.add_scalar(tag, float(record[key]), int(record["step"]))
                if record.get("skipped"):
                    writer.add_scalar("skip_step/skipped", 1.0, int(record["step"]))
            else:
                writer.add_scalar("val/bpc", float(record["val_bpc"]), int(record["val_step"]) - 1)
        for spike in spikes:
            writer.add_scalar(f"spike/{spike['metric']}", float(spike["value"]), int(spike["step"]))
    finally:
        writer.close()


def recover(
    config: RecoverConfig,
    console: Console | None = None,
    progress_bar: bool = False,
    extra_callbacks: Callable[[BranchRecord], Sequence[Callback]] | None = None,
    fresh: bool = False,
) -> RecoverResult:
    """Run (or continue, from its ledger) the recovery loop; see the module docstring.

    Raises:
        ValueError: a ledger under ``config.log_root`` written with other arguments.
    """
    loop = RecoveryLoop(config, console, progress_bar, extra_callbacks, fresh)
    try:
        result = loop.run()
    finally:
        loop.close()
    if console is not None:
        print_ledger(result.ledger, loop.console)  # quiet on every rank but 0
    return result


# ----------------------------------------------------------------------------- report


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_ledger(ledger: Ledger, console: Console | None = None) -> None:
    """The ledger as tables: each spike and remedy tried, the totals, the comparison."""
    console = console or Console()
    table = Table(title="Spike recovery ledger")
    for column in ("spike", "checkpoint", "remedy", "outcome"):
        table.add_column(column)
    for column in ("steps trained", "batches skipped", "wall time (s)"):
        table.add_column(column, justify="right")

    def add(first: bool, spike: str, ckpt: str, branch: BranchRecord, outcome: str) -> None:
        table.add_row(
            spike if first else "",
            ckpt if first else "",
            describe_remedy(branch.remedies[-1]) if branch.remedy else "none",
            outcome,
            str(branch.steps_trained),
            str(branch.batches_skipped),
            f"{branch.wall_s:.1f}",
        )

    for intervention in ledger.interventions:
        spike = intervention.spike
        value, reference = float(spike["value"]), float(spike.get("reference") or 0.0)
        label = f"#{intervention.index + 1} step {spike['step']}: {spike['metric']} {value:.3f}"
        if reference > 0:
            label += f" ({value / reference:.2f}x)"
        before = int(spike["step"]) - intervention.ckpt_step
        ckpt = f"step {intervention.ckpt_step} ({before} before)"
        for i, name in enumerate(intervention.tried):
            branch = ledger.branch(name)
            outcome = intervention.outcomes.get(name) or branch.status
            add(i == 0, label, ckpt, branch, outcome)
    for branch in ledger.branches:
        if branch.kind == "continue":
            add(True, branch.note, f"step {branch.start_step}", branch, "trained on as it was")
    console.print(table)
    totals = ledger.totals
    if totals is not None:
        share = totals.steps_recomputed / max(1, totals.steps_final)
        unrecovered = [int(s["step"]) for s in totals.unrecovered]
        lines = [
            f"Accepted lineage: {' -> '.join(totals.lineage)} ({totals.steps_final} steps)",
            f"Steps trained in all: {totals.steps_trained} = {totals.steps_final} + "
            f"{totals.steps_recomputed} recomputed ({share:.1%})"
            + (
                f", and {totals.steps_repeated} redone after interruptions"
                if totals.steps_repeated
                else ""
            )
            + f"; batches skipped: {totals.batches_skipped}; updates dropped by skip-step: "
            f"{len(totals.skip_stepped)}"
            + (f" {totals.skip_stepped}" if totals.skip_stepped else ""),
            f"Unrecovered spikes: {unrecovered or 'none'}; val bits/char "
            f"{_fmt(totals.val_bpc)}; wall time {ledger.wall_s:.1f} s over "
            f"{ledger.sessions} session(s)",
            f"Final checkpoint: {totals.final_ckpt}",
        ]
        for line in lines:
            console.print(escape(line))
    if len(ledger.comparison) > 1:
        compare = Table(title="What the loop bought")
        compare.add_column("run")
        for column in ("val bits/char", "spikes flagged", "max attn logit after 1st spike"):
            compare.add_column(column, justify="right")
        for row in ledger.comparison:
            compare.add_row(
                row["run"],
                _fmt(row["val_bpc"]),
                str(row["spikes"]),
                _fmt(row["max_logit_after"], 1),
            )
        console.print(compare)


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    defaults = RecoverConfig()
    parser = argparse.ArgumentParser(
        prog="lit-spikes recover",
        description="Train with automatic spike recovery: detect, roll back to a real "
        "checkpoint, try remedies in a ladder, accept one, train on; resumable from its "
        "ledger (run it again with the same arguments after an interruption).",
    )
    add = parser.add_argument
    add(
        "--log-root",
        type=Path,
        help=f"runs, ledger, stitched run (default: --config's log_root, else {defaults.log_root})",
    )
    add(
        "--config",
        type=Path,
        help="YAML (or JSON) file of RecoverConfig fields, e.g. configs/recover.yaml "
        "(flags override it)",
    )
    add("--steps", type=int, help="global step to train to (default: the schedule's end)")
    add("--model-seed", type=int, help=f"default {defaults.model_seed}")
    add("--data-seed", type=int, help=f"default {defaults.data.seed}")
    add("--peak-lr", type=float, help=f"default {defaults.optim.peak_lr}")
    add("--qk-norm", action="store_true", default=None, help="train with QK-norm")
    add("--poison", type=int, nargs="+", help="plant bad batches at these data positions")
    add("--checkpoint-every", type=int, help=f"default {defaults.checkpoint_every}")
    add("--val-every", type=int, help=f"default {defaults.val_every}; 0: only at the end")
    add("--rollback-distance", type=int, help=f"default {defaults.rollback_distance}")
    add("--ladder", type=str, help=f"comma-separated remedies (default {','.join(REMEDIES)})")
    add("--skip-before", type=int, help=f"default {defaults.skip_before}")
    add("--skip-length", type=int, help=f"default {defaults.skip_length}")
    add("--lr-factor", type=float, help=f"default {defaults.lr_factor}")
    add("--skip-step-sigma", type=float, help=f"default {defaults.skip_step_sigma}")
    add("--skip-step-window", type=int, help=f"default {defaults.skip_step_window}")
    add("--clip-norm", type=float, help=f"default {defaults.clip_norm}")
    add("--accept-margin", type=int, help=f"default {defaults.accept_margin}")
    add("--max-interventions", type=int, help=f"default {defaults.max_interventions}")
    add("--max-branches", type=int, help=f"default {defaults.max_branches}")
    add("--detector-ratio", type=float, help=f"default {defaults.detector.ratio}")
    add("--detector-window", type=int, help=f"default {defaults.detector.window}")
    add("--compare", action="store_true", default=None, help="add do-nothing and QK-norm rows")
    add("--devices", type=int, help="processes per machine; > 1 trains with DDP (default 1)")
    add("--num-nodes", type=int, help="machines, each running this command (default 1)")
    add("--strategy", type=str, help="auto or ddp (default auto: ddp when > 1 process)")
    add("--fresh", action="store_true", help="discard an existing ledger and its runs")
    add("--progress", action="store_true", help="show Lightning's progress bar per branch")
    return parser


def config_from_args(args: argparse.Namespace) -> RecoverConfig:
    """A config from ``--config`` (if given) with the flags on top.

    Raises:
        ValueError: a bad value (named by the dataclass that refuses it).
        OSError: an unreadable ``--config`` file.
    """
    data: dict[str, Any] = {}
    if args.config:
        try:  # YAML (configs/recover.yaml); JSON is YAML too
            loaded = yaml.safe_load(args.config.read_text())
        except yaml.YAMLError as error:
            raise ValueError(f"--config {args.config} is not valid YAML: {error}") from None
        if not isinstance(loaded, dict | None):
            raise ValueError(
                f"--config {args.config} holds a {type(loaded).__name__}, not a mapping of "
                "settings (see configs/recover.yaml)"
            )
        data = loaded or {}
    if args.log_root is not None:
        data["log_root"] = str(args.log_root)
    flat = {
        "max_steps": args.steps,
        "model_seed": args.model_seed,
        "checkpoint_every": args.checkpoint_every,
        "rollback_distance": args.rollback_distance,
        "skip_before": args.skip_before,
        "skip_length": args.skip_length,
        "lr_factor": args.lr_factor,
        "skip_step_sigma": args.skip_step_sigma,
        "skip_step_window": args.skip_step_window,
        "clip_norm": args.clip_norm,
        "accept_margin": args.accept_margin,
        "max_interventions": args.max_interventions,
        "max_branches": args.max_branches,
        "compare": args.compare,
        "devices": args.devices,
        "num_nodes": args.num_nodes,
        "strategy": args.strategy,
    }
    data.update({k: v for k, v in flat.items() if v is not None})
    if args.val_every is not None:
        data["val_every"] = args.val_every or None  # 0: only at the end
    if args.ladder is not None:
        data["ladder"] = [r.strip() for r in args.ladder.split(",") if r.strip()]
    for section, key, value in (
        ("data", "seed", args.data_seed),
        ("data", "poison", args.poison),
        ("optim", "peak_lr", args.peak_lr),
        ("gpt", "qk_norm", args.qk_norm),
        ("detector", "ratio", args.detector_ratio),
        ("detector", "window", args.detector_window),
    ):
        if value is not None:
            if data.get(section) is None:  # absent, or "data:" left empty in the file
                data[section] = {}
            if not isinstance(data[section], dict):
                raise ValueError(f"RecoverConfig {section}: {data[section]!r} is not a mapping")
            data[section][key] = value
    return RecoverConfig.from_dict(data)


def main(argv: Sequence[str] | None = None) -> RecoverResult:
    """``lit-spikes recover``; exits 128 + the signal number when a signal stopped it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError, OSError) as error:
        parser.error(str(error))
    if config.log_root.exists() and not config.log_root.is_dir():
        parser.error(f"--log-root {config.log_root} is a file, not a directory")
    problem = unwritable_directory(config.log_root)
    if problem is not None:
        parser.error(f"--log-root {config.log_root} {problem}: choose a writable directory")
    console = Console() if Console().is_terminal else Console(width=160)
    try:
        return recover(config, console, progress_bar=args.progress, fresh=args.fresh)
    except RankZeroStopped:
        raise SystemExit(0) from None  # rank 0 says why, and exits with the status
    except SIGTERMException:
        # Lightning's own handler (outside a branch's training): SystemExit(None), status 0
        raise SystemExit(128 + signal.SIGTERM) from None
    except _Interrupted as stop:
        if getattr(rank_zero_only, "rank", 0) != 0:
            raise SystemExit(0) from None  # as above: Lightning's launcher would kill rank 0
        console.print(
            f"Stopped by {signal.Signals(stop.signum).name}; the ledger "
            f"{config.log_root / LEDGER_NAME} says where: run the same command to continue."
        )
        raise SystemExit(128 + stop.signum) from None
    except (LedgerMismatch, LedgerUnreadable, NotALogRoot) as error:
        parser.error(str(error))
    except CheckpointError as error:  # one the ledger names, gone (a moved or copied root)
        parser.error(
            f"{error}. The ledger {config.log_root / LEDGER_NAME} names the checkpoints it "
            "goes on from: continue it where they are, or start anew with --fresh"
        )
    except RunDirectoryBusy as error:
        # Another recover (or fit) trains there: not a crash, a scheduler may retry later.
        console.print(f"lit-spikes recover: error: {error}")
        raise SystemExit(os.EX_TEMPFAIL) from None


if __name__ == "__main__":
    main()
