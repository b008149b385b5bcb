"""The generators a module holds, keyed by the step as the process's RNGs are (issue 62,
case 3): a torch ``Generator``, a NumPy ``Generator`` or ``RandomState``, a
``random.Random``; an attribute of the module or a submodule, in a list, tuple or dict,
or on a plain object it holds (``lit_spikes.randomness.module_generators``). Each draws
from a derivation of (its own seed, what draws, step, ..., rank); its seed is the file's
at a resume, else what it had when first seen (a torch ``Generator``'s
``initial_seed()``, a digest of the others' state), saved by its path.

They are looked for at the fit's first step (after ``on_train_start``), again at that
step's end (one made in the first ``training_step``), at each epoch's start and at each
checkpoint (a file names every one there is). One that appears after the first step's
start drew unkeyed until found: said, with the fix.
"""

from __future__ import annotations

import warnings

import torch

from lit_spikes.randomness import (
    Generator,
    derive,
    generator_kind,
    generator_seed,
    module_generators,
    seed_generator,
)
from lit_spikes.stacklevel import outside_lightning


class ModuleGenerators:
    """The module's generators of one fit, with the seeds their draws derive from."""

    def __init__(self) -> None:
        self.found: dict[str, Generator] | None = None
        self.seeds: dict[str, int] = {}
        self.saved: dict[str, int] | None = None
        """The seeds by path the resumed file holds (None: no resume, or none saved)."""

    def of(self, module: torch.nn.Module) -> dict[str, Generator]:
        """The generators, found at the first call of a fit."""
        if self.found is None:
            self.found = {}
            self._add(module_generators(module))
            extra = set(self.found) - set(self.saved) if self.saved is not None else set()
            for path in sorted(extra):
                self._say(f"only this module has a {generator_kind(self.found[path])} '{path}'")
        return self.found

    def rescan(self, module: torch.nn.Module, when: str, first: bool) -> None:
        """Look again (``first``: at the end of the fit's first step, where a file's
        generator missing now is said): one found now drew unkeyed until here."""
        if self.found is None:
            return
        new = {p: g for p, g in module_generators(module).items() if p not in self.found}
        new = {p: g for p, g in new.items() if all(g is not h for h in self.found.values())}
        self._add(new)
        for path, generator in new.items():
            self._say(
                f"the module's {generator_kind(generator)} '{path}' appeared during the fit "
                f"(found {when}), after the step's draws were keyed: what it drew "
                "until then is no function of the step, and a resumed fit, which makes it "
                "anew, draws otherwise; create it in __init__ or setup, not in a step"
            )
        missing = sorted(set(self.saved or {}) - set(self.found))
        for path in missing if first else []:
            self._say(f"only the checkpoint's run has a generator '{path}'")

    def seed(self, domain: int, *key: int) -> None:
        """Set each generator from (its seed, ``domain``, ``key``); ``key`` ends with the
        rank."""
        for path, generator in (self.found or {}).items():
            seed_generator(generator, derive(self.seeds[path], domain, *key))

    def state(self) -> dict[str, int]:
        """The seeds by path, for the checkpoint."""
        return {path: self.seeds[path] for path in self.found or {}}

    def _add(self, generators: dict[str, Generator]) -> None:
        assert self.found is not None
        for path, generator in generators.items():
            saved = (self.saved or {}).get(path)
            self.seeds[path] = generator_seed(generator) if saved is None else saved
            self.found[path] = generator

    @staticmethod
    def _say(what: str) -> None:
        if what.startswith("only"):
            what += ": its draws are not those of the run that wrote the checkpoint"
        warnings.warn(f"ExactResume: {what}", stacklevel=outside_lightning())
