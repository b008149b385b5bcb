"""The loop's settings: what to train (``RecoverConfig``: a model and data as class paths
with their ``init_args``, the built-in tiny GPT and its world by default) and what counts
as a spike (``DetectorConfig``), checked when built, and read from plain JSON/YAML data."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lit_spikes.shared.plain import plain_config
from lit_spikes.tool_facts import DO_NOTHING, ToolFacts
from lit_spikes.tools.defaults import DEMO_DATA, DEMO_MODEL
from lit_spikes.tools.detector_config import DetectorConfig as DetectorConfig  # (its old home)
from lit_spikes.tools.factories import ClassPath, complete_args, stated_facts
from lit_spikes.tools.fit_defaults import check_num_threads
from lit_spikes.tools.judgement import RECURRENCE, check_bar
from lit_spikes.tools.recover.remedies import DEFAULT_LADDER, check_rung, rung_name

DEFAULT_MODEL = DEMO_MODEL
"""The built-in model (the project's default run)."""
DEFAULT_DATA = DEMO_DATA
"""The built-in data (the character world), built from its ``config`` (a ``DataConfig``)."""
FACTORY = "factory"
"""The key of a model or data given to ``run`` as a factory: ``{"factory": "<its name>"}``."""


def _names(value: Any) -> tuple[Any, ...]:
    """A sequence; one name or rung alone is a sequence of one, not of its letters."""
    return (value,) if isinstance(value, str | Mapping) else tuple(value)


def default_model() -> dict[str, Any]:
    """The built-in model's class path and ``init_args`` (the project's default run)."""
    return _model_dict({"class_path": DEFAULT_MODEL})


def default_data() -> dict[str, Any]:
    """The built-in data's class path and ``init_args`` (``config``: a ``DataConfig``)."""
    return _data_dict({"class_path": DEFAULT_DATA})


def _class_dict(value: Any, base: type, what: str) -> dict[str, Any]:
    """``value`` as plain data: its class path (checked to be a ``base``: a bad path fails
    here) and its ``init_args`` complete with the class's defaults, so equal settings
    compare equal (``complete_args``); a factory's record as it is."""
    if isinstance(value, Mapping) and FACTORY in value:
        return {FACTORY: str(value[FACTORY])}
    path = ClassPath.of(value, f"RecoverConfig.{what}")
    klass = path.klass(base, f"RecoverConfig.{what}")
    args = complete_args(klass, path.init_args, f"RecoverConfig {what}")
    return plain_config({"class_path": path.class_path, "init_args": args})  # type: ignore[no-any-return]


def _model_dict(value: Any) -> dict[str, Any]:
    """A model as plain data (``_class_dict``)."""
    return _class_dict(value, pl.LightningModule, "model")


def _data_dict(value: Any) -> dict[str, Any]:
    """The data as plain data (``_class_dict``)."""
    return _class_dict(value, pl.LightningDataModule, "data")


LOOP_TRAINER_ARGS = {
    "max_steps": "--max_steps", "max_epochs": "--max_steps", "val_check_interval": "--val_every",
    "check_val_every_n_epoch": "--val_every", "devices": "--devices", "num_nodes": "--num_nodes",
    "strategy": "--strategy", "callbacks": "--ladder", "logger": "--log_root",
    "default_root_dir": "--log_root", "enable_checkpointing": "--checkpoint_every",
}  # fmt: skip
"""Trainer arguments the loop sets itself, and the option of recover's that sets each."""


def check_trainer_args(trainer: Any) -> dict[str, Any]:
    """``trainer`` as Trainer keyword arguments, each one the Trainer takes and the loop
    does not set itself.

    Raises:
        ValueError: naming the argument and the option to use instead.
    """
    if trainer is None:
        return {}
    if not isinstance(trainer, Mapping):
        raise ValueError(f"trainer={trainer!r} must be a mapping of Trainer arguments")
    known = inspect.signature(pl.Trainer.__init__).parameters
    for name in trainer:
        if name in LOOP_TRAINER_ARGS:
            raise ValueError(
                f"--trainer.{name}: recover sets it for every branch; use its option "
                f"{LOOP_TRAINER_ARGS[name]}"
            )
        if name not in known or name == "self":
            raise ValueError(f"--trainer.{name}: the Trainer takes no argument {name!r}")
    return dict(trainer)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:  # "config:" left empty in a YAML file: the defaults
        return {}
    if not isinstance(value, Mapping):  # a list, a scalar
        raise ValueError(
            f"RecoverConfig {what}: {value!r} is not a mapping of its fields; leave it out "
            "for the defaults"
        )
    return dict(value)


@dataclass(frozen=True)
class RecoverConfig:
    """What to train and how the recovery loop reacts to spikes. The defaults are the
    project's default run (the seed's unstable setup) and the demos' choices."""

    log_root: Path = Path("runs/recover")
    """Root of every branch's run (``<log_root>/<branch>``), of the ledger and of the
    stitched ``accepted`` run."""
    model: dict[str, Any] = field(default_factory=default_model)
    """The LightningModule every branch trains: ``class_path`` and ``init_args`` (the
    built-in ``lit_spikes.demo.module.TinyGPTModule`` takes ``gpt``, ``optim``, ``model_seed``)."""
    data: dict[str, Any] = field(default_factory=default_data)
    """The LightningDataModule of every branch: ``class_path`` and ``init_args`` (the
    built-in ``lit_spikes.demo.data.StepDataModule`` takes ``config``, a ``DataConfig``). Its
    train data should be a ``lit_spikes.StepLoader`` (or positioned as one) for a resume
    to continue at the right batch and for data to be skipped."""
    max_steps: int | None = None
    """Global step at which training ends (None: the module's ``ToolFacts.run_steps``,
    where the built-in model's LR schedule ends; required for a module that states none)."""
    checkpoint_every: int = 50
    """Every branch writes ``step=<k>.ckpt`` every this many steps."""
    val_every: int | None = 100
    """Validate every this many steps (None: only at the end)."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """What counts as a spike."""
    rollback_distance: int = 20
    """The checkpoint a remedy resumes from is at least this many steps before the spike
    (at least 1: from the spike's own step, only skipping its data could change its loss)."""
    ladder: tuple[dict[str, Any] | str, ...] = DEFAULT_LADDER
    """Remedies to try for each spike, in order, each from the same checkpoint: Callbacks
    as ``class_path`` and ``init_args`` (a class path alone: its defaults); the built-in
    ones' ``init_args`` are their options (see ``lit_spikes.tools.recover.remedies``)."""
    accept_margin: int = 20
    """A remedy is accepted once it trains this many steps past the spike without one,
    and its loss rose less than ``recurrence`` of the spike's rise over those steps."""
    recurrence: float = RECURRENCE
    """The bar of the judgement diagnose shares (``lit_spikes.tools.judgement``): a remedy
    whose branch rises over its median at least this share of the spike's own rise, flag
    or no flag, has not removed the spike and is rejected."""
    max_interventions: int = 3
    """Spikes the loop handles; later ones are recorded as unrecovered."""
    max_branches: int = 8
    """Remedy branches the loop may start over the whole run."""
    compare: bool | str | tuple[str, ...] = False  # names checked below: a clear error
    """Also run 'do nothing' (the first run continued through its spike) and the
    module's variants (``ToolFacts.variants``: the demo's QK-norm at the same LR, from
    scratch) as rows of the report: True for all, or the rows by name (``do_nothing``
    alone: no variant, each of which costs a whole run more)."""
    devices: int = 1
    """Processes per machine. More than one trains every branch with Lightning's DDP
    across them (gloo on CPU), each taking its shard of the step's global batch."""
    num_nodes: int = 1
    """Machines, each running this same command (``torchrun``, SLURM ``srun``)."""
    strategy: str = "auto"
    """``"auto"`` or ``"ddp"``: with several processes both mean DDP, whose processes
    the loop starts once and keeps for every branch (``ddp_spawn`` would start new ones
    for each branch and lose the callbacks' decisions on the way back)."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Trainer arguments every branch trains with, as ``lit-spikes fit``'s ``--trainer.*``
    (``--trainer.gradient_clip_val 1.0``, ``precision``, ``accumulate_grad_batches``,
    ``limit_val_batches``, ...). Those the loop sets itself are its own options here:
    ``max_steps``, ``val_check_interval`` (``val_every``), ``devices``, ``num_nodes``,
    ``strategy``; ``callbacks`` (the ladder), ``logger``, ``default_root_dir``
    (``log_root``) and ``enable_checkpointing`` (``checkpoint_every``) are the loop's."""
    exact_resume: bool = True
    """Every branch trains with ``ExactResume`` (its checkpoints hold the RNG states, a
    resume seeks the StepLoader) where the module brings none itself (False: as the
    module has it; a restarted branch's random draws then are not the uninterrupted
    run's)."""
    seed: int | None = 0
    """``seed_everything`` before each branch's module is built: a module that draws its
    weights (or dropout) from the global RNG trains alike in every session (None: not
    seeded)."""
    num_threads: int | None = 1
    """torch's intra-op threads while a branch trains, as ``fit`` sets them for a user's
    module: one thread is as fast as several on a small model on a busy machine, and the
    same every time (None: as the process has them; the built-in model sets its own)."""

    def __post_init__(self) -> None:
        check_num_threads(self.num_threads, "RecoverConfig")
        object.__setattr__(self, "log_root", Path(self.log_root))
        object.__setattr__(self, "model", _model_dict(self.model))
        object.__setattr__(self, "data", _data_dict(self.data))
        object.__setattr__(self, "ladder", tuple(map(check_rung, _names(self.ladder))))
        self._check_ladder()
        self._check_compare()
        self._check_counts()
        self._check_default_run()
        self._check_processes()
        object.__setattr__(self, "trainer", check_trainer_args(self.trainer))

    def _check_ladder(self) -> None:
        if self.max_steps is None and self.facts.run_steps is None:
            raise ValueError(
                f"RecoverConfig.max_steps is required for model {self.model_name}: it states "
                "no ToolFacts.run_steps (docs/tool-facts.md), so nothing says where its run ends"
            )
        if self.steps < 1:
            raise ValueError(f"RecoverConfig.max_steps={self.max_steps} must be >= 1")
        names = [rung_name(r) for r in self.rungs]
        if not self.ladder or len(set(names)) != len(names):
            raise ValueError(
                f"RecoverConfig.ladder={names!r}: give at least one remedy, each class once"
            )

    def _check_compare(self) -> None:
        if isinstance(self.compare, bool):
            return
        rows = _names(self.compare)
        known = self._known_rows()
        if any(row not in known for row in rows) or len(set(rows)) != len(rows):
            raise ValueError(
                f"RecoverConfig.compare={list(rows)!r}: give true, false or some of "
                f"{list(known)}, each once (the rows {self.model_name} offers: "
                f"{DO_NOTHING!r} and its ToolFacts.variants)"
            )
        object.__setattr__(self, "compare", rows)

    def _known_rows(self) -> tuple[str, ...]:
        """``do_nothing`` and the names of the module's variants (``facts``)."""
        return (DO_NOTHING, *(v.name for v in self.facts.variants))

    @property
    def compare_rows(self) -> tuple[str, ...]:
        """The comparison rows this config runs, in the report's order (doing nothing,
        then the module's variants in its order)."""
        if self.compare is False:
            return ()
        known = self._known_rows()
        return known if self.compare is True else tuple(r for r in known if r in self.compare)

    def _check_counts(self) -> None:
        steps = self.steps
        for name in ("checkpoint_every", "max_branches"):
            if getattr(self, name) < 1:
                raise ValueError(f"RecoverConfig.{name}={getattr(self, name)} must be >= 1")
        if self.rollback_distance < 1:
            raise ValueError(
                f"RecoverConfig.rollback_distance={self.rollback_distance} must be >= 1: the "
                "checkpoint of the spike's own step holds the weights that make its loss, so "
                "a lower LR or clipping from there cannot change it (each such branch is spent "
                "on the same spike)"
            )
        check_bar(self.recurrence, "RecoverConfig.recurrence")
        for name in ("accept_margin", "max_interventions"):
            if getattr(self, name) < 0:
                raise ValueError(f"RecoverConfig.{name}={getattr(self, name)} must be >= 0")
        if self.val_every is not None and (self.val_every < 1 or steps % self.val_every):
            raise ValueError(
                f"RecoverConfig.val_every={self.val_every} must be None or divide the run's "
                f"{steps} steps (so every run ends validated); None (--val_every null) "
                "validates at the end only"
            )

    def _builtin(self, section: str, *keys: str) -> Any:
        """A setting of the built-in model's or data's plain ``init_args`` (None: another
        class). The built-in pair's checks before anything is written, read from the class
        path alone; to go behind the module protocol (issue 63)."""
        value = getattr(self, section)
        if value.get("class_path") != (DEFAULT_MODEL if section == "model" else DEFAULT_DATA):
            return None
        for key in ("init_args", *keys):
            value = value[key]
        return value

    def _check_default_run(self) -> None:
        model, data = self._builtin("model", "gpt", "block_size"), self._builtin("data", "config")
        if model is not None and data is not None and model != data["block_size"]:
            raise ValueError(
                f"RecoverConfig: gpt.block_size={model} and "
                f"data.block_size={data['block_size']} must be equal"
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
        batch = self._builtin("data", "config", "batch_size")
        if batch is not None and batch % self.world_size:
            raise ValueError(
                f"RecoverConfig: data.batch_size={batch} must divide by the "
                f"world size devices x num_nodes = {self.world_size}"
            )

    @property
    def rungs(self) -> tuple[dict[str, Any], ...]:
        """The ladder's rungs, each ``{"class_path", "init_args"}`` (``__post_init__``
        turned a class path alone into one)."""
        return tuple(r if isinstance(r, dict) else check_rung(r) for r in self.ladder)

    @property
    def model_name(self) -> str:
        return str(self.model.get("class_path") or self.model.get(FACTORY))

    @cached_property
    def facts(self) -> ToolFacts:
        """What the model states of its run (``lit_spikes.ToolFacts``; ``stated_facts``;
        the defaults for a factory's model)."""
        if FACTORY in self.model:
            return ToolFacts()
        return stated_facts(self.model, pl.LightningModule, "RecoverConfig.model")  # type: ignore[no-any-return]

    @property
    def steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        steps = self.facts.run_steps
        assert steps is not None  # __post_init__ refuses a model that states none
        return steps

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def trainer_kwargs(self) -> dict[str, Any]:
        """The Trainer arguments every branch adds: ``trainer``'s and its processes'."""
        if self.world_size == 1 and self.strategy == "auto":
            return dict(self.trainer)
        ddp = {"devices": self.devices, "num_nodes": self.num_nodes, "strategy": "ddp"}
        return {**self.trainer, **ddp}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (``from_dict`` reads it back)."""
        data: dict[str, Any] = plain_config(asdict(self))
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecoverConfig:
        """A config from ``to_dict``'s output, or any part of it (the rest: defaults).

        Raises:
            ValueError: an unknown key (named), or a value its dataclass refuses.
        """
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown RecoverConfig keys {unknown}; known: {sorted(known)}")
        for key in ("model", "data", "detector"):
            if key in data and data[key] is None:  # "data:" left empty in a YAML file
                del data[key]
        if "detector" in data:
            data["detector"] = DetectorConfig(**_mapping(data["detector"], "detector"))
        return cls(**data)

    def identity(self) -> dict[str, Any]:
        """What a restart must repeat to continue a ledger: everything but the location."""
        plain = self.to_dict()
        plain.pop("log_root")
        return plain
