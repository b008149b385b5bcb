"""What lit-spikes' tools (recover, diagnose, check-resume, study) ask of a
LightningModule, in one place: ``ToolFacts``, which a module states through the
``SpikeToolsModule`` protocol (a ``tool_facts`` attribute or property). Every fact has a
default that works for any ``LightningModule``, so a module states only what differs;
the tools read nothing else of it by name (docs/tool-facts.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

ValMode = Literal["min", "max"]


@dataclass(frozen=True)
class Column:
    """An extra column of recover's comparison table (the largest value of a per-step
    record key from the first spike's step on, headed ``<header> after 1st spike``) and
    of diagnose's replays (its largest over the replayed steps): the demo's largest
    attention logit."""

    key: str
    """What the column reads at each step: a name the module logs every step
    (``self.log(key, value)``), a key of the tools' own step records (``loss``, ``lr``,
    ``position``), or of the module's own per-step records where it keeps them (a
    ``history`` list: the demo's ``max_logit``). Under DDP, the largest of the ranks'."""
    header: str
    """What the column holds, as the tables head it (``"max attn logit"``)."""
    digits: int = 3
    """Digits after the point."""

    def __post_init__(self) -> None:
        if not self.key or not self.header:
            raise ValueError(f"Column(key={self.key!r}, header={self.header!r}): name both")
        if self.digits < 0:
            raise ValueError(f"Column.digits={self.digits} must be >= 0")


DO_NOTHING = "do_nothing"
"""recover's comparison row that continues the first run through its spike (any module)."""


@dataclass(frozen=True)
class Variant:
    """A variant of the module that recover's comparison trains from scratch at the same
    settings otherwise (``--compare true``, or by ``name``): a fix aimed at the cause of
    the module's spikes, to set beside the remedies (the demo's QK-norm)."""

    name: str
    """The row's name (``--compare [do_nothing, NAME]``) and its branch's
    (``compare/NAME``): letters, digits and underscores."""
    label: str
    """How recover's comparison table names the row."""
    init_args: Mapping[str, Any]
    """Merged over the module's own ``init_args`` (a mapping into a mapping key by key:
    the demo's ``{"gpt": {"qk_norm": True}}`` changes one field of its ``gpt``)."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name == DO_NOTHING:
            raise ValueError(
                f"Variant.name={self.name!r}: give letters, digits and underscores (not "
                f"{DO_NOTHING!r}, the comparison's own row)"
            )
        if not self.label or not self.init_args:
            raise ValueError(
                f"Variant {self.name!r}: give a label and the init_args it changes "
                f"(label={self.label!r}, init_args={self.init_args!r})"
            )
        object.__setattr__(self, "init_args", dict(self.init_args))


@dataclass(frozen=True)
class ToolFacts:
    """What a module tells the tools about its run. The defaults fit any module: the
    detector watches the step's returned ``loss`` by its own rule, no validation metric
    is preferred, the Trainer's ``max_steps`` ends the run, and no extra column."""

    curves: Mapping[str, str] = field(default_factory=dict)
    """The TensorBoard tag each per-step record key is logged under, where it is not the
    key itself (the demo: ``{"loss": "train/loss", "max_logit": "train/max_logit", ...}``):
    spike marks and the stitched run land on the module's own charts."""
    detector: Mapping[str, Any] = field(default_factory=dict)
    """``SpikeDetector`` arguments the tools' detector takes where the user sets no rule
    (the demo: ``{"ratio": 1.4, "window": 20}``; none: the detector's own robust rule)."""
    val_metric: str | None = None
    """The validation metric the tools compare runs by, as ``self.log`` names it (None:
    ``val_loss`` or ``val/loss`` where logged, else the first that every run logs)."""
    val_label: str | None = None
    """How reports name ``val_metric`` (None: its name)."""
    val_mode: ValMode = "min"
    """Whether a lower (``"min"``) or a higher (``"max"``) ``val_metric`` is better."""
    run_steps: int | None = None
    """The global step the run ends at when the Trainer is given none (the demo: where
    its LR schedule ends; None: the tools ask for ``max_steps``)."""
    warmup_steps: int = 0
    """Steps from the start in which no spike is flagged (the demo: its LR warm-up)."""
    columns: tuple[Column, ...] = ()
    """Extra columns of recover's comparison table."""
    variants: tuple[Variant, ...] = ()
    """Variants recover's comparison may train from scratch beside doing nothing (the
    demo: QK-norm). Each by its name, none twice."""

    def __post_init__(self) -> None:
        if self.val_mode not in ("min", "max"):
            raise ValueError(f"ToolFacts.val_mode={self.val_mode!r} must be 'min' or 'max'")
        if self.run_steps is not None and self.run_steps < 1:
            raise ValueError(f"ToolFacts.run_steps={self.run_steps} must be >= 1 or None")
        if self.warmup_steps < 0:
            raise ValueError(f"ToolFacts.warmup_steps={self.warmup_steps} must be >= 0")
        columns = tuple(self.columns)
        if not all(isinstance(c, Column) for c in columns):
            raise ValueError(f"ToolFacts.columns={columns!r} must be Column objects")
        object.__setattr__(self, "columns", columns)
        variants = tuple(self.variants)
        if not all(isinstance(v, Variant) for v in variants):
            raise ValueError(f"ToolFacts.variants={variants!r} must be Variant objects")
        for what in ("name", "label"):
            seen = [getattr(v, what) for v in variants]
            if len(set(seen)) != len(seen):
                raise ValueError(f"ToolFacts.variants: each {what} once, not {seen!r}")
        object.__setattr__(self, "variants", variants)
        object.__setattr__(self, "curves", dict(self.curves))
        object.__setattr__(self, "detector", dict(self.detector))

    @property
    def val_name(self) -> str | None:
        """``val_metric`` as reports name it."""
        return self.val_label or self.val_metric

    def variant(self, name: str) -> Variant:
        """The variant of that name (KeyError: none)."""
        found = {v.name: v for v in self.variants}
        return found[name]

    def tag(self, key: str) -> str:
        """The TensorBoard tag of a per-step record key."""
        return self.curves.get(key, key)


