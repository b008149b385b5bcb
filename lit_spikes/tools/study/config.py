"""What a study of any module runs (``lit-spikes study --model X --data Y``): the module
and data by class path, the seeds, and the run each seed trains, as ``recover`` takes
them (its detector, checkpoint interval, rollback distance and remedy ladder, in its YAML
form). Checked when built, by the ``RecoverConfig`` each seed's runs are built from."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from lit_spikes.tool_facts import ToolFacts
from lit_spikes.tools.class_paths import class_defaults
from lit_spikes.tools.detector_config import DetectorConfig
from lit_spikes.tools.factories import import_class
from lit_spikes.tools.judgement import RECURRENCE
from lit_spikes.tools.recover.branch import merged
from lit_spikes.tools.recover.config import RecoverConfig, default_data, default_model
from lit_spikes.tools.recover.remedies import DEFAULT_LADDER, check_rung, rung_name
from lit_spikes.tools.study.early_warning import LeadConfig
from lit_spikes.tools.study.sweep import SweepConfig


@dataclass(frozen=True)
class StudyConfig:
    """A study of one recipe over several seeds: per seed the reference run, the exact
    resume, each rung of the remedy ladder and diagnose on each flagged spike."""

    log_root: Path = Path("runs/study")
    """Where every cell's run directory, the report and the figures go."""
    model: dict[str, Any] = field(default_factory=default_model)
    """The LightningModule: ``class_path`` and ``init_args`` (``--model``, as ``fit``)."""
    data: dict[str, Any] = field(default_factory=default_data)
    """The LightningDataModule: ``class_path`` and ``init_args`` (``--data``). Its train
    data should be a ``lit_spikes.StepLoader`` for the resumes to continue at the right
    batch and for data to be skipped."""
    seeds: list[int] = field(default_factory=lambda: list(range(12)))
    """``seed_everything`` before each seed's module and data are built: a module that
    draws its weights from the global RNG (as most do) starts elsewhere in each seed."""
    seed_args: list[str] = field(default_factory=list)
    """Init arguments each seed is also given to, as ``model.<name>`` or ``data.<name>``
    (dotted into a nested one: ``data.config.seed``): for a module or data that seeds
    itself (``--seed_args [model.seed]``)."""
    max_steps: int | None = None
    """Every seed's run ends at this global step (None: the module's
    ``ToolFacts.run_steps``)."""
    checkpoint_every: int = 50
    """The reference run writes ``step=<k>.ckpt`` every this many steps."""
    val_every: int | None = 100
    """Validate every this many steps (None: at the end only); the runs are compared by
    the module's validation metric at the last validation (``ToolFacts.val_metric``)."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """What counts as a spike (recover's ``--detector.*``; the module's own rule where
    none is set)."""
    rollback_distance: int = 20
    """The resumes start from the newest checkpoint at least this many steps before the
    seed's first spike."""
    no_spike_step: int | None = None
    """A seed without a spike gets its resumes placed as if it spiked here (None: at the
    run's middle), so each remedy's cost where nothing went wrong is measured too."""
    ladder: tuple[dict[str, Any] | str, ...] = DEFAULT_LADDER
    """The remedies, each a cell from the checkpoint before the spike (recover's
    ``ladder``: Callbacks by class path with ``init_args``; by default skip data, scale
    the LR, skip the step, clip). A rung may have a ``name`` (its cell's; by default its
    class's short one): a class twice needs one."""
    variants: bool = False
    """Also train each of the module's ``ToolFacts.variants`` from scratch in every seed
    (the demo's QK-norm), compared with doing nothing as the remedies are, and by each of
    its ``ToolFacts.columns`` (the demo's largest attention logit)."""
    controls: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Resumes from the checkpoint before the spike with init arguments changed, by name
    (``{"other_data": {"data": {"seed": 7}}}``): each should give another trajectory, the
    control that the exact resume's comparison can fail."""
    recurrence: float = RECURRENCE
    """diagnose's bar (the judgement recover shares)."""
    leads: LeadConfig = field(default_factory=LeadConfig)
    """Early warning: what a signal's crossing is, and the leads judged."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """The LR-sensitivity sweep (``sweep.lr_arg`` names where the LR goes; none without)."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Trainer arguments of every run (recover's ``--trainer.*``)."""
    num_threads: int | None = 1
    """torch's intra-op threads in each cell (None: as the worker has them)."""
    workers: int = 0
    """Worker processes, one torch thread each (0: one per usable core)."""
    figures_dir: Path | None = None
    """A second place for the figures."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "log_root", Path(self.log_root))
        if self.figures_dir is not None:
            object.__setattr__(self, "figures_dir", Path(self.figures_dir))
        if isinstance(self.detector, dict):
            object.__setattr__(self, "detector", DetectorConfig(**self.detector))
        if isinstance(self.leads, dict):
            object.__setattr__(self, "leads", LeadConfig(**self.leads))
        if isinstance(self.sweep, dict):
            object.__setattr__(self, "sweep", SweepConfig(**self.sweep))
        seeds = list(self.seeds)
        if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
            raise ValueError(f"StudyConfig.seeds={seeds} must be distinct seeds >= 0, at least one")
        object.__setattr__(self, "seeds", seeds)
        if self.workers < 0:
            raise ValueError(f"StudyConfig.workers={self.workers} must be >= 0 (0: one per core)")
        object.__setattr__(self, "ladder", named_ladder(self.ladder))
        # the run's own checks (model, data, ladder, trainer), then the seed's arguments'
        run = self.recover(seeds[0], seeded=False)
        object.__setattr__(self, "model", run.model)
        object.__setattr__(self, "data", run.data)
        object.__setattr__(self, "seed_args", list(self.seed_args))
        for arg in self.seed_args:
            section, _, key = str(arg).partition(".")
            if section not in ("model", "data") or not _takes(getattr(self, section), key):
                raise ValueError(
                    f"StudyConfig.seed_args: {arg!r} names no init argument: give "
                    f"model.<name> of {sorted(self.model['init_args'])} or data.<name> of "
                    f"{sorted(self.data['init_args'])}"
                )
        self.recover(seeds[0])
        first = self.checkpoint_every + self.rollback_distance
        if not first <= self.place(None) < run.steps:
            raise ValueError(
                f"StudyConfig.no_spike_step={self.no_spike_step} must be in [checkpoint_every + "
                f"rollback_distance, max_steps) = [{first}, {run.steps}): a checkpoint must "
                "precede it"
            )
        self._check_cells()
        self._check_sweep()

    def _check_cells(self) -> None:
        """The variants, the controls and every cell's name in a seed, none twice."""
        if self.variants and not self.facts.variants:
            raise ValueError(
                f"StudyConfig.variants=true: {self.run.model_name} states no "
                "ToolFacts.variants (docs/tool-facts.md)"
            )
        for name, changes in self.controls.items():
            keys = set(changes) if isinstance(changes, dict) else {"?"}
            if not str(name).isidentifier() or not keys <= {"model", "data"}:
                raise ValueError(
                    f"StudyConfig.controls: {name!r}: {changes!r} must map a name (letters, "
                    "digits, underscores) to the model's and the data's init arguments to "
                    "change: {name: {data: {seed: 7}}}"
                )
            self.control(self.seeds[0], name)  # the changed run's own checks
        names = [*self.rung_names, *self.controls, *self.variant_cells]
        taken = [n for n in names if n in RESERVED or names.count(n) > 1]
        if taken:
            raise ValueError(
                f"StudyConfig: the cells {names} of a seed must be named apart and not "
                f"{list(RESERVED)}: rename {sorted(set(taken))} (a rung's name)"
            )

    @property
    def rung_names(self) -> list[str]:
        return [r["name"] for r in self.rungs]

    @property
    def variant_cells(self) -> list[str]:
        """The cells of the module's variants (``variants``), ``variant_<name>``."""
        return [f"variant_{v.name}" for v in self.facts.variants] if self.variants else []

    def variant(self, seed: int, cell: str) -> RecoverConfig:
        """The run of a variant's cell (``variant_<name>``): from scratch, its init
        arguments merged over the module's."""
        changes = self.facts.variant(cell.removeprefix("variant_")).init_args
        return self.recover(seed, model=with_changes(self.model, changes))

    def control(self, seed: int, name: str) -> RecoverConfig:
        """The run of a control: the seed's with ``controls[name]``'s changes."""
        changes = self.controls[name]
        model = with_changes(self.model, changes.get("model") or {})
        data = with_changes(self.data, changes.get("data") or {})
        return self.recover(seed, model=model, data=data)

    def _check_sweep(self) -> None:
        sweep = self.sweep
        if sweep.lr_arg is None:
            return
        key = sweep.lr_arg.partition(".")[2]
        lr = self.own_lr()
        if not isinstance(lr, int | float) or isinstance(lr, bool) or not lr > 0:
            raise ValueError(
                f"StudyConfig.sweep.lr_arg={sweep.lr_arg!r}: the model's {key} is {lr!r}, not "
                f"a learning rate > 0 (its init arguments: {sorted(self.model['init_args'])})"
            )
        if isinstance(sweep.variant, str):
            names = [v.name for v in self.facts.variants]
            if sweep.variant not in names:
                raise ValueError(
                    f"StudyConfig.sweep.variant={sweep.variant!r}: {self.run.model_name} states "
                    f"the variants {names} (ToolFacts.variants); or give init arguments"
                )
        if sweep.seeds > len(self.seeds):
            raise ValueError(
                f"StudyConfig.sweep.seeds={sweep.seeds} must be at most the study's "
                f"{len(self.seeds)} seeds"
            )
        self.sweep_run(self.seeds[0], self.sweep_lrs()[-1], variant=True)

    def sweep_lrs(self) -> list[float]:
        """The sweep's peak LRs: ``sweep.peak_lrs``, else its factors x the model's own."""
        if self.sweep.peak_lrs is not None:
            return list(self.sweep.peak_lrs)
        return [factor * self.own_lr() for factor in self.sweep.factors]

    def own_lr(self) -> Any:
        """The value of the model's ``sweep.lr_arg`` (its init argument or its default)."""
        assert self.sweep.lr_arg is not None
        path = self.sweep.lr_arg.partition(".")[2].split(".")
        value: Any = self.model.get("init_args") or {}
        if path[0] not in value:
            klass = import_class(self.model["class_path"], object, "StudyConfig.sweep.lr_arg")
            value = {path[0]: class_defaults(klass, "init").get(f"init.{path[0]}")}
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def sweep_run(self, seed: int, lr: float, variant: bool) -> RecoverConfig:
        """A sweep run: the seed's, from scratch at peak LR ``lr``, with the variant
        (``variant``), validated at its end only."""
        assert self.sweep.lr_arg is not None
        model = with_arg(self.model, self.sweep.lr_arg.partition(".")[2], lr)
        model = with_changes(model, self.sweep.model_args)
        change = self.sweep.variant
        if variant and change is not None:
            changes = self.facts.variant(change).init_args if isinstance(change, str) else change
            model = with_changes(model, changes)
        run = self.recover(seed, model=model)
        try:
            return replace(run, max_steps=self.sweep.steps or run.steps, val_every=None)
        except ValueError as error:
            raise ValueError(str(error).replace("RecoverConfig", "StudyConfig.sweep")) from None

    def recover(
        self,
        seed: int,
        seeded: bool = True,
        model: dict[str, Any] | None = None,
        data: dict[str, Any] | None = None,
    ) -> RecoverConfig:
        """The run of ``seed`` as recover's config (each cell trains as a branch would),
        with the seed in ``seed_args`` (``seeded``), of ``model`` and ``data`` (None:
        the study's). Its ladder: the first rung of each class (recover's takes each
        once; the cells build their own).

        Raises:
            ValueError: a setting the run refuses, named as the study's option.
        """
        try:
            return RecoverConfig(
                log_root=self.log_root,
                model=self._seeded(model or self.model, "model", seed, seeded),
                data=self._seeded(data or self.data, "data", seed, seeded),
                max_steps=self.max_steps,
                checkpoint_every=self.checkpoint_every,
                val_every=self.val_every,
                detector=self.detector,
                rollback_distance=self.rollback_distance,
                ladder=_one_a_class(self.ladder),
                recurrence=self.recurrence,
                trainer=self.trainer,
                seed=seed,
                num_threads=self.num_threads,
            )
        except ValueError as error:
            raise ValueError(str(error).replace("RecoverConfig", "StudyConfig")) from None

    def _seeded(
        self, value: dict[str, Any], section: str, seed: int, seeded: bool
    ) -> dict[str, Any]:
        """The model's (``section``) or the data's class path ``value`` with ``seed`` in
        its ``seed_args`` (``seeded``)."""
        for arg in self.seed_args if seeded else []:
            where, _, path = arg.partition(".")
            if where == section:
                value = with_arg(value, path, seed)
        return value

    @cached_property
    def run(self) -> RecoverConfig:
        """The first seed's run (what every seed shares: the steps, the facts)."""
        return self.recover(self.seeds[0])

    @property
    def facts(self) -> ToolFacts:
        return self.run.facts

    @property
    def steps(self) -> int:
        return self.run.steps

    @property
    def rungs(self) -> tuple[dict[str, Any], ...]:
        """The ladder's rungs, each ``{"name", "class_path", "init_args"}``."""
        return tuple(r for r in self.ladder if isinstance(r, dict))

    @property
    def first_step(self) -> int:
        """The first step the detector judges (its ``min_step``, else the module's warm-up)."""
        given = self.detector.min_step
        return self.facts.warmup_steps if given is None else given

    def place(self, onset: int | None) -> int:
        """Where a seed's resumes are placed: its first spike, else ``no_spike_step``."""
        if onset is not None:
            return onset
        return self.steps // 2 if self.no_spike_step is None else self.no_spike_step

    def checkpoint_before(self, step: int) -> int | None:
        """The newest checkpoint at least ``rollback_distance`` steps before ``step``
        (``RollbackRestore``'s choice), else the newest before it (None: none is)."""
        every = self.checkpoint_every
        k = (max(step - self.rollback_distance, 0) // every) * every
        if k < every:
            k = ((step - 1) // every) * every
        return k if k >= every else None

    def fingerprint(self) -> str:
        """What decides each cell's numbers: a log root holds the cells of one. Not the
        seeds (more seeds reuse the cells done), where files go, nor the workers."""
        numbers: dict[str, Any] = asdict(self)
        for key in ("log_root", "figures_dir", "workers", "seeds"):
            numbers.pop(key)
        numbers["sweep"].pop("seeds")  # more seeds a point reuse the cells done
        text = json.dumps(numbers, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


QUICK: dict[str, Any] = {"seeds": [0, 1], "sweep.factors": [0.1, 1.0, 10.0]}
"""``--quick``: two seeds, a sweep of three LRs over two decades (the other options as
given)."""


RESERVED = ("reference", "resume_exact", "diagnose")
"""Names of a seed's own cells (a diagnosis is ``diagnose_step<k>``)."""


def named_ladder(ladder: Any) -> tuple[dict[str, Any], ...]:
    """The ladder's rungs checked as recover checks them, each with its ``name`` (given,
    or its class's short one)."""
    rungs = []
    for value in (ladder,) if isinstance(ladder, str | dict) else ladder:
        name = value.get("name") if isinstance(value, dict) else None
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if k != "name"}
        rung = check_rung(value)
        rungs.append({"name": str(name) if name is not None else rung_name(rung), **rung})
    names = [r["name"] for r in rungs]
    if not rungs or not all(n.isidentifier() for n in names):
        raise ValueError(
            f"StudyConfig.ladder: give one rung or more, named by identifiers: {names}"
        )
    return tuple(rungs)


def plain_rung(rung: dict[str, Any]) -> dict[str, Any]:
    """A rung as recover takes it (without its study's ``name``)."""
    return {k: v for k, v in rung.items() if k != "name"}


def _one_a_class(ladder: Any) -> tuple[dict[str, Any], ...]:
    kept: dict[str, dict[str, Any]] = {}
    for rung in ladder:
        kept.setdefault(rung["class_path"], plain_rung(rung))
    return tuple(kept.values())


def with_changes(class_path: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``class_path`` with ``changes`` merged over its init arguments (key by key)."""
    if not changes:
        return class_path
    return {**class_path, "init_args": merged(class_path.get("init_args") or {}, changes)}


def with_arg(class_path: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``class_path`` with ``value`` at its init argument ``path`` (dotted into a nested
    one: ``optim.peak_lr``)."""
    changes: Any = value
    for key in reversed(path.split(".")):
        changes = {key: changes}
    return with_changes(class_path, changes)


def _takes(class_path: dict[str, Any], key: str) -> bool:
    """Whether the class takes the init argument ``key`` (dotted: its first name), by
    name or through ``**kwargs`` handed on to a parent class (as the command line does)."""
    name = key.split(".")[0]
    if name in (class_path.get("init_args") or {}):
        return True
    klass = import_class(class_path["class_path"], object, "StudyConfig.seed_args")
    return f"init.{name}" in class_defaults(klass, "init")
