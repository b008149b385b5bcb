"""Each branch's ``history.jsonl``: one JSON record a line, appended as each step and each
validation happens (so a branch killed at any moment keeps what it trained), after a
first line that names the file's format version."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks import SkipStep, SpikeDetector
from lit_spikes.callbacks.common import trainer_callbacks
from lit_spikes.callbacks.watch import (
    GRAD_NORM,
    LOSS,
    measured_grad_norm,
    note_grad_norm,
    read_back,
)
from lit_spikes.loader import positioned
from lit_spikes.tools.recover.ledger import Ledger, UnknownFormatVersion, atomic_write_text

HISTORY_NAME = "history.jsonl"
HISTORY_VERSION = 3
"""The history format this code writes (its first line: ``{"history_version": 3}``):
version 2's step records hold ``max_logit`` only where the module logs one; version 3's
validation records hold every ``val*`` metric logged (``val``; those written before this
version held ``val/bpc`` also as ``val_bpc``, which is still read)."""
HISTORY_VERSIONS = (1, 2, 3)
"""The history formats this code reads; a file without the first line is of version 1
(written before the line existed)."""
_HEADER = "history_version"


def _header() -> str:
    return json.dumps({_HEADER: HISTORY_VERSION}) + "\n"


def read_history(path: Path) -> list[dict[str, Any]]:
    """The records of a branch's ``history.jsonl`` (a torn last line is dropped).

    Raises:
        UnknownFormatVersion: the file is of a format version this code does not read.
    """
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the process died mid-line: that record is recomputed on resume
    if records and _HEADER in records[0]:
        version = records.pop(0)[_HEADER]
        if version not in HISTORY_VERSIONS:
            raise UnknownFormatVersion(path, version, HISTORY_VERSIONS)
    return records


def write_history(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace the file by ``records``, atomically (a resumed branch's cut-back file)."""
    atomic_write_text(path, _header() + "".join(json.dumps(r) + "\n" for r in records))


def records_before(path: Path, start: int) -> list[dict[str, Any]]:
    """The records of the steps before ``start`` and of the validations up to it: what
    a branch resumed from its step-``start`` checkpoint keeps."""
    return [
        r
        for r in read_history(path)
        if ("step" in r and r["step"] < start) or ("val_step" in r and r["val_step"] <= start)
    ]


def lineage_records(ledger: Ledger, root: Path, head: str) -> list[dict[str, Any]]:
    """The per-step records (and validations) of the lineage ending in ``head``, read
    from each branch's history under ``root``."""
    records: list[dict[str, Any]] = []
    for branch, first, end in ledger.lineage(head):
        for record in read_history(root / branch.name / HISTORY_NAME):
            if "step" in record:
                keep = record["step"] >= first and (end is None or record["step"] < end)
            else:
                step = record["val_step"]
                keep = step > first and (end is None or step <= end)
            if keep:
                records.append(record)
    return records


class StepClock(Callback):
    """The global step of the batch being trained (``trainer.global_step`` at its start:
    the optimizer has counted it by the batch's end) and its LR (listed after the
    remedies: an ``LRScaler``'s scaled one)."""

    def __init__(self) -> None:
        self.step = -1
        self.lr: float | None = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        self.step = trainer.global_step
        if trainer.optimizers:
            self.lr = float(trainer.optimizers[0].param_groups[0]["lr"])


def step_record(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    outputs: Any,
    clock: StepClock,
    columns: Sequence[str] = (),
) -> dict[str, Any]:
    """The record of step ``step``, just trained: the module's own when it keeps one
    (a ``history`` list whose last record is of this step: the demo's loss, max_logit,
    lr, position), else built here: the step's loss (its ``outputs``, else the logged
    ``loss``), the LR of the first optimizer as the step began, and the data position of
    the step (the step itself when the data is not positioned). Each of the module's
    ``columns`` (``ToolFacts.columns``' keys) that the record lacks is read from what
    the module logged this step (``self.log``: ``callback_metrics``)."""
    step = clock.step
    history = getattr(pl_module, "history", None)
    if isinstance(history, list) and history and history[-1].get("step") == step:
        record = dict(history[-1])
    else:
        record = {"step": step, "loss": _loss(trainer, outputs)}
        if clock.lr is not None:
            record["lr"] = clock.lr
        data = positioned(trainer)
        record["position"] = step if data is None else int(data.position_of_step(step))
    for key in columns:
        value = trainer.callback_metrics.get(key)
        if key not in record and isinstance(value, torch.Tensor) and value.numel() == 1:
            record[key] = float(value)
    return record


