"""The loop's ledger, ``<log_root>/ledger.json``: every branch, every intervention and
every event, rewritten atomically after each one, with a format version a reader checks
before it trusts anything else in the file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from lit_spikes.callbacks.spike import Spike
from lit_spikes.checkpoints import atomic_write
from lit_spikes.shared.plain import plain_config
from lit_spikes.tools.judgement import Judgement, Rise

LEDGER_NAME = "ledger.json"
LEDGER_VERSION = 6
"""The ledger format this code writes. Version 2: the config names the model and data by
class path (``model``, ``data``), the ladder's rungs and each branch's remedies are
callbacks as ``{"class_path", "init_args"}``, comparison rows hold one ``measure`` of
every row, named in ``measured_by`` (before: ``final_loss``, of other batches per row).
Version 3: no field of the demo's: the totals' validation is the module's (``val``), the
rows' columns its ``cells``; no ``val_bpc``, ``max_logit`` or ``max_logit_after``.
Version 4: a comparison variant's branch holds ``model_changes`` (the module's
``init_args`` it changes) for version 3's ``gpt_changes`` (the demo's ``gpt`` alone).
Version 5: an intervention holds its spike's rise (``spike_rise``), a remedy branch its
judgement against it (``judgement``: the ratio that accepted or rejected it).
Version 6: a branch holds the TensorBoard tag of each curve its detector marked
(``charts``), the accepted run's tags."""
LEDGER_VERSIONS = (2, 3, 4, 5, 6)
"""The ledger formats this code reads (a version-1 ledger is refused by its number)."""


class LedgerMismatch(ValueError):
    """A ledger written with other arguments than this run's."""


class LedgerUnreadable(ValueError):
    """A ledger this version cannot read (another version, a damaged file)."""


class UnknownFormatVersion(LedgerUnreadable):
    """A ledger or history file of a format version this code does not read."""

    def __init__(self, path: str | Path, found: Any, readable: Sequence[int]) -> None:
        super().__init__(
            f"{path} has format version {found!r}; this lit-spikes reads version "
            f"{', '.join(map(str, readable))}: continue it with the lit-spikes that wrote it, "
            "or start over with --fresh"
        )
        self.path, self.found, self.readable = Path(path), found, tuple(readable)


class NotALogRoot(ValueError):
    """A log root that holds files but no recovery ledger: ``--fresh`` would clear it, a
    first start would delete what it names like its branch directories."""


BranchKind = Literal["base", "remedy", "continue", "compare"]
BranchStatus = Literal["pending", "running", "spiked", "finished"]


@dataclass
class BranchRecord:
    """One Trainer run of the loop (resumed, possibly, across interruptions)."""

    name: str
    """Its run directory under the log root, and its TensorBoard run."""
    kind: BranchKind
    start_step: int
    """Global step of the checkpoint it starts from (0: from scratch)."""
    ckpt_path: str | None
    parent: str | None
    """The branch whose checkpoint it starts from: the lineage goes through it."""
    remedies: list[dict[str, Any]] = field(default_factory=list)
    """Every remedy active on this lineage, inherited ones first: callbacks as
    ``{"class_path", "init_args"}`` (the arguments each was built with)."""
    remedy: str | None = None
    """The name of the rung this branch tries (remedy branches)."""
    intervention: int | None = None
    """Index of the intervention it belongs to."""
    gate: Literal["stop", "log"] = "stop"
    """``stop``: a new spike stops it; ``log``: spikes are recorded, training goes on."""
    accept_after: int | None = None
    """A remedy branch is accepted once it has trained this step without a spike."""
    model_changes: dict[str, Any] = field(default_factory=dict)
    """What a comparison variant changes of the config's model ``init_args``
    (``ToolFacts.variants``: the demo's QK-norm, ``{"gpt": {"qk_norm": true}}``)."""
    status: BranchStatus = "pending"
    accepted_at: int | None = None
    spike: Spike | None = None
    """The spike that stopped it."""
    end_step: int | None = None
    """Last global step it trained."""
    steps_trained: int = 0
    """Steps it trained (each once: steps redone after an interruption are not counted)."""
    steps_repeated: int = 0
    """Steps trained again after an interruption (bit-exact recomputation)."""
    restarts: int = 0
    batches_skipped: int = 0
    """Data positions its skip set made it jump over."""
    skip_stepped: list[int] = field(default_factory=list)
    """Steps whose update ``SkipStep`` dropped."""
    absorbed: list[Spike] = field(default_factory=list)
    """Spikes whose update ``SkipStep`` dropped: they never reached the weights."""
    unrecovered: list[Spike] = field(default_factory=list)
    """Spikes a ``log`` gate recorded."""
    wall_s: float = 0.0
    note: str = ""
    """Why it exists, for the ones the loop adds when it gives up."""
    judgement: Judgement | None = None
    """A remedy branch's rise against its spike's as it reached ``accept_after``: under
    the bar it was accepted, at or over it rejected (None: not judged so far)."""
    charts: dict[str, str] = field(default_factory=dict)
    """The tag of each curve its detector watched, whose chart shows its marks
    (``SpikeDetector.charts``: ``{"loss": "train_loss"}``)."""


