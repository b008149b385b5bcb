"""The settings of the ``SpikeDetector`` that ``recover``'s branches and ``diagnose``'s
replays judge spikes with, as a config dataclass (its fields are both commands'
``--detector.*`` options)."""

from __future__ import annotations

from dataclasses import dataclass

from lit_spikes.callbacks import SpikeDetector


@dataclass(frozen=True)
class DetectorConfig:
    """The ``SpikeDetector`` every branch runs (see its docstring for the meaning). The
    defaults are the demo's rule (1.4x the mean of the last 20 steps), not the
    detector's own (``robust_z=8`` over 100 steps): ``recover`` and ``diagnose`` judge the
    built-in model as its demo does. For another module's loss, pass ``--detector.ratio
    null --detector.robust_z 8 --detector.window 100 --detector.warmup 100``
    (docs/detector.md)."""

    monitor: tuple[str, ...] = ("loss",)
    """Logged metrics to watch (``self.log`` names, or the step's ``loss``)."""
    window: int = 20
    """Steps of the rolling mean a value is compared with."""
    warmup: int = 20
    """Steps the window must hold before anything is flagged."""
    ratio: float | None = 1.4
    """Flag a value above this many times the window's mean (None: no ratio test)."""
    z_score: float | None = None
    """Flag a value this many standard deviations above the mean (None: no z test)."""
    robust_z: float | None = None
    """Flag a value this many MAD-based spreads above the median (None: no robust test;
    with no test at all, 8)."""
    min_step: int | None = None
    """No flag before this global step (None: the end of the built-in model's LR warm-up;
    0 for another model)."""

    def __post_init__(self) -> None:
        monitor = self.monitor
        object.__setattr__(
            self, "monitor", (monitor,) if isinstance(monitor, str) else tuple(monitor)
        )
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
            robust_z=self.robust_z,
            action="log",
            min_step=default_min_step if self.min_step is None else self.min_step,
        )
