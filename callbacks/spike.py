"""``Spike``: one flagged step, as it travels from ``SpikeDetector`` through recover's
ledger and diagnose's replays to TensorBoard. A frozen dataclass, read and written as the
plain record earlier versions kept (``{"step": 150, "metric": "loss", ...}``): checkpoints
and ledgers hold that record, and a ``Spike`` reads as one (``spike["step"]``) for code
written against it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

OPTIONAL = ("rank_values", "position", "branch")
"""The fields a record holds only where they are known."""


@dataclass(frozen=True, eq=False)
class Spike(Mapping[str, Any]):
    """A step whose watched value jumped above its reference, or was not finite.

    Example:
        >>> spike = detector.spikes[0]
        >>> spike.step, spike.metric, spike.value, spike.reference
        (122, 'loss', 3.1, 2.1)
    """

    step: int
    """The global step flagged (the step that produced the value)."""
    metric: str
    """The watched name (``loss``, ``grad_norm``, a logged metric)."""
    value: float
    """Its value at the step (NaN or inf: a non-finite step)."""
    reference: float = math.nan
    """The rule's centre it was judged against (the window's median or mean)."""
    rank_values: tuple[float | None, ...] | None = None
    """Each process's own value, where the detector was given them (multi-process runs)."""
    position: int | None = None
    """The data position the step trained on (recover: where a data skip starts)."""
    branch: str | None = None
    """The recover branch it stopped."""

    def __post_init__(self) -> None:
        if self.rank_values is not None and not isinstance(self.rank_values, tuple):
            object.__setattr__(self, "rank_values", tuple(self.rank_values))

    @property
    def rise(self) -> float:
        """How far the value rose above its reference (inf for a non-finite value)."""
        return self.value - self.reference if math.isfinite(self.value) else math.inf

    def replace(self, **changes: Any) -> Spike:
        """A copy with ``changes`` (``spike.replace(position=31)``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The plain record (lists, no unknown fields): what a checkpoint or ledger holds."""
        return {key: self[key] for key in self}

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Spike:
        """A spike from its plain record, as any version wrote it (no ``reference`` in the
        oldest: NaN); other keys are left out.

        Raises:
            ValueError: a record without ``step``, ``metric`` or ``value``.
        """
        if isinstance(record, Spike):
            return record
        missing = [key for key in ("step", "metric", "value") if key not in record]
        if missing:
            raise ValueError(f"a spike record needs {missing}: {dict(record)!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in record.items() if key in known}
        values["step"], values["metric"] = int(values["step"]), str(values["metric"])
        values["value"] = float(values["value"])
        values["reference"] = float(values.get("reference", math.nan))
        return cls(**values)

    # The mapping view: the record earlier versions passed around as a dict
    def __getitem__(self, key: str) -> Any:
        if key in OPTIONAL and getattr(self, key, None) is None:
            raise KeyError(key)
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        value = getattr(self, key)
        return list(value) if key == "rank_values" else value  # as the records held it

    def __iter__(self) -> Iterator[str]:
        return (
            name
            for name in self.__dataclass_fields__
            if name not in OPTIONAL or getattr(self, name) is not None
        )

    def __len__(self) -> int:
        return sum(1 for _ in self)