@dataclass
class Intervention:
    """One spike on the lineage and what the loop did about it."""

    index: int
    spike: Spike
    """step, metric, value, reference, data position, and the branch it stopped."""
    ckpt_step: int
    ckpt_path: str | None
    owner: str | None
    """The branch whose checkpoint it is (None: from scratch)."""
    refused: list[str] = field(default_factory=list)
    """Newer checkpoints passed over (broken, or written after a non-finite step)."""
    tried: list[str] = field(default_factory=list)
    """Remedy branches, in ladder order."""
    outcomes: dict[str, str] = field(default_factory=dict)
    """Branch -> ``accepted`` or why it was rejected."""
    status: Literal["open", "accepted", "gave_up"] = "open"
    accepted: str | None = None
    reason: str = ""
    spike_rise: Rise | None = None
    """The spike's rise over the median before it, in ``rise_metric``: what each remedy
    branch's rise is held against (None: the lineage recorded no such curve)."""
    rise_metric: str = "loss"

    @property
    def steps_rolled_back(self) -> int:
        """Steps from the checkpoint to the spike, inclusive: trained again by every branch."""
        return self.spike.step + 1 - self.ckpt_step


@dataclass
class Totals:
    """The loop's cost, computed from the branches' own records when it finishes."""

    lineage: list[str]
    """Branches of the accepted lineage, oldest first."""
    steps_final: int
    """Steps of the finished run (the lineage)."""
    steps_trained: int
    """Steps trained by all branches of the loop (comparison rows left out)."""
    steps_recomputed: int
    """``steps_trained - steps_final``: trained and then discarded by a rollback."""
    steps_repeated: int
    """Steps trained again after interruptions (not part of ``steps_trained``)."""
    batches_skipped: int
    """Data positions the final run jumped over."""
    skip_stepped: list[int]
    """Steps of the final run whose update SkipStep dropped."""
    unrecovered: list[Spike]
    """Spikes of the final run that no remedy removed."""
    final_ckpt: str
    val: list[Any] | None = None
    """``[name, last value]`` of the module's validation metric (``ToolFacts``; None: it
    names none, or a ledger written before it was recorded)."""


@dataclass
class Ledger:
    """Everything the loop did, as written to ``ledger.json``."""

    config: dict[str, Any]
    version: int = LEDGER_VERSION
    status: Literal["running", "done"] = "running"
    branches: list[BranchRecord] = field(default_factory=list)
    interventions: list[Intervention] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    """Wall time of the loop over all its sessions."""
    sessions: int = 0
    totals: Totals | None = None
    comparison: list[dict[str, Any]] = field(default_factory=list)

    def branch(self, name: str) -> BranchRecord:
        for record in self.branches:
            if record.name == name:
                return record
        raise KeyError(f"no branch {name!r} in the ledger")

    def main_branches(self) -> list[BranchRecord]:
        """The branches of the loop itself (the comparison rows left out)."""
        return [b for b in self.branches if b.kind != "compare"]

    def remedy_count(self) -> int:
        return sum(b.kind == "remedy" for b in self.branches)

    def lineage(self, head: str) -> list[tuple[BranchRecord, int, int | None]]:
        """``(branch, first step, end step or None)`` segments from the first run to
        ``head``: each branch's steps in ``[first, end)`` are on the lineage."""
        segments: list[tuple[BranchRecord, int, int | None]] = []
        record: BranchRecord | None = self.branch(head)
        end: int | None = None
        while record is not None:
            segments.append((record, record.start_step, end))
            end = record.start_step
            record = self.branch(record.parent) if record.parent else None
        return segments[::-1]

    def lineage_spikes(self, head: str) -> list[Spike]:
        """Spikes on the lineage ending in ``head`` that reached the weights: stops of
        its branches and spikes their ``log`` gates recorded, each step once."""
        found = []
        for branch, first, end in self.lineage(head):
            for spike in [*branch.unrecovered, *([branch.spike] if branch.spike else [])]:
                if spike.step >= first and (end is None or spike.step < end):
                    found.append(spike)
        return dedupe_spikes(found)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = plain_config(asdict(self, dict_factory=_record))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | Path = "the ledger") -> Ledger:
        """A ledger from ``to_dict``'s output.

        Raises:
            UnknownFormatVersion: a format version this code does not read (``source``
                names the file in its message).
        """
        data = dict(data)
        if data.get("version") not in LEDGER_VERSIONS:
            raise UnknownFormatVersion(source, data.get("version"), LEDGER_VERSIONS)
        data["version"] = LEDGER_VERSION  # read into this version's fields, written so
        data["branches"] = [_branch(b) for b in data.get("branches", [])]
        data["interventions"] = [_intervention(i) for i in data.get("interventions", [])]
        if data.get("totals") is not None:
            totals = _totals(data["totals"])
            data["totals"] = Totals(**(totals | {"unrecovered": _spikes(totals["unrecovered"])}))
        return cls(**data)


