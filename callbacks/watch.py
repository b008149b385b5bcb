"""The values the lit-spikes callbacks watch, measured once a step for all of them, and
kept on the device: nothing here reads a tensor back to the host.

A name is ``"loss"`` (what ``training_step`` returns), ``"grad_norm"`` (the total L2 norm
of the gradients before any clipping, measured here) or a key of
``trainer.callback_metrics`` (what the module logs with ``self.log``, as ``EarlyStopping``
reads it). A step is the optimizer step: its loss is the sum of what its backward passes
were given (under ``accumulate_grad_batches=k`` Lightning hands each micro-batch's loss
divided by k: their mean), its gradient norm is measured once before the update, and a
logged key has a value at a step only if it was logged during that step's batches
(``trainer.callback_metrics`` keeps the last value of every key: an older one, or one
logged in validation, is no value of this step). Under several processes the values of
every watched name of every watching callback are gathered from all ranks in one
``all_gather`` a step (on the device: no host sync either).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.callbacks.common import trainer_callbacks

LOSS, GRAD_NORM = "loss", "grad_norm"


def monitor_names(monitor: str | Sequence[str], owner: str) -> tuple[str, ...]:
    """``monitor`` as a tuple of non-empty names, or a ValueError naming ``owner``."""
    names = (monitor,) if isinstance(monitor, str) else tuple(monitor)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"{owner}(monitor={monitor!r}): give a name or a list of names: 'loss', "
            "'grad_norm' or a key the module logs with self.log"
        )
    return names


class Watcher(Callback):
    """The base of the callbacks that judge steps by watched values (``monitors``) kept
    on the device (``SpikeDetector``, ``SkipStep``, recover's and the demo's own): each
    step a subclass adds a row of them to ``_pending`` (``step_values`` gives it), and
    ``read_back`` brings the rows of every watcher of the Trainer to the host in one read,
    at the start of every ``read_every``-th step (numbered from 0: every run reads at the
    same steps), at the fit's end and when a checkpoint takes their state; each watcher
    then judges its rows in ``take_rows``.

    Example:
        >>> class Printer(Watcher):
        ...     monitors = ("loss",)
        ...     def take_rows(self, trainer, rows):
        ...         print(rows)  # [(step, [loss]), ...], in step order
    """

    monitors: tuple[str, ...] = ()
    read_every: int = 50

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._trainer: pl.Trainer | None = None

    def take_rows(self, trainer: pl.Trainer | None, rows: list[tuple[int, list[float]]]) -> None:
        """Judge the rows read back: ``(step, [value of each monitor])``, in step order."""
        raise NotImplementedError

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer, self._pending = trainer, []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.read_every == 0:
            read_back(trainer)
        begin_batch(trainer)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        note_loss(trainer, loss)  # once per backward is enough; each watcher may be the only one

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        read_back(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = None

    def _read_own(self) -> None:
        """Read this watcher's rows back (with its Trainer's others, when it has one)."""
        if self._trainer is not None:
            read_back(self._trainer)
        elif self._pending:
            _read([self], None)


def read_back(trainer: pl.Trainer) -> None:
    """The pending rows of every watcher of ``trainer``, in one host read."""
    callbacks: list[Callback] = getattr(trainer, "callbacks", [])  # set on it, untyped
    _read([c for c in callbacks if isinstance(c, Watcher) and c._pending], trainer)


def _read(watchers: list[Watcher], trainer: pl.Trainer | None) -> None:
    if not watchers:
        return
    pending = [(w, w._pending) for w in watchers]
    rows = [row.reshape(-1).double() for _, rows in pending for _, row in rows]
    flat = torch.cat(rows).tolist()  # the one read
    start = 0
    for watcher, rows_of in pending:
        watcher._pending = []
        taken = []
        for step, row in rows_of:
            taken.append((step, flat[start : start + row.numel()]))
            start += row.numel()
        watcher.take_rows(trainer, taken)


@dataclass
class Values:
    """Each rank's values of some names at one step, on the device."""

    names: list[str]
    per_rank: torch.Tensor
    """(world_size, len(names)) float64; NaN where a rank has none."""
    present: torch.Tensor
    """(world_size, len(names)) bool: which rank has a value of which name."""
    here: list[bool]
    """Whether this rank has each name (known on the host)."""

    def reduced(self, how: str) -> torch.Tensor:
        """(len(names),) float64: the ``"mean"`` of the ranks that have a value (their
        shards being equal) or their ``"max"``; NaN where one of them is NaN or none has
        one. The same float on every rank (the same gathered tensor, the same order)."""
        if how == "max":
            low = torch.full_like(self.per_rank, -math.inf)
            top = torch.where(self.present, self.per_rank, low).amax(0)
            return torch.where(self.present.any(0), top, math.nan)
        total = torch.where(self.present, self.per_rank, 0.0).sum(0)
        return total / self.present.sum(0)

    def select(self, names: Sequence[str]) -> Values:
        index = [self.names.index(n) for n in names]
        return Values(
            list(names),
            self.per_rank[:, index],
            self.present[:, index],
            [self.here[i] for i in index],
        )


