"""A deterministic synthetic text world and its character tokenizer.

The world is a small cast of people, places and objects, and a few hundred thousand
characters of templated sentences about how they relate. Everything is generated from
one seed with Python's own ``random.Random`` so the text is identical on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

import torch

ALPHABET = "\n .,'abcdefghijklmnopqrstuvwxyz0123456789"
"""Every character the world writes; the tokenizer's vocabulary, in id order."""

_FIRST_NAMES = (
    "ada",
    "alan",
    "amir",
    "anna",
    "bela",
    "boris",
    "chen",
    "clara",
    "dara",
    "emil",
    "eva",
    "farid",
    "greta",
    "hana",
    "ivan",
    "jonas",
    "kira",
    "lars",
    "lena",
    "mara",
    "milo",
    "nadia",
    "omar",
    "pia",
    "rosa",
    "sami",
    "tara",
    "ugo",
    "vera",
    "wen",
    "yara",
    "zoe",
)
_PLACES = (
    "the mill",
    "the harbour",
    "the old library",
    "the market",
    "the north tower",
    "the bakery",
    "the school",
    "the river bank",
    "the station",
    "the garden",
    "the forge",
    "the inn",
    "the chapel",
    "the bridge",
)
_OBJECTS = (
    "a red lamp",
    "a brass key",
    "an old map",
    "a blue jar",
    "a silver coin",
    "a wooden box",
    "a green book",
    "a small bell",
    "a clay cup",
    "a long rope",
    "a black hat",
    "a glass bird",
    "an iron pot",
    "a white scarf",
)
_RELATIONS = ("friend", "sister", "brother", "teacher", "neighbour", "cousin", "rival")
_JOBS = ("baker", "smith", "clerk", "sailor", "farmer", "painter", "miller", "guard")


@dataclass(frozen=True)
class WorldConfig:
    """How the synthetic world is generated."""

    seed: int = 0
    """Seed of the generator: the same seed gives the same text, byte for byte."""
    num_people: int = 24
    """How many people live in the world (at most the number of first names, 30)."""
    num_chars: int = 400_000
    """Approximate total length of the text, train and validation together."""
    val_fraction: float = 0.1
    """Share of the text, at its end, kept for validation."""

    def __post_init__(self) -> None:
        if not 2 <= self.num_people <= len(_FIRST_NAMES):
            raise ValueError(f"num_people={self.num_people} must be in [2, {len(_FIRST_NAMES)}]")
        if self.num_chars < 1_000:
            raise ValueError(f"num_chars={self.num_chars} is too small: use at least 1000")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction={self.val_fraction} must be in (0, 0.5)")


class World:
    """A fixed cast with fixed facts, and a text that states them in many sentences.

    Facts (who lives where, who owns what, who is whose friend) are drawn once, so the
    text is learnable: a model that remembers the facts predicts it better.
    """

    def __init__(self, config: WorldConfig | None = None) -> None:
        self.config = config or WorldConfig()
        rng = random.Random(self.config.seed)
        self.people = rng.sample(_FIRST_NAMES, self.config.num_people)
        self.home = {p: rng.choice(_PLACES) for p in self.people}
        self.job = {p: rng.choice(_JOBS) for p in self.people}
        self.owns = {p: rng.choice(_OBJECTS) for p in self.people}
        self.age = {p: rng.randint(8, 80) for p in self.people}
        self.relation = {
            p: (rng.choice(_RELATIONS), rng.choice([q for q in self.people if q != p]))
            for p in self.people
        }

    def _sentence(self, rng: random.Random, p: str) -> str:
        """One sentence about person ``p``; everything after the choice of template follows
        from the world's facts, so the text is learnable."""
        rel, q = self.relation[p]
        kind = rng.randrange(7)
        if kind == 0:
            return f"{p} lives near {self.home[p]}."
        if kind == 1:
            return f"{p} is a {self.job[p]}, aged {self.age[p]}."
        if kind == 2:
            return f"{p} keeps {self.owns[p]} at {self.home[p]}."
        if kind == 3:
            return f"{p} is the {rel} of {q}."
        if kind == 4:
            return f"{p} walked to {self.home[q]} to see {q}, the {rel}."
        if kind == 5:
            return f"at {self.home[q]}, {p} gave {self.owns[p]} to {q}."
        return f"the {self.job[p]} {p} said, 'i left {self.owns[p]} by {self.home[q]}.'"

    @cached_property
    def text(self) -> str:
        """The whole text: sentences, a few per line, about ``num_chars`` long."""
        rng = random.Random(self.config.seed + 1)
        lines: list[str] = []
        length = 0
        while length < self.config.num_chars:
            # A line is about one person: the name recurs, so attending back to it pays.
            person = rng.choice(self.people)
            sentences = (self._sentence(rng, person) for _ in range(rng.randint(2, 5)))
            line = " ".join(sentences) + "\n"
            lines.append(line)
            length += len(line)
        return "".join(lines)

    def _split(self) -> int:
        cut = int(len(self.text) * (1.0 - self.config.val_fraction))
        return self.text.rindex("\n", 0, cut) + 1

    def train_text(self) -> str:
        """The training part: everything before the split, ending on a full line."""
        return self.text[: self._split()]

    def val_text(self) -> str:
        """The validation part: the remaining lines."""
        return self.text[self._split() :]


def build_world(config: WorldConfig | None = None) -> World:
    """The built-in world (seed 0 by default)."""
    return World(config)


class CharTokenizer:
    """Maps each character of a fixed alphabet to its index and back."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self._index = {c: i for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor.

        Raises:
            ValueError: if a character is not in the alphabet; names it and its position.
        """
        try:
            ids = [self._index[c] for c in text]
        except KeyError:
            pos = next(i for i, c in enumerate(text) if c not in self._index)
            raise ValueError(
                f"character {text[pos]!r} at position {pos} is not in the tokenizer's alphabet "
                f"{self.alphabet!r}; remove it or extend the alphabet"
            ) from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of a sequence of token ids."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(self.alphabet[i] for i in values)
