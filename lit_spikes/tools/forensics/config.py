"""What the forensics replay measures and how it reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForensicsConfig:
    """The replay's steps, the bands and the layers measured."""

    window: int = 20
    """The steps before the spike's onset searched for the first statistic to leave its
    band (Marin's 32B run and the demo's study saw update norms lead by 10-20 steps)."""
    band_steps: int = 10
    """At least this many replayed steps before the window, each statistic's band: the
    replay starts at the newest checkpoint ``window + band_steps`` or more before the
    onset, and every step from it to the window is a band step."""
    after: int = 5
    """Steps replayed past the onset, to show what followed."""
    width: float = 12.0
    """A statistic leaves its band where it is more than this many robust standard
    deviations (1.4826 x the median absolute deviation of its band steps) from their
    median. On the planted faults of the tests, ordinary steps reached 10 (the kurtosis
    of a 16-row batch's outputs), the faults 18 and more (docs/recover-and-diagnose.md)."""
    floor: float = 0.1
    """The band's half-width is never less than this share of the median's size."""
    layers: list[str] | None = None
    """The submodules to measure, by name (``model.blocks.0``); None: found by the
    module's structure, every layer with parameters, a transformer's blocks one by
    one."""
    exact_resume: bool = True
    """Replay with ``ExactResume`` where the run's callbacks bring none (as diagnose)."""

    def __post_init__(self) -> None:
        for name in ("window", "band_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"ForensicsConfig.{name}={getattr(self, name)} must be >= 1")
        if self.band_steps < 3:
            raise ValueError(
                f"ForensicsConfig.band_steps={self.band_steps} must be >= 3: a band is a "
                "median and a spread"
            )
        if self.after < 0:
            raise ValueError(f"ForensicsConfig.after={self.after} must be >= 0")
        if not self.width > 0 or not self.floor >= 0:
            raise ValueError(
                f"ForensicsConfig.width={self.width} must be > 0 and floor={self.floor} >= 0"
            )