@dataclass
class _Step:
    step: int
    loss: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    gathered: Values | None = None
    extra: dict[str, Values] = field(default_factory=dict)
    """Names gathered later in the step (logged after the first gather)."""
    before: dict[str, Any] | None = None
    """The watched ``callback_metrics`` entries as the step's first batch began: an entry
    still set to the same memory was not logged in this step."""
    begun: bool = False
    """Whether a batch of this step began (``before`` taken then)."""
    noted: weakref.ref[torch.Tensor] | None = None
    """The last loss noted (the object each callback's ``on_before_backward`` is given),
    to tell a second watcher's call with it from the next backward's loss; weakly, not
    to keep its graph alive."""


# The step being trained, one per Trainer and shared by all its watchers (one loss, one
# gradient norm, one gather a step, whichever callbacks watch); weakly keyed: no attribute
# written into the Trainer, and a finished Trainer takes its record with it.
_STEPS: weakref.WeakKeyDictionary[pl.Trainer, _Step] = weakref.WeakKeyDictionary()


def _record(trainer: pl.Trainer, step: int) -> _Step:
    record = _STEPS.get(trainer)
    if record is None or record.step != step:
        # A step begun within a batch (a second optimizer's) keeps the batch's start.
        before = record.before if record is not None else None
        record = _STEPS[trainer] = _Step(step, before=before)
    return record


def _scaler(trainer: pl.Trainer) -> Any:
    """The precision plugin's GradScaler (16-mixed), or None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _logged_names(trainer: pl.Trainer) -> list[str]:
    return [n for n in _all_monitors(trainer) if n not in (LOSS, GRAD_NORM)]


def begin_batch(trainer: pl.Trainer) -> None:
    """At a batch's start (``on_train_batch_start``): at the first batch of an optimizer
    step, note which memory the watched ``callback_metrics`` entries point to, to tell a
    value logged in this step from an older one (no host read: tensor identity only)."""
    record = _record(trainer, trainer.global_step)
    if not record.begun:
        names = _logged_names(trainer)
        metrics = trainer.callback_metrics if names else {}
        record.before, record.begun = {n: metrics.get(n) for n in names}, True


def _fresh(record: _Step, name: str, value: Any) -> bool:
    """Whether ``value`` (of ``callback_metrics``) was logged in the step of ``record``.
    Lightning stores each ``self.log`` call's value as a new tensor, and hands out views of
    it: a view of the memory seen at the step's start is the older value."""
    if value is None:
        return False
    old = (record.before or {}).get(name)
    if old is None:
        return True
    if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor):
        return not value.is_set_to(old)
    return value is not old


def note_loss(trainer: pl.Trainer, loss: torch.Tensor) -> None:
    """Add the loss of a backward pass to the step being trained (``on_before_backward``,
    which a GradScaler hands the scaled loss: unscaled here); every watcher calls it, the
    first call per backward counts."""
    record = _record(trainer, trainer.global_step)
    if record.noted is not None and record.noted() is loss:
        return  # another watcher's call for the same backward
    record.noted, loss = weakref.ref(loss), loss.detach()
    scaler = _scaler(trainer)
    if scaler is not None:
        # The scale as a tensor on the device: get_scale() would read it back to the host.
        loss = loss / scaler._get_scale_async()
    record.loss = loss if record.loss is None else record.loss + loss