SPIKE_FIELDS = [f.name for f in fields(Spike)]


def _record(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``asdict``'s dicts, a spike's as its plain record (``Spike.to_dict``: the fields it
    holds, as the ledger always wrote it)."""
    if [key for key, _ in pairs] == SPIKE_FIELDS:
        return Spike(**dict(pairs)).to_dict()
    return dict(pairs)


def _spikes(records: Sequence[Any]) -> list[Spike]:
    return [Spike.of(record) for record in records]


def _totals(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2's totals in version 3's fields: its ``val_bpc`` (the demo's bits/char, in
    the ledgers written before the module's metric was recorded) as ``val``."""
    data = dict(data)
    bpc = data.pop("val_bpc", None)
    if data.get("val") is None and bpc is not None:
        data["val"] = ["val bits/char", bpc]
    return data


def _intervention(data: dict[str, Any]) -> Intervention:
    rise = data.get("spike_rise")
    rise = None if rise is None else Rise.of(rise)
    return Intervention(**(data | {"spike": Spike.of(data["spike"]), "spike_rise": rise}))


def _branch(data: dict[str, Any]) -> BranchRecord:
    """A branch record, its spikes read as ``Spike`` (from any version's plain records);
    version 2's ``val_bpc`` and ``max_logit`` (the demo's, never shown) left out, and
    versions 2 and 3's ``gpt_changes`` (the demo's QK-norm) read as ``model_changes``."""
    data = {k: v for k, v in data.items() if k not in ("val_bpc", "max_logit")}
    gpt = data.pop("gpt_changes", None)
    if gpt:
        data["model_changes"] = {"gpt": gpt}
    spikes = {key: _spikes(data.get(key, [])) for key in ("absorbed", "unrecovered")}
    stop, judged = data.get("spike"), data.get("judgement")
    data |= {"spike": None if stop is None else Spike.of(stop)}
    data |= {"judgement": None if judged is None else Judgement.of(judged)}
    return BranchRecord(**(data | spikes))


def dedupe_spikes(spikes: Sequence[Spike]) -> list[Spike]:
    """One record per (step, metric), in step order."""
    unique = {(s.step, s.metric): s for s in spikes}
    return [unique[key] for key in sorted(unique)]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so ``path`` holds the old file or the whole new one, durably."""
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def write_ledger(path: Path, ledger: Ledger) -> None:
    atomic_write_text(path, json.dumps(ledger.to_dict(), indent=1) + "\n")


def refuse_foreign_classes(config: Any, path: Path) -> None:
    """Before a ledger's ``config`` (read from ``path``) is built into a ``RecoverConfig``,
    which imports its class paths: one whose code lies where the user did not put it (the
    log root, the working directory, the standard library) is refused.

    Raises:
        LedgerUnreadable: naming the class path, the file and the flag that takes it.
    """
    from lit_spikes.tools.import_guard import first_refusal

    refused = first_refusal(config, path, ("model", "data"))
    if refused is not None:
        raise LedgerUnreadable(refused)


def read_ledger(log_root: str | Path) -> Ledger:
    """The ledger of a recovery loop run under ``log_root``.

    Raises:
        FileNotFoundError: there is none.
        LedgerUnreadable: it is not a ledger this version can read (``UnknownFormatVersion``:
            another format version, named).
    """
    path = Path(log_root) / LEDGER_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no recovery ledger at {path}")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError(f"it holds a {type(data).__name__}, not a mapping")
        return Ledger.from_dict(data, source=path)
    except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as error:
        raise LedgerUnreadable(
            f"ledger {path} is unreadable ({error}); start over with --fresh"
        ) from None
