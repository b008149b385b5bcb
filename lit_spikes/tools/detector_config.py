"""The settings of the ``SpikeDetector`` that ``recover``'s branches and ``diagnose``'s
replays judge spikes with, as a config dataclass (its fields are both commands'
``--detector.*`` options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_spikes.callbacks import SpikeDetector
from lit_spikes.tool_facts import ToolFacts


@dataclass(frozen=True)
class DetectorConfig:
    """The ``SpikeDetector`` every branch runs (see its docstring for the meaning). Left
    unset (None), window, warm-up and rule are the module's (its ``ToolFacts.detector``:
    the demo's 1.4x the mean of the last 20 steps), else the detector's own, which fits a
    loss of any scale (``robust_z=8`` over 100 steps; docs/detector.md)."""

    monitor: tuple[str, ...] = ("loss",)
    """Logged metrics to watch (``self.log`` names, or the step's ``loss``)."""
    window: int | None = None
    """Steps of the rolling window a value is compared with (None: the module's rule's,
    else the detector's: 20 for a ratio, 100 for the robust rule)."""
    warmup: int | None = None
    """Steps the window must hold before anything is flagged (None: the window)."""
    ratio: float | None = None
    """Flag a value above this many times the window's mean (None: no ratio test, unless
    no test is set and the module's rule has one: 1.4 for the built-in model)."""
    z_score: float | None = None
    """Flag a value this many standard deviations above the mean (None: no z test)."""
    robust_z: float | None = None
    """Flag a value this many MAD-based spreads above the median (None: no robust test;
    with no test at all, 8)."""
    min_step: int | None = None
    """No flag before this global step (None: the module's ``ToolFacts.warmup_steps``:
    the end of the built-in model's LR warm-up, 0 for a module that states none)."""

    def __post_init__(self) -> None:
        monitor = self.monitor
        object.__setattr__(
            self, "monitor", (monitor,) if isinstance(monitor, str) else tuple(monitor)
        )
        if self.min_step is not None and self.min_step < 0:
            raise ValueError(f"DetectorConfig.min_step={self.min_step} must be >= 0 or None")
        self.build()  # the detector's own checks, with its own messages

    def build(self, facts: ToolFacts | None = None) -> SpikeDetector:
        """A detector that records spikes; stopping is the loop's gate's job. ``facts``:
        the module's (``lit_spikes.ToolFacts``): where no rule is set, its ``detector``
        rule; where no ``min_step`` is, its warm-up; its curves' tags for the marks."""
        facts = facts or ToolFacts()
        rule: dict[str, Any] = {"window": self.window, "ratio": self.ratio}
        rule |= {"z_score": self.z_score, "robust_z": self.robust_z}
        if self.ratio is None and self.z_score is None and self.robust_z is None:
            rule |= {k: v for k, v in facts.detector.items() if rule.get(k) is None}
        return SpikeDetector(
            monitor=self.monitor,
            warmup=self.warmup,
            action="log",
            min_step=facts.warmup_steps if self.min_step is None else self.min_step,
            curves=dict(facts.curves) or None,
            **rule,
        )
