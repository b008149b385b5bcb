"""What a study runs: the seeds, the demos' setup, the remedies' placement, the sweep and
the early-warning thresholds. The defaults are the default preset's
(``configs/study/default.yaml``); ``configs/study/quick.yaml`` is the small one CI runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lit_spikes.demo.data import DataConfig
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import OptimConfig


@dataclass(frozen=True)
class SweepConfig:
    """The LR-sensitivity sweep (Wortsman et al., 2023): runs from scratch at each peak
    LR, with and without QK-norm, several seeds a point."""

    peak_lrs: list[float] = field(default_factory=lambda: [0.003, 0.01, 0.03, 0.1, 0.3])
    """Peak learning rates (the default spans two decades in five points)."""
    seeds: int = 3
    """Model seeds a point: 0, 1, ..."""
    steps: int = 200
    """Length of each sweep run."""
    warmup_steps: int = 50
    """Its linear warm-up."""

    def __post_init__(self) -> None:
        if not self.peak_lrs or any(not lr > 0 for lr in self.peak_lrs):
            raise ValueError(f"sweep.peak_lrs={self.peak_lrs} must be positive LRs, at least one")
        if self.seeds < 1:
            raise ValueError(f"sweep.seeds={self.seeds} must be >= 1")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"sweep.warmup_steps={self.warmup_steps} must be in [0, sweep.steps={self.steps})"
            )


@dataclass(frozen=True)
class LeadConfig:
    """Early warning: a signal crosses its own threshold at a step where it exceeds
    ``ratio`` x the mean of its previous ``window`` values (the loss detector's rule)."""

    ratio: float = 1.4
    """How far above its rolling mean a signal must go."""
    window: int = 20
    """Steps of that rolling mean."""
    lookback: int = 20
    """Steps before a spike in which a crossing counts as a warning of it."""

    def __post_init__(self) -> None:
        if not self.ratio > 1:
            raise ValueError(f"leads.ratio={self.ratio} must be > 1")
        if self.window < 1 or self.lookback < 0:
            raise ValueError(
                f"leads.window={self.window} must be >= 1, leads.lookback={self.lookback} >= 0"
            )


@dataclass(frozen=True)
class StudyConfig:
    """The demos' experiment over many seeds, and the sweep."""

    model_seeds: list[int] = field(default_factory=lambda: list(range(12)))
    """Initialisation seeds; every one is crossed with every data seed."""
    data_seeds: list[int] = field(default_factory=lambda: [0])
    """Data-order seeds."""
    steps: int = 400
    """Length of every run of a seed (the demos' 400)."""
    warmup_steps: int = 100
    """Linear warm-up; the detector flags spikes from this step on."""
    peak_lr: float = 0.1
    """Peak LR of the seeds' runs (the demos' deliberately unstable 0.1)."""
    n_layer: int = 4
    """Transformer blocks."""
    d_model: int = 64
    """Width."""
    checkpoint_every: int = 50
    """Each reference run writes ``step=<k>.ckpt`` every this many steps."""
    spike_ratio: float = 1.4
    """The reference's detector flags a loss above this x the mean of its last 20 steps
    (``SpikeDetector``'s default; its window and warm-up are the detector's too)."""
    rollback_distance: int = 20
    """Remedies resume from the newest checkpoint at least this many steps before the
    seed's first post-warm-up spike (the demos' 20)."""
    no_spike_step: int = 150
    """For a seed without a post-warm-up spike, the remedies are placed as if it spiked
    here (the checkpoint and the skip windows alike)."""
    skip_window: int = 30
    """Data positions each PaLM skip window covers."""
    other_data_seed: int = 7
    """The 'another data seed' resume's data seed (plus the seed's own data seed)."""
    clip_val: float = 1.0
    """Gradient clipping norm of the clipping remedy."""
    lr_scale: float = 0.5
    """The LR remedy's factor (OPT halved it)."""
    recurrence: float = 0.5
    """diagnose's bar (its ``DiagnoseConfig.recurrence``, the one judgement recover
    shares): an other-data replay rising this share of the spike's rise brings it back."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """The LR-sensitivity sweep."""
    leads: LeadConfig = field(default_factory=LeadConfig)
    """Early-warning thresholds."""
    log_root: Path = Path("runs/study")
    """Where every cell's run directory, the report and the figures go."""
    figures_dir: Path | None = None
    """A second place for the figures (``docs/figures``)."""
    workers: int = 0
    """Worker processes, one torch thread each (0: one per usable core)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_root", Path(self.log_root))  # a str is fine too
        if self.figures_dir is not None:
            object.__setattr__(self, "figures_dir", Path(self.figures_dir))
        if not self.spike_ratio > 1:
            raise ValueError(f"spike_ratio={self.spike_ratio} must be > 1")
        if not self.model_seeds or not self.data_seeds:
            raise ValueError("model_seeds and data_seeds must each name at least one seed")
        for name in ("model_seeds", "data_seeds"):
            seeds = getattr(self, name)
            if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
                raise ValueError(f"{name}={seeds} must be distinct seeds >= 0")
        if not 0 < self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in (0, steps={self.steps})")
        if not 0 < self.checkpoint_every < self.steps:
            raise ValueError(
                f"checkpoint_every={self.checkpoint_every} must be in (0, steps={self.steps})"
            )
        if not self.checkpoint_every + self.rollback_distance <= self.no_spike_step < self.steps:
            raise ValueError(
                f"no_spike_step={self.no_spike_step} must be in [checkpoint_every + "
                f"rollback_distance, steps) = [{self.checkpoint_every + self.rollback_distance}"
                f", {self.steps}): a checkpoint must precede it"
            )
        if self.skip_window < 1 or self.rollback_distance < 0:
            raise ValueError("skip_window must be >= 1 and rollback_distance >= 0")
        if self.workers < 0:
            raise ValueError(f"workers={self.workers} must be >= 0 (0: one per core)")
        if not (self.clip_val > 0 and self.lr_scale > 0):
            raise ValueError("clip_val and lr_scale must be positive")
        if not 0 < self.recurrence <= 1:
            raise ValueError(f"recurrence={self.recurrence} must be in (0, 1] (diagnose's bar)")
        GPTConfig(n_layer=self.n_layer, d_model=self.d_model)  # its own checks
        self.optim()

    @property
    def seeds(self) -> list[tuple[int, int]]:
        """Every (model seed, data seed) pair, in order."""
        return [(m, d) for d in self.data_seeds for m in self.model_seeds]

    def gpt(self, qk_norm: bool = False) -> GPTConfig:
        return GPTConfig(n_layer=self.n_layer, d_model=self.d_model, qk_norm=qk_norm)

    def optim(self) -> OptimConfig:
        return OptimConfig(
            peak_lr=self.peak_lr, warmup_steps=self.warmup_steps, max_steps=self.steps
        )

    def data(self, seed: int) -> DataConfig:
        return DataConfig(seed=seed)

    def fingerprint(self) -> str:
        """What decides each cell's numbers: a log root holds the cells of one fingerprint.
        Not the seed lists (a cell of one seed does not depend on the others: more seeds
        reuse the cells done), nor where the files go, nor the workers."""
        numbers: dict[str, Any] = asdict(self)
        for key in ("log_root", "figures_dir", "workers", "model_seeds", "data_seeds"):
            numbers.pop(key)
        numbers["sweep"].pop("peak_lrs")
        numbers["sweep"].pop("seeds")
        text = json.dumps(numbers, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


QUICK: dict[str, Any] = {
    "model_seeds": [0, 1],
    "data_seeds": [0],
    "steps": 40,
    "warmup_steps": 10,
    "n_layer": 2,
    "d_model": 32,
    "checkpoint_every": 10,
    "rollback_distance": 5,
    "no_spike_step": 25,
    "skip_window": 6,
    "sweep": {"peak_lrs": [0.01, 0.1], "seeds": 1, "steps": 20, "warmup_steps": 5},
    "leads": {"window": 5, "lookback": 5},
    "log_root": "runs/study-quick",
}
"""``--quick``: the same cells on a tiny model, two seeds and short runs, in well under a
minute on 2 cores (what CI runs end to end). ``configs/study/quick.yaml`` is this."""