@runtime_checkable
class SpikeToolsModule(Protocol):
    """A LightningModule that states its ``ToolFacts``; a module without them gets the
    defaults (``facts_of``).

    Example:
        >>> class MyModule(pl.LightningModule):
        ...     tool_facts = ToolFacts(val_metric="val_acc", val_mode="max")
    """

    @property
    def tool_facts(self) -> ToolFacts: ...


@runtime_checkable
class ChecksItsRun(Protocol):
    """A LightningModule or LightningDataModule with checks of its own that ``lit-spikes
    fit`` (and ``validate``) runs once the model, data and Trainer are built and before it
    writes a file: what would fail at the first step, or silently train on other batches,
    refused as a usage error with the ``ValueError``'s message, nothing written. It may
    also fit the Trainer to the data (the demo's endless stream turns ``max_epochs`` into
    steps). Called on the module, then on the data module, each given all of them."""

    def check_run(
        self,
        stage: str,
        trainer: Any,
        *,
        model: Any,
        datamodule: Any,
        checkpoint: dict[str, Any] | None,
    ) -> None:
        """``stage``: ``"fit"`` or ``"validate"``; ``checkpoint``: the file resumed or
        evaluated, loaded (None: a new run)."""


def facts_of(module: object) -> ToolFacts:
    """The facts ``module`` states (``SpikeToolsModule``), else the defaults.

    Raises:
        TypeError: a ``tool_facts`` that is not a ``ToolFacts`` (named with its module).
    """
    facts = getattr(module, "tool_facts", None)
    if facts is None:
        return ToolFacts()
    if not isinstance(facts, ToolFacts):
        raise TypeError(
            f"{type(module).__name__}.tool_facts is a {type(facts).__name__}, not a "
            "lit_spikes.ToolFacts; return one (or leave tool_facts out for the defaults)"
        )
    return facts


def states_facts(klass: type) -> bool:
    """Whether instances of ``klass`` state facts of their own: only then does a tool
    build one to read them before a run."""
    return getattr(klass, "tool_facts", None) is not None
