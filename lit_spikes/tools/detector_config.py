"""The settings of the ``SpikeDetector`` that ``recover``'s branches and ``diagnose``'s
replays judge spikes with, as a config dataclass (its fields are both commands'
``--detector.*`` options)."""

from __future__ import annotations

from dataclasses import dataclass

from lit_spikes.callbacks import SpikeDetector

DEMO_RATIO, DEMO_WINDOW = 1.4, 20
"""The demo's rule for the built-in model: its spike at 1.65x the mean is caught, and its
healthy steps stay below 1.4x (docs/detector.md)."""


@dataclass(frozen=True)
class DetectorConfig:
    """The ``SpikeDetector`` every branch runs (see its docstring for the meaning). Left
    unset (None), window, warm-up and rule are the model's defaults: for the built-in model
    its demo's rule (1.4x the mean of the last 20 steps), for another module the
    detector's own, which fits a loss of any scale (``robust_z=8`` over 100 steps;
    docs/detector.md)."""

    monitor: tuple[str, ...] = ("loss",)
    """Logged metrics to watch (``self.log`` names, or the step's ``loss``)."""
    window: int | None = None
    """Steps of the rolling window a value is compared with (None: the model's default,
    20 for the built-in model's ratio, 100 for the robust rule)."""
    warmup: int | None = None
    """Steps the window must hold before anything is flagged (None: the window)."""
    ratio: float | None = None
    """Flag a value above this many times the window's mean (None: no ratio test; 1.4
    for the built-in model when no test is set)."""
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

    def build(self, default_min_step: int, builtin: bool = True) -> SpikeDetector:
        """A detector that records spikes; stopping is the loop's gate's job. ``builtin``:
        the run trains the built-in model, whose demo's rule the unset fields take."""
        ratio, window = self.ratio, self.window
        if builtin and ratio is None and self.z_score is None and self.robust_z is None:
            ratio, window = DEMO_RATIO, DEMO_WINDOW if window is None else window
        return SpikeDetector(
            monitor=self.monitor,
            window=window,
            warmup=self.warmup,
            ratio=ratio,
            z_score=self.z_score,
            robust_z=self.robust_z,
            action="log",
            min_step=default_min_step if self.min_step is None else self.min_step,
            curves=_demo_curves() if builtin else None,
        )


def _demo_curves() -> dict[str, str]:
    """The built-in model's tag of each record key: its spikes drawn on its own curves."""
    from lit_spikes.tools.defaults import LOGGED_AS  # the seam; imported when built

    return dict(LOGGED_AS)