def note_grad_norm(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Measure the gradient norm of the step being trained once, before any clipping or
    skip drops it (``on_before_optimizer_step``)."""
    record = _record(trainer, trainer.global_step)
    if record.grad_norm is None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            record.grad_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def measured_grad_norm(trainer: pl.Trainer, step: int) -> torch.Tensor | None:
    """The gradient norm ``note_grad_norm`` measured at ``step`` (on the device), or None."""
    record = _STEPS.get(trainer)
    return record.grad_norm if record is not None and record.step == step else None


def _local(record: _Step, metrics: dict[str, Any], name: str, outputs: Any) -> Any:
    """This rank's value of ``name`` at the step of ``record``, or None."""
    if name == LOSS:
        value = record.loss
        if value is None and isinstance(outputs, dict):
            value = outputs.get("loss")
        return value
    if name == GRAD_NORM:
        return record.grad_norm
    value = metrics.get(name)
    return value if _fresh(record, name, value) else None


def _metrics(trainer: pl.Trainer, names: Sequence[str]) -> dict[str, Any]:
    """``trainer.callback_metrics``, read once (each read rebuilds it), if a name needs it."""
    return trainer.callback_metrics if any(n not in (LOSS, GRAD_NORM) for n in names) else {}


def _gather(trainer: pl.Trainer, record: _Step, names: list[str], outputs: Any) -> Values:
    device = trainer.strategy.root_device
    values, flags, here = [], [], []
    metrics = _metrics(trainer, names)
    for name in names:
        value = _local(record, metrics, name, outputs)
        usable = isinstance(value, torch.Tensor) and value.numel() == 1
        here.append(usable or isinstance(value, int | float))
        if isinstance(value, torch.Tensor) and usable:
            values.append(value.detach().reshape(()).to(device, torch.float64))
        else:  # a Python number, or none: filled on the device (a copy there would sync)
            number = float(value) if here[-1] else math.nan
            values.append(torch.full((), number, dtype=torch.float64, device=device))
        flags.append(torch.full((), float(here[-1]), dtype=torch.float64, device=device))
        if name == GRAD_NORM and here[-1] and _scaler(trainer) is not None:
            # An inf norm is a GradScaler's routine overflow (it skips that step): no value.
            flags[-1] = torch.isfinite(values[-1]).double()
    local, present = torch.stack(values), torch.stack(flags)  # (n,) each
    if trainer.world_size == 1:
        return Values(names, local[None], present[None].bool(), here)
    gathered = trainer.strategy.all_gather(torch.stack([local, present]))
    gathered = gathered.reshape(trainer.world_size, 2, len(names))
    return Values(names, gathered[:, 0], gathered[:, 1].bool(), here)


def _all_monitors(trainer: pl.Trainer) -> list[str]:
    names: list[str] = []
    for callback in trainer_callbacks(trainer):
        if isinstance(callback, Watcher):
            names += [n for n in callback.monitors if n not in names]
    return names


def step_values(
    trainer: pl.Trainer, step: int, names: Sequence[str], outputs: Any = None
) -> Values:
    """Each rank's values of ``names`` at ``step``, on the device. Gathered once a step for
    the names of every watching callback of the Trainer; a name this rank did not have at
    that gather but has now (logged later in the step) is gathered again."""
    record = _record(trainer, step)
    if record.gathered is None:
        wanted = list(dict.fromkeys([*_all_monitors(trainer), *names]))
        record.gathered = _gather(trainer, record, wanted, outputs)
    first = record.gathered
    late = [n for n in names if n not in first.names or not first.here[first.names.index(n)]]
    late = [n for n in late if n not in record.extra]
    metrics = _metrics(trainer, late)
    late = [n for n in late if _local(record, metrics, n, outputs) is not None]
    if late:
        again = _gather(trainer, record, late, outputs)
        record.extra.update({n: again.select([n]) for n in late})
    parts = [record.extra[n] if n in record.extra else first.select([n]) for n in names]
    return Values(
        list(names),
        torch.cat([p.per_rank for p in parts], dim=1),
        torch.cat([p.present for p in parts], dim=1),
        [p.here[0] for p in parts],
    )


def not_logged(owner: str, missing: list[str], trainer: pl.Trainer, step: int) -> str:
    """The error of a ``strict`` watcher whose ``missing`` keys were not logged at ``step``."""
    there = sorted(trainer.callback_metrics)
    stale = [n for n in missing if n in there]
    why = (
        f" ({stale} hold a value logged outside this step: at an earlier step, or in "
        "validation; a watcher judges each training step by its own values, EarlyStopping "
        "judges validation ones)"
        if stale
        else ""
    )
    return (
        f"{owner}: monitor {missing} not logged in training step {step}{why}; the module "
        f"logs {there}. Log it with self.log(..., on_step=True) in training_step at every "
        "step, or pass strict=False to judge only the steps that log it"
    )
