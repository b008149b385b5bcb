"""``Spike``: one flagged step, as it travels from ``SpikeDetector`` through recover's
ledger and diagnose's replays to TensorBoard. A frozen dataclass, read and written as the
plain record earlier versions kept (``{"step": 150, "metric": "loss", ...}``): checkpoints
and ledgers hold that record, and a ``Spike`` reads as one (``spike["step"]``) for code
written against it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
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


@dataclass(frozen=True)
class Episode:
    """A spike and its aftermath: the flags from its onset until the watched curve stayed
    in its band (no flag) for ``settle`` steps (``SpikeDetector(settle=...)``). The ringing
    after one bad batch is one episode, not several spikes.

    Example:
        >>> [(e.onset.step, e.peak.step, e.height) for e in detector.episodes]
        [(160, 161, 1.2)]
    """

    onset: Spike
    """Its first flag."""
    peak: Spike
    """The flag of its onset's metric that rose highest above its reference."""
    end: int
    """Its last flagged step."""
    flags: int
    """The flags in it (every metric's)."""

    @property
    def height(self) -> float:
        """How far the peak rose above its reference (``Spike.rise``; inf: non-finite)."""
        return self.peak.rise

    def describe(self) -> str:
        """``step 160 (loss 3.1 at step 161, +1.2 over 1.9; 3 flags to step 166)``."""
        peak = self.peak
        rise = "not finite" if math.isinf(self.height) else f"+{self.height:.4g}"
        flags = f"; {self.flags} flags to step {self.end}" if self.flags > 1 else ""
        return (
            f"step {self.onset.step} ({peak.metric} {peak.value:.4g} at step {peak.step}, "
            f"{rise} over {peak.reference:.4g}{flags})"
        )


def group_episodes(spikes: Iterable[Spike], settle: int) -> list[Episode]:
    """``spikes`` grouped into episodes, in step order: a flag within ``settle`` steps of
    the episode's last one belongs to it; a later one starts the next."""
    found: list[Episode] = []
    group: list[Spike] = []
    for spike in sorted(spikes, key=lambda s: s.step):
        if group and spike.step > group[-1].step + settle:
            found.append(_episode(group))
            group = []
        group.append(spike)
    return [*found, _episode(group)] if group else found


def _episode(group: list[Spike]) -> Episode:
    onset = group[0]
    same = [s for s in group if s.metric == onset.metric]
    peak = max(same, key=lambda s: s.rise)  # the first of equal rises (max keeps it)
    return Episode(onset, peak, max(s.step for s in group), len(group))
