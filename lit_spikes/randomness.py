"""Randomness as a pure function of a key: the process's RNGs (torch CPU and CUDA, Python,
NumPy) set from a counter-based derivation of (seed, what draws, step, ...), so that no RNG
state needs saving and nothing drawn elsewhere leaks into a keyed draw.

``ExactResume`` keys each training step by (seed, step, micro-batch, rank), what runs
between two steps by (seed, step, micro-batch, rank) in another domain, each validation by
(seed, step, rank) and each epoch's start by (seed, epoch, rank); ``StepLoader`` keys each
shard of the global batch it reads by (its seed, data position, shard).
docs/how-it-works.md says what this changes for a run.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

MASK64 = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15
"""splitmix64's increment (2**64 over the golden ratio)."""

STEP = 1
"""Domain of a training step's draws (its batch start hooks, forward, backward, step)."""
BETWEEN = 2
"""Domain of what runs after a step and before the next (hooks, a checkpoint's save)."""
VALIDATION = 3
"""Domain of a validation's draws (its start hooks on: ``validation_step``'s)."""
EPOCH = 4
"""Domain of an epoch's start (a shuffling loader's order is drawn there)."""
ROW = 5
"""Domain of the draws made while dataset rows are read (augmentation in ``__getitem__``),
keyed a shard of the global batch at a time."""


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit words that spreads every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive(seed: int, *key: int) -> int:
    """A 64-bit seed from ``seed`` and the non-negative integers of ``key``, each folded in
    by splitmix64: two keys that differ anywhere give unrelated seeds."""
    return _fold(mix64((seed * GOLDEN) & MASK64), key)


def derive_in(seed: int, domain: int, *key: int) -> int:
    """``derive(seed, domain, *key)``, from the (seed, domain) part kept: a step's seeds
    fold in three words instead of five (each step derives two or three)."""
    return _fold(_domain_root(seed, domain), key)


@functools.lru_cache(maxsize=64)
def _domain_root(seed: int, domain: int) -> int:
    return derive(seed, domain)


def _fold(x: int, key: tuple[int, ...]) -> int:
    for word in key:  # mix64, inlined: a call costs as much as its arithmetic
        x = (x + GOLDEN + word * 0xD1B54A32D192ED03) & MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
        x ^= x >> 31
    return x


def seed_all(seed64: int) -> None:
    """Set torch's CPU (and, once CUDA is initialized, every CUDA device's), Python's and
    NumPy's global RNG from one 64-bit seed.

    torch's CPU generator keeps only the low 32 bits of a seed (two of ~77,000 keys share a
    stream with even odds: docs/how-it-works.md), and NumPy's global ``RandomState`` takes
    an int of 32 bits (the high word here; an array of both costs 14 us a call against 2);
    CUDA's Philox and Python's take all 64. ``torch.manual_seed`` is not used: it costs
    ~150 us a call on a CPU build (it seeds every device type), the generator's own ~1 us;
    nor ``torch.cuda.is_available()`` (~5 us in a step: initialized implies available).
    """
    low, high = seed64 & 0xFFFFFFFF, seed64 >> 32
    torch.default_generator.manual_seed(low)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.manual_seed_all(seed64)  # sets each device's seed: no host sync
    random.seed(seed64)
    np.random.seed(high)


def collect_rng_states() -> dict[str, Any]:
    """torch (CPU, and each CUDA device once CUDA is initialized), Python and NumPy RNG
    states in plain types (``torch.load(weights_only=True)`` reads them)."""
    version, internal, gauss = random.getstate()
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)  # legacy=True: (kind, keys, pos, has_gauss, cached)
    kind, keys, pos, has_gauss, cached = state
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``collect_rng_states`` returned."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


@contextlib.contextmanager
def kept_rng_states() -> Iterator[None]:
    """Whatever is seeded and drawn inside leaves the process's CPU RNGs (torch, Python,
    NumPy) as they were. (CUDA's are left alone: a dataset's read runs on the host.)"""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


