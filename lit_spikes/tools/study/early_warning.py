"""Early-warning signals of a study, with their false alarms: does a signal cross its own
threshold in the steps before a spike, and how often does it cross where none follows?

Signals, recorded in every seed's reference run: the gradient norm (before clipping),
each block's update norm ``|theta_after - theta_before|`` (``BlockUpdateNorms``: Marin's
32B report saw update norms spike before the loss), the monitored curve's own trend (its
mean over the last few steps), and each of the module's ``ToolFacts.columns`` it logs
(the demo's largest attention logit). docs/study.md defines the counts."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lit_spikes.checkpoints import atomic_write
from lit_spikes.shared.layers import find_layers, l2_norm
from lit_spikes.tools.study.findings import wilson

UPDATE_NORMS = "update_norms.json"
"""In a reference run's directory: each block's update norm at each step."""


@dataclass(frozen=True)
class LeadConfig:
    """A signal crosses its threshold at a step where it exceeds ``ratio`` x the mean of
    its previous ``window`` values (the loss detector's ratio rule)."""

    ratio: float = 1.4
    """How far above its rolling mean a signal must go."""
    window: int = 20
    """Steps of that rolling mean (a signal's first ``window`` steps cross nothing)."""
    leads: list[int] = field(default_factory=lambda: [1, 5, 10, 20])
    """The leads judged: a crossing warns of a spike that comes within this many steps."""
    trend: int = 5
    """The monitored curve's trend: its mean over this many steps."""

    def __post_init__(self) -> None:
        if not self.ratio > 1:
            raise ValueError(f"leads.ratio={self.ratio} must be > 1")
        if self.window < 1 or self.trend < 1:
            raise ValueError(
                f"leads.window={self.window} and leads.trend={self.trend} must be >= 1"
            )
        leads = sorted(self.leads)
        if not leads or leads[0] < 1 or len(set(leads)) != len(leads):
            raise ValueError(f"leads.leads={self.leads} must be distinct leads >= 1, at least one")
        object.__setattr__(self, "leads", leads)


def find_blocks(module: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The module's blocks by their names, found by its structure (``find_layers``): a
    transformer's blocks, else an MLP's layers; each block's parameters."""
    layers, blocks = find_layers(module)
    return {name: list(layers[name].parameters()) for name in blocks}


class BlockUpdateNorms(Callback):
    """Records the L2 norm of each block's update at every step (what the optimizer step
    changed in the block's parameters; ``find_blocks``) and writes ``{block: {step:
    norm}}`` to ``path`` when training ends. It changes nothing the run computes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.norms: dict[str, dict[int, float]] = {}
        self._blocks: dict[str, list[nn.Parameter]] = {}
        self._before: dict[str, list[torch.Tensor]] = {}
        self._step = -1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._blocks = find_blocks(pl_module)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._step = trainer.global_step
        self._before = {b: [p.detach().clone() for p in ps] for b, ps in self._blocks.items()}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        for block, params in self._blocks.items() if self._before else []:
            deltas = [p.detach() - b for p, b in zip(params, self._before[block], strict=True)]
            self.norms.setdefault(block, {})[self._step] = l2_norm(deltas)
        self._before = {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        text = json.dumps(self.norms)
        atomic_write(self.path, lambda handle: handle.write(text.encode()))


def signals(
    records: Sequence[Mapping[str, Any]],
    update_norms: Mapping[str, Mapping[Any, float]],
    columns: Sequence[str],
    trend: int,
) -> dict[str, dict[int, float]]:
    """A reference run's signals by name, each ``{step: value}``."""
    steps = [r for r in records if "step" in r]
    out: dict[str, dict[int, float]] = {
        "grad_norm": {int(r["step"]): float(r["grad_norm"]) for r in steps if "grad_norm" in r},
    }
    losses = [(int(r["step"]), float(r["loss"])) for r in steps]
    out[f"loss trend ({trend}-step mean)"] = {
        step: sum(v for _, v in losses[i + 1 - trend : i + 1]) / trend
        for i, (step, _) in enumerate(losses)
        if i + 1 >= trend
    }
    for key in columns:
        values = {int(r["step"]): float(r[key]) for r in steps if key in r}
        if values:
            out[key] = values
    for block, norms in update_norms.items():
        out[f"update {block}"] = {int(step): float(v) for step, v in norms.items()}
    return {name: values for name, values in out.items() if values}


class CrossingRule(Protocol):
    """What a crossing is: above ``ratio`` x the mean of the previous ``window`` values."""

    @property
    def ratio(self) -> float: ...
    @property
    def window(self) -> int: ...


def crossings(values: Mapping[int, float], config: CrossingRule) -> list[int]:
    """The steps at which a signal exceeds ``config.ratio`` x the mean of its previous
    ``config.window`` values (none before a full window)."""
    steps = sorted(values)
    out = []
    for i in range(config.window, len(steps)):
        previous = [values[s] for s in steps[i - config.window : i]]
        if values[steps[i]] > config.ratio * (sum(previous) / len(previous)):
            out.append(steps[i])
    return out


@dataclass
class LeadCount:
    """One signal's alarms at one lead, summed over the seeds' reference runs."""

    lead: int
    alarms: int = 0
    """Crossings judged (at a step no spike was flagged)."""
    true_alarms: int = 0
    """Crossings a spike's onset followed within ``lead`` steps."""
    spikes: int = 0
    warned: int = 0
    """Spikes with a crossing in the ``lead`` steps before their onset."""
    steps: int = 0
    followed: int = 0
    """Steps judged that a spike's onset followed within ``lead`` steps (chance's count)."""

    @property
    def precision(self) -> float:
        return self.true_alarms / self.alarms if self.alarms else float("nan")

    @property
    def chance(self) -> float:
        """The precision of an alarm raised at random steps."""
        return self.followed / self.steps if self.steps else float("nan")

    @property
    def better_than_chance(self) -> bool:
        """The precision's 95% Wilson interval lies above chance."""
        return bool(self.alarms) and wilson(self.true_alarms, self.alarms)[0] > self.chance


def count_run(
    values: Mapping[int, float],
    onsets: Sequence[int],
    flagged: set[int],
    config: LeadConfig,
    counts: Sequence[LeadCount],
    first_step: int,
) -> None:
    """Add one run's alarms of one signal to ``counts`` (one per lead). Judged: the
    stretches between spikes, from ``first_step`` (the detector's), each step with a full
    window behind it; not a flagged step (a crossing there is the spike itself) nor one
    whose window holds a spike's onset (its aftermath: the signal measured against a
    mean the spike is in)."""
    steps = sorted(values)[config.window :]
    after = {s + i for s in onsets for i in range(config.window)}
    judged = [s for s in steps if s >= first_step and s not in flagged | after]
    crossed = set(crossings(values, config))
    for count in counts:
        lead = count.lead

        def followed(step: int, lead: int = lead) -> bool:
            return any(step < onset <= step + lead for onset in onsets)

        alarms = [s for s in judged if s in crossed]
        count.alarms += len(alarms)
        count.true_alarms += sum(map(followed, alarms))
        count.steps += len(judged)
        count.followed += sum(map(followed, judged))
        count.spikes += len(onsets)
        count.warned += sum(any(onset - lead <= s < onset for s in alarms) for onset in onsets)


def early_warning(
    references: Sequence[Mapping[str, Any]],
    log_root: Path,
    columns: Sequence[str],
    config: LeadConfig,
    first_step: int,
) -> dict[str, list[LeadCount]]:
    """Each signal's counts at each lead over the seeds' reference runs (results)."""
    table: dict[str, list[LeadCount]] = {}
    for reference in references:
        path = log_root / reference["name"] / UPDATE_NORMS
        norms = json.loads(path.read_text()) if path.is_file() else {}
        flagged = {int(s["step"]) for s in reference["spikes"]}
        found = signals(reference["records"], norms, columns, config.trend)
        for name, values in found.items():
            counts = table.setdefault(name, [LeadCount(lead) for lead in config.leads])
            count_run(values, reference["onsets"], flagged, config, counts, first_step)
    return table


def verdict(table: Mapping[str, Sequence[LeadCount]]) -> str:
    """Which signal warns best (the highest recall among the leads whose precision is
    better than chance; then precision), or that none does better than chance."""
    good = [(name, c) for name, counts in table.items() for c in counts if c.better_than_chance]
    if not good:
        spikes = max((c.spikes for counts in table.values() for c in counts), default=0)
        return f"No signal warns better than chance on this module ({spikes} spikes)."
    name, best = max(
        good, key=lambda item: (item[1].warned / max(item[1].spikes, 1), item[1].precision)
    )
    lo, hi = wilson(best.true_alarms, best.alarms)
    return (
        f"{name} warns best: at lead {best.lead}, {best.warned} of {best.spikes} spikes warned, "
        f"precision {best.precision:.2f} (95% {lo:.2f}-{hi:.2f}) against chance "
        f"{best.chance:.2f}, {best.alarms - best.true_alarms} false alarms."
    )
