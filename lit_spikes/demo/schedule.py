"""The seed's learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier of step ``k`` (0-based): ``(k+1)/warmup`` during warm-up, then a cosine
    from 1 down to ``min_ratio`` at ``max_steps``; the whole curve times ``scale``.

    A plain frozen dataclass so ``LambdaLR.state_dict()`` saves it as data, and so that a
    resumed run rebuilds exactly the same function from the same four numbers.
    """

    warmup_steps: int = 100
    """Steps of linear warm-up."""
    max_steps: int = 400
    """Length of the run; the cosine reaches its floor here."""
    min_ratio: float = 0.1
    """The floor, as a fraction of the peak."""
    scale: float = 1.0
    """Multiplies the whole schedule (0.5 halves every step's LR)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.max_steps <= self.warmup_steps:
            raise ValueError(
                f"max_steps={self.max_steps} must be larger than warmup_steps={self.warmup_steps}"
            )
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio={self.min_ratio} must be in [0, 1]")
        if not (math.isfinite(self.scale) and self.scale > 0):  # NaN passes "<= 0"
            raise ValueError(f"scale={self.scale} must be finite and positive")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.scale * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.max_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.scale * (self.min_ratio + (1.0 - self.min_ratio) * cosine)
