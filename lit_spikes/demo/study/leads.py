"""Early warning: did a signal cross its own threshold before the loss spiked, and how
many steps before? The signals: the largest attention logit, the gradient norm (before
clipping) and each transformer block's update norm, ``|theta_after - theta_before|``,
which ``UpdateNormRecorder`` records during the reference runs."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_spikes.checkpoints import atomic_write
from lit_spikes.demo.study.config import LeadConfig
from lit_spikes.tools.study import crossings as crossings

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


class UpdateNormRecorder(Callback):
    """Records the L2 norm of each transformer block's update at every step (the change
    the optimizer step made to the block's parameters) and writes ``{step: [norm of
    block 0, ...]}`` as JSON to ``path`` when training ends. It holds no state a
    checkpoint needs: a resume from its run's files does without it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.norms: dict[int, list[float]] = {}
        self._before: dict[int, list[torch.Tensor]] = {}
        self._params: dict[int, list[torch.Tensor]] = {}
        self._step = -1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        blocks: dict[int, list[torch.Tensor]] = {}
        for name, parameter in pl_module.named_parameters():
            match = _BLOCK.search(name)
            if match:
                blocks.setdefault(int(match[1]), []).append(parameter)
        self._params = dict(sorted(blocks.items()))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._step = trainer.global_step  # the step the module's history calls it
        self._before = {i: [p.detach().clone() for p in ps] for i, ps in self._params.items()}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self._before:
            return
        norms = []
        for i, params in self._params.items():
            squares = [
                (p.detach() - b).double().square().sum()
                for p, b in zip(params, self._before[i], strict=True)
            ]
            norms.append(float(torch.stack(squares).sum().sqrt()))
        self.norms[self._step] = norms
        self._before = {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        text = json.dumps({str(k): v for k, v in sorted(self.norms.items())})
        atomic_write(self.path, lambda handle: handle.write(text.encode()))


def lead(values: Mapping[int, float], onset: int, config: LeadConfig) -> int | None:
    """Steps from the signal's first crossing within ``config.lookback`` steps before
    ``onset`` (the onset itself included: lead 0) to the onset; None when it did not
    cross in that span."""
    near = [s for s in crossings(values, config) if onset - config.lookback <= s <= onset]
    return onset - near[0] if near else None


def signals(
    reference: Mapping[str, Any], update_norms: Mapping[str, Sequence[float]]
) -> dict[str, dict[int, float]]:
    """A reference run's signals by name: ``max_logit``, ``grad_norm`` and ``update/block<i>``."""
    history = reference["history"]
    out = {
        "max_logit": {int(r["step"]): r["max_logit"] for r in history},
        "grad_norm": {int(r["step"]): r["grad_norm"] for r in history},
    }
    for step, norms in update_norms.items():
        for i, norm in enumerate(norms):
            out.setdefault(f"update/block{i}", {})[int(step)] = norm
    return out


def spike_leads(
    reference: Mapping[str, Any], update_norms: Mapping[str, Sequence[float]], config: LeadConfig
) -> list[dict[str, Any]]:
    """For every spike the reference's detector flagged: its step and each signal's lead."""
    by_signal = signals(reference, update_norms)
    return [
        {
            "spike_step": int(spike["step"]),
            "leads": {
                name: lead(values, int(spike["step"]), config) for name, values in by_signal.items()
            },
        }
        for spike in reference["spikes"]
    ]


def summarize(all_leads: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per signal, across every flagged spike: how many had a warning before the spike
    (lead > 0), at it (lead 0) or none in the lookback, and the leads' median and range."""
    names = sorted({name for item in all_leads for name in item["leads"]})
    rows = []
    for name in names:
        values = [item["leads"].get(name) for item in all_leads]
        found = [v for v in values if v is not None]
        rows.append(
            {
                "signal": name,
                "spikes": len(values),
                "before": sum(v > 0 for v in found),
                "at_onset": sum(v == 0 for v in found),
                "none": len(values) - len(found),
                "median_lead": statistics.median(found) if found else None,
                "min_lead": min(found) if found else None,
                "max_lead": max(found) if found else None,
            }
        )
    return rows
