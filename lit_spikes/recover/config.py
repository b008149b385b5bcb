"""The loop's settings: what to train (``RecoverConfig``) and what counts as a spike
(``DetectorConfig``), checked when built, and read from plain JSON/YAML data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lit_spikes.callbacks import SpikeDetector
from lit_spikes.data import DataConfig, data_config_from_dict, plain_config
from lit_spikes.model import GPTConfig
from lit_spikes.module import DEFAULT_MODEL_SEED, OptimConfig

REMEDIES = ("skip_data", "scale_lr", "skip_step", "clip")
"""The remedies a ladder may name, in the default order."""


def _names(value: Any) -> tuple[str, ...]:
    """A sequence of names; one name alone is a sequence of one (``ladder: scale_lr``),
    not of its letters."""
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class DetectorConfig:
    """The ``SpikeDetector`` every branch runs (see its docstring for the meaning)."""

    monitor: tuple[str, ...] = ("loss",)
    window: int = 20
    warmup: int = 20
    ratio: float | None = 1.4
    z_score: float | None = None
    min_step: int | None = None
    """No flag before this global step (None: the end of the LR warm-up)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "monitor", _names(self.monitor))
        if self.min_step is not None and self.min_step < 0:
            raise ValueError(f"DetectorConfig.min_step={self.min_step} must be >= 0 or None")
        self.build(0)  # the detector's own checks, with its own messages

    def build(self, default_min_step: int) -> SpikeDetector:
        """A detector that records spikes; stopping is the loop's gate's job."""
        return SpikeDetector(
            monitor=self.monitor,
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
        self._check_ladder()
        self._check_counts()
        self._check_remedies()
        self._check_processes()

    def _check_ladder(self) -> None:
        if self.steps < 1:
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

    def _check_counts(self) -> None:
        steps = self.steps
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

    def _check_remedies(self) -> None:
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

    def _check_processes(self) -> None:
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