def global_record(
    record: dict[str, Any], ranks: list[list[float]], columns: Sequence[str]
) -> dict[str, Any]:
    """``record`` (this rank's) with the global values of the step: ``ranks`` holds each
    rank's ``[loss, *columns]`` (NaN where a rank has none). The loss is their mean, as the
    detector judges it, with each rank's as ``rank_loss``; a column is the largest (a
    comparison column is the largest value of a run), NaN if any rank's is, and left out
    where no rank has one."""
    losses = [row[0] for row in ranks]
    record = {**record, "loss": sum(losses) / len(losses), "rank_loss": losses}
    for index, key in enumerate(columns, start=1):
        values = [row[index] for row in ranks]
        if key in record or not all(map(math.isnan, values)):
            record[key] = math.nan if any(map(math.isnan, values)) else max(values)
    return record


def _loss(trainer: pl.Trainer, outputs: Any) -> float:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if loss is None:
        loss = trainer.callback_metrics.get("loss")
    return math.nan if loss is None else float(loss)


class HistoryLog(Callback):
    """Appends each step's record, and each validation's bits/char, to ``history.jsonl``
    as it happens, so a branch killed at any moment keeps what it trained.

    ``columns``: the module's comparison columns (``ToolFacts.columns``' keys), recorded
    each step where the module logs them, as is each logged name a ``SpikeDetector`` of
    the run watches, and the gradient norm (the accepted run's curves of them). Under DDP
    every rank runs it (the records hold
    the global values, ``global_record``: the loss averaged over the ranks' shards, as the
    detector judges it, and each column's largest, from one ``all_gather`` per step) and
    rank 0 alone writes."""

    def __init__(
        self, path: Path, clock: StepClock, write: bool = True, columns: Sequence[str] = ()
    ) -> None:
        self.path, self.clock, self.write = path, clock, write
        self.columns = self._given = tuple(columns)
        self.last: dict[str, Any] | None = None
        """The last step's record (its global values, on every rank)."""
        self._handle: Any = None

    def _write(self, record: dict[str, Any]) -> None:
        if not self.write:
            return
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            if self._handle.tell() == 0:  # a new file: its format first
                self._handle.write(_header())
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        watched = [
            name
            for callback in trainer_callbacks(trainer)
            if isinstance(callback, SpikeDetector)
            for name in callback.monitors
            if name not in (LOSS, GRAD_NORM)
        ]
        self.columns = tuple(dict.fromkeys([*self._given, *watched]))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        note_grad_norm(trainer, pl_module)  # once a step for every watcher, before clipping

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        record = step_record(trainer, pl_module, outputs, self.clock, self.columns)
        norm = measured_grad_norm(trainer, self.clock.step)
        if GRAD_NORM not in record and norm is not None:
            record[GRAD_NORM] = float(norm)  # the same on every rank: gradients reduced
        if trainer.world_size > 1:
            row = [record["loss"], *(record.get(key, math.nan) for key in self.columns)]
            local = torch.tensor(row, dtype=torch.float64)
            gathered = trainer.strategy.all_gather(local).reshape(trainer.world_size, len(row))
            record = global_record(record, gathered.tolist(), self.columns)
        read_back(trainer)  # a SkipStep's decision of this step, from the device
        skipped = (
            cb.skipped_steps for cb in trainer_callbacks(trainer) if isinstance(cb, SkipStep)
        )
        if any(record["step"] in steps for steps in skipped):
            record["skipped"] = 1.0
        self.last = record
        self._write(record)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every validation metric the module logs (recover's comparison picks one that
        # every row has)
        metrics = {
            str(name): float(value)
            for name, value in trainer.callback_metrics.items()
            if str(name).startswith("val") and torch.as_tensor(value).numel() == 1
        }
        if not metrics or trainer.sanity_checking:
            return
        self._write({"val_step": trainer.global_step, "val": metrics})

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
