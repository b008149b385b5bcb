"""Per-step values kept on the device and read back in the watchers' one read, and the
masked optimizer step that puts a step's update back without reading its decision."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lit_spikes.callbacks.watch import Watcher

Row = tuple[dict[str, Any], str, list[float]]
"""A record read back: the record, the kind of values (the module's name), the values."""


def step_tensors(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every parameter and optimizer state tensor a step may change, and the parameters
    without state yet (the step creates theirs)."""
    live, fresh = [], []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            live.append(param)
            if state:
                live += [v for v in state.values() if torch.is_tensor(v)]
            else:
                fresh.append(param)
    return live, fresh


class MaskedStep:
    """Optimizer step hooks that put every parameter and optimizer state tensor back as
    it was before the step where ``skip`` (a 0-dim bool on the device, set during the
    step, before the optimizer applies it) is true: the step applies nothing, and no
    value is read back to decide it (``torch.where``, as ``SkipStep`` does); state the
    step created goes back to zeros, where AdamW's starts. Set ``skip`` to None before
    each step's closure. The copy goes to buffers kept from step to step: one ``cat``
    for each device and dtype. (AdamW's step counts live on the CPU for CUDA parameters,
    unless ``capturable`` or ``fused``: ``skip`` is copied there for them, a sync.)"""

    def __init__(self) -> None:
        self.skip: torch.Tensor | None = None
        self._hooks: list[RemovableHandle] = []
        self._live: list[torch.Tensor] = []
        self._fresh: list[torch.Tensor] = []
        self._copies: list[torch.Tensor] = []
        """A view of the buffers for each of ``_live``, shaped as it."""
        self._buffers: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        """For each device and dtype: its tensors of ``_live``, and their buffer."""

    def attach(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.detach()
        for optimizer in optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(self._before))
            self._hooks.append(optimizer.register_step_post_hook(self._after))

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.skip, self._live, self._buffers, self._copies = [], None, [], [], []

    def _allocate(self, live: list[torch.Tensor]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for tensor in live:
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        copies: dict[int, torch.Tensor] = {}
        self._buffers = []
        for (device, dtype), members in groups.items():
            sizes = [t.numel() for t in members]
            buffer = torch.empty(sum(sizes), device=device, dtype=dtype)
            for tensor, view in zip(members, torch.split(buffer, sizes), strict=True):
                copies[id(tensor)] = view.view_as(tensor)
            self._buffers.append((members, buffer))
        self._live, self._copies = live, [copies[id(t)] for t in live]

    def _before(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        # Before the update (and before the closure, unless a GradScaler ran it first).
        live, self._fresh = step_tensors(optimizer)
        same = len(live) == len(self._live)
        if not (
            same and all(a is b for a, b in zip(live, self._live, strict=True))
        ):  # the first step, or new tensors (a restore): new buffers
            self._allocate(live)
        with torch.no_grad():
            for members, buffer in self._buffers:
                torch.cat([t.detach().reshape(-1) for t in members], out=buffer)

    def _after(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        skip, self.skip = self.skip, None
        if skip is None or not self._live:
            return
        masks: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for now, before in zip(self._live, self._copies, strict=True):
                mask = masks.setdefault(now.device, skip.to(now.device))
                torch.where(mask, before, now, out=now)
            for param in self._fresh:
                for now in optimizer.state.get(param, {}).values():
                    if torch.is_tensor(now):
                        mask = masks.setdefault(now.device, skip.to(now.device))
                        torch.where(mask, torch.zeros_like(now), now, out=now)


class StepRecords(Watcher):
    """The device values of a module's per-step records (``TinyGPTModule``'s), read back
    with every watcher's rows in one host read: every ``read_every`` steps, at the fit's
    end, at a checkpoint, and whenever the module's ``history`` or ``nonfinite_steps`` is
    read."""

    def __init__(self, take: Callable[[pl.Trainer | None, list[Row]], None]) -> None:
        super().__init__()
        self.take = take
        """Receives the rows read back, in order: (record, kind, values)."""
        self._kinds: list[tuple[dict[str, Any], str]] = []

    def add(self, record: dict[str, Any], kind: str, values: torch.Tensor) -> None:
        """Keep ``values`` (1-dim, on the device) of ``record`` until the next read."""
        self._pending.append((int(record["step"]), values))
        self._kinds.append((record, kind))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.flush()  # what a fit that raised left unread (Watcher.setup drops it)
        super().setup(trainer, pl_module, stage)
        self._kinds = []

    @override
    def take_rows(self, trainer: pl.Trainer | None, rows: list[tuple[int, list[float]]]) -> None:
        kinds, self._kinds = self._kinds, []
        taken = [(*kind, values) for kind, (_, values) in zip(kinds, rows, strict=True)]
        self.take(trainer, taken)

    def pending(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        self._read_own()
