"""Per-layer instruments for a replay: each step's gradient, weight and update norms, the
optimizer's state, the layers' output statistics and the share of non-finite gradients.

Attached to a replay only, never to the run: they read tensors and change none (no
in-place op, no draw from an RNG), so the replay computes what the run computed, which
the forensics replay checks loss by loss. Every number is a host sync; a replay of a few
dozen steps pays that, a run would not."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lit_spikes.shared.layers import find_layers, l2_norm, named_layers

GRAD = ("grad_norm", "grad_nonfinite")
"""The statistics of the backward pass (the gradient before any clipping)."""
FORWARD = ("weight_norm", "act_mean", "act_std", "act_absmax", "act_kurtosis")
"""The statistics of the forward pass: the weights it ran with and its outputs."""
OPTIMIZER = ("update_norm", "update_ratio")
"""What the optimizer step did; each state tensor adds ``state_<key>_norm``."""


class _Moments:
    """The running moments of a layer's outputs over a step's micro-batches (float64)."""

    def __init__(self) -> None:
        self.count = 0
        self.sums = torch.zeros(4, dtype=torch.float64)
        self.absmax = 0.0

    def add(self, output: torch.Tensor) -> None:
        x = output.detach().to(torch.float64).flatten().cpu()
        finite = x[torch.isfinite(x)]
        self.count += finite.numel()
        powers = torch.stack([finite.sum(), finite.square().sum(), finite.pow(3).sum()])
        self.sums += torch.cat([powers, finite.pow(4).sum().reshape(1)])
        self.absmax = max(self.absmax, float(x.abs().max()) if x.numel() else 0.0)

    def stats(self) -> dict[str, float]:
        if self.count == 0:
            return {}
        m1, m2, m3, m4 = (float(s) / self.count for s in self.sums)
        variance = max(m2 - m1 * m1, 0.0)
        central4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1**4
        kurtosis = central4 / variance**2 if variance > 0 else math.nan
        return {
            "act_mean": m1,
            "act_std": math.sqrt(variance),
            "act_absmax": self.absmax,
            "act_kurtosis": kurtosis,
        }


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class LayerInstruments(Callback):
    """Each training step's statistics of each layer: ``records[step][layer][stat]``.

    Args:
        layers: the submodules to measure by name (None: ``find_layers``, every layer
            with parameters in the order registered, a transformer's blocks one by one).
    """

    def __init__(self, layers: Sequence[str] | None = None) -> None:
        self.names = None if layers is None else list(layers)
        self.layers: dict[str, nn.Module] = {}
        self.records: dict[int, dict[str, dict[str, float]]] = {}
        self._hooks: list[Any] = []
        self._moments: dict[str, _Moments] = {}
        self._before: dict[str, list[torch.Tensor]] = {}
        self._step = -1
        self._training = False
        self.seconds: dict[int, float] = {}
        """Each step's end on ``time.perf_counter``'s clock (the replay's pace)."""
        self.own_seconds = 0.0
        """The time spent in the instruments themselves, all steps together."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.names is None:
            self.layers = find_layers(pl_module)[0]
        else:
            self.layers = named_layers(pl_module, self.names)
        for name, layer in self.layers.items():
            self._hooks.append(layer.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def record(module: nn.Module, inputs: Any, output: Any) -> None:
            tensor = _first_tensor(output)
            if self._training and tensor is not None:
                start = time.perf_counter()
                with torch.no_grad():
                    self._moments.setdefault(name, _Moments()).add(tensor)
                self.own_seconds += time.perf_counter() - start

        return record

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self._step:  # a step's first micro-batch
            self._step, self._moments, self._before = trainer.global_step, {}, {}
        self._training = True

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        start = time.perf_counter()
        row = self.records.setdefault(self._step, {})
        for name, layer in self.layers.items():
            params = [p for p in layer.parameters() if p.requires_grad]
            grads = [p.grad.detach() for p in params if p.grad is not None]
            size = sum(g.numel() for g in grads)
            bad = sum(int((~torch.isfinite(g)).sum()) for g in grads)
            row[name] = {
                "grad_norm": l2_norm(grads),
                "grad_nonfinite": bad / size if size else math.nan,
                "weight_norm": l2_norm([p.detach() for p in params]),
            }
            self._before[name] = [p.detach().clone() for p in params]
        self.own_seconds += time.perf_counter() - start

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._training = False
        if not self._before:
            return  # a micro-batch before the step's last: no optimizer step yet
        start = self.seconds[self._step] = time.perf_counter()
        row = self.records[self._step]
        states = [o.state for o in trainer.optimizers]
        for name, layer in self.layers.items():
            params = [p for p in layer.parameters() if p.requires_grad]
            deltas = [p.detach() - b for p, b in zip(params, self._before[name], strict=True)]
            stats = row[name]
            stats["update_norm"] = l2_norm(deltas)
            weight = stats["weight_norm"]
            stats["update_ratio"] = stats["update_norm"] / weight if weight else math.nan
            stats |= _state_norms(params, states)
            stats |= self._moments[name].stats() if name in self._moments else {}
        self._before = {}
        self.own_seconds += time.perf_counter() - start

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _state_norms(params: Sequence[torch.Tensor], states: Sequence[Any]) -> dict[str, float]:
    """The norm of each optimizer state tensor shaped as its parameter, over ``params``
    (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``)."""
    found: dict[str, list[torch.Tensor]] = {}
    for param in params:
        for state in states:
            for key, value in (state.get(param) or {}).items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    found.setdefault(key, []).append(value.detach())
    return {f"state_{key}_norm": l2_norm(values) for key, values in found.items()}
