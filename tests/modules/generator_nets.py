"""Modules that draw noise from a generator of their own, held every way a user holds one
(issue 62, case 3): a NumPy ``Generator`` or ``RandomState``, a ``random.Random``, a
torch ``Generator`` in a list, a dict or a tuple, or on a plain helper object; and one made
in the first ``training_step``. Each is a ``DrawingNet`` (dropout, augmentation, a drawing
validation) whose ``training_step`` adds the generator's noise to its inputs."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from lit_spikes.randomness import Generator
from tests.modules.drawing_runs import SITES, DrawingNet


class Noise:
    """A plain helper object holding a generator (not a module)."""

    def __init__(self, generator: Generator) -> None:
        self.generator = generator


def noise(generator: Generator, shape: torch.Size) -> torch.Tensor:
    """Standard normal noise of ``shape`` drawn from ``generator``."""
    if isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator)
    if isinstance(generator, np.random.Generator | np.random.RandomState):
        return torch.from_numpy(generator.standard_normal(tuple(shape))).float()
    values = [generator.gauss(0.0, 1.0) for _ in range(math.prod(shape))]
    return torch.tensor(values).reshape(shape)


class HoldingNet(DrawingNet):
    """Draws from the generator its ``holding`` says (a subclass per way of holding)."""

    holding = "a numpy Generator"

    def __init__(self, sites: frozenset[str] = SITES) -> None:
        super().__init__(sites)
        if self.holding == "a numpy Generator":
            self.rng: Any = np.random.default_rng(7)
        elif self.holding == "a numpy RandomState":
            self.rng = np.random.RandomState(7)
        elif self.holding == "a random.Random":
            self.rng = random.Random(7)
        elif self.holding == "a torch.Generator in a list":
            self.rngs: Any = [torch.Generator().manual_seed(7)]
        elif self.holding == "a torch.Generator in a dict":
            self.rngs = {"noise": torch.Generator().manual_seed(7)}
        elif self.holding == "a numpy Generator in a tuple":
            self.rngs = (np.random.default_rng(7),)
        elif self.holding == "a torch.Generator on a plain object":
            self.helper = Noise(torch.Generator().manual_seed(7))

    def generator(self) -> Generator | None:
        if hasattr(self, "rng"):
            return self.rng  # type: ignore[no-any-return]
        if hasattr(self, "rngs"):
            rngs = self.rngs
            return rngs["noise"] if isinstance(rngs, dict) else rngs[0]  # type: ignore[no-any-return]
        if hasattr(self, "helper"):
            return self.helper.generator
        if not hasattr(self, "late") and self.global_step >= self.late_at:
            self.late = torch.Generator().manual_seed(7)  # made in a training_step
        return getattr(self, "late", None)  # type: ignore[no-any-return]

    late_at = 0
    """The global step whose training_step makes the generator of a ``LateNet``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        generator = self.generator()
        if generator is not None:
            x = x + 0.1 * noise(generator, x.shape)
        return super().training_step((x, y), batch_idx)


HOLDINGS = (
    "a numpy Generator",
    "a numpy RandomState",
    "a random.Random",
    "a torch.Generator in a list",
    "a torch.Generator in a dict",
    "a numpy Generator in a tuple",
    "a torch.Generator on a plain object",
)
NETS: dict[str, type[HoldingNet]] = {
    holding: type(f"Holding{i}", (HoldingNet,), {"holding": holding})
    for i, holding in enumerate(HOLDINGS)
}
"""A module per way of holding a generator that ExactResume keys."""


class LateNet(HoldingNet):
    """Makes its ``torch.Generator`` in the fit's first ``training_step``."""

    holding = "made in the first training_step"


class LaterNet(LateNet):
    """Makes its ``torch.Generator`` in the ``training_step`` of global step 5 (of 6-step
    epochs, files every 4 steps): found at the next epoch's start."""

    late_at = 5


class SavedLateNet(LateNet):
    """Makes its ``torch.Generator`` in global step 2's ``training_step``: found at the
    checkpoint of step 4 (files every 4 steps), which names it."""

    late_at = 2


class QuietNumpyNet(HoldingNet):
    """A NumPy ``Generator`` attribute is all that draws (no dropout, augmentation or
    drawing validation): what check-resume names first, from the command line."""

    def __init__(self) -> None:
        super().__init__(frozenset())