Generator = torch.Generator | np.random.Generator | np.random.RandomState | random.Random
"""What a module may draw from besides the global RNGs: a torch ``Generator``, a NumPy
``Generator`` (``np.random.default_rng``) or ``RandomState``, a ``random.Random``."""
KINDS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
DEPTH = 4
"""How deep ``module_generators`` looks into containers and plain objects."""
ITEMS = 64
"""Containers with more items are not searched (a list of numbers holds no generator,
and would cost a walk of it at each search)."""
FOREIGN = ("torch", "lightning", "numpy", "pandas", "builtins", "typing", "collections")
"""Packages whose objects are not searched (a Trainer, a tensor, a logger hold none of
the module's generators, and may hold much)."""


def module_generators(module: torch.nn.Module) -> dict[str, Generator]:
    """Every generator (``KINDS``) ``module`` and its submodules hold, by path: as an
    attribute (``"gen"``, ``"encoder.noise_gen"``), in a list, tuple or dict
    (``"gens[1]"``, ``"rngs['a']"``), or on a plain object one holds (``"helper.rng"``),
    up to ``DEPTH`` levels and ``ITEMS`` items a container; each generator once (its
    first path)."""
    found: dict[str, Generator] = {}
    seen: set[int] = set()
    modules = dict(module.named_modules())
    for name, sub in modules.items():
        for attr, value in vars(sub).items():
            if attr in _MODULE_INTERNALS:
                continue
            _search(value, f"{name}.{attr}" if name else attr, found, seen, DEPTH)
    return found


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
"""What every ``nn.Module`` holds of its own (submodules, parameters, hooks)."""


def _search(value: Any, path: str, found: dict[str, Generator], seen: set[int], depth: int) -> None:
    if id(value) in seen or isinstance(value, torch.nn.Module | torch.Tensor):
        return  # a submodule is searched under its own name
    seen.add(id(value))
    if isinstance(value, KINDS):
        found[path] = value
    elif depth == 0 or (isinstance(value, list | tuple | dict) and len(value) > ITEMS):
        return
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _search(item, f"{path}[{i}]", found, seen, depth - 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _search(item, f"{path}[{key!r}]", found, seen, depth - 1)
    elif _plain(value):
        for attr, item in vars(value).items():
            _search(item, f"{path}.{attr}", found, seen, depth - 1)


def _plain(value: Any) -> bool:
    """An instance of a class of the user's, with attributes to search."""
    package = type(value).__module__.partition(".")[0]
    return hasattr(value, "__dict__") and not isinstance(value, type) and package not in FOREIGN


def generator_kind(generator: Generator) -> str:
    """How a message names a generator's type."""
    if isinstance(generator, torch.Generator):
        return "torch.Generator"
    if isinstance(generator, np.random.Generator):
        return "numpy Generator"
    if isinstance(generator, np.random.RandomState):
        return "numpy RandomState"
    return "random.Random"


def seed_generator(generator: Generator, seed64: int) -> None:
    """Set ``generator`` from a 64-bit seed (a ``RandomState`` takes its high 32 bits)."""
    if isinstance(generator, torch.Generator):
        generator.manual_seed(seed64)
    elif isinstance(generator, random.Random):
        generator.seed(seed64)
    elif isinstance(generator, np.random.Generator):
        bits = generator.bit_generator
        bits.state = type(bits)(seed64).state
    else:
        generator.seed(seed64 >> 32)


def generator_state(generator: Generator) -> Any:
    """``generator``'s state as plain values (what a digest of it compares)."""
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, random.Random):
        return repr(generator.getstate())
    if isinstance(generator, np.random.Generator):
        return repr(generator.bit_generator.state)
    return repr(generator.get_state(legacy=True))


def generator_seed(generator: Generator) -> int:
    """The seed a generator's keyed draws derive from, as first seen: a torch
    ``Generator``'s ``initial_seed()``; the others keep none, so a 64-bit digest of their
    state (the same for the same seed)."""
    if isinstance(generator, torch.Generator):
        return generator.initial_seed()
    text = generator_state(generator).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
