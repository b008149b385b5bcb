"""Automatic spike recovery: a closed loop around Lightning runs (``lit-spikes recover``).

Training runs with a ``SpikeDetector`` and writes ``step=<k>.ckpt`` files: any
LightningModule on any LightningDataModule (``RecoverConfig.model`` and ``.data`` as class
paths with their ``init_args``, or factories given to ``recover``), by default the built-in
tiny GPT on its world. When a spike stops a run, the loop picks the newest valid checkpoint
at least ``rollback_distance`` steps before the spike's onset (``RollbackRestore``), and
tries remedies from that real file, one branch each, in the order of a configurable
ladder of callbacks named by class path (``remedies``; a user's own callback is a rung,
built for the spike by its ``for_spike`` classmethod if it has one). The default ladder:

1. ``BatchSkipper`` (``skip_data``): skip the data positions around the spike (PaLM);
2. ``LRScaler`` (``scale_lr``): multiply the LR from the checkpoint's step on (OPT);
3. ``SkipStep`` (``skip_step``): skip the update of outlier steps (OLMo-core);
4. ``ClipGradients`` (``clip``): clip the gradient norm.

A branch is accepted once it passes the spike's step plus ``accept_margin`` steps without
a new spike; a branch that spikes earlier is rejected and the next remedy is tried from
the same checkpoint. The accepted branch does not stop there: it trains on to the end
with its remedy callbacks (the remedy stays on) and its own detector, and a later spike
goes through the loop again, from that branch's checkpoints. The number of interventions
and of remedy branches is bounded; when a bound or the ladder is exhausted, the lineage
trains on to the end as it was, its spikes recorded as unrecovered.

Everything the loop decides is in its ledger, ``<log_root>/ledger.json``, rewritten
atomically after every event. A run interrupted at any moment (Ctrl-C, SIGTERM, SIGKILL)
and started again with the same arguments continues from the ledger: finished branches
are not run again, and the branch that was running resumes from its own newest
checkpoint, bit-exactly (its per-step records are kept in ``history.jsonl`` beside it).

TensorBoard: every branch is its own run, ``<log_root>/<branch>``, on the shared step
axis; the accepted lineage is also written as one stitched run, ``<log_root>/accepted``,
each step once. With ``compare=True`` two more rows show what the loop bought: doing
nothing (the first run continued through its spike) and the cause-aimed fix, QK-norm at
the same LR, trained from scratch.

Where to read on: ``config`` (the settings), ``ledger`` and ``history`` (the files and
their format versions), ``loop`` (the loop: plan, train, conclude), ``rollback`` (which
checkpoint a remedy starts from), ``remedies`` (the ladder's rungs), ``gate`` (a spike's
stop, a branch's acceptance), ``branch`` (one branch as a Lightning run), ``outcome``
and ``report`` (the totals and the tables), ``log_root`` (what ``--fresh`` may clear),
``cli`` (``lit-spikes recover``: ``RecoverConfig``'s fields on the shared command parser).
"""

from lit_spikes.tools.detector_config import DetectorConfig
from lit_spikes.tools.recover.cli import build_parser, main, parse
from lit_spikes.tools.recover.config import RecoverConfig
from lit_spikes.tools.recover.gate import SpikeGate, skip_stepped
from lit_spikes.tools.recover.history import (
    HISTORY_NAME,
    HISTORY_VERSION,
    HISTORY_VERSIONS,
    HistoryLog,
    read_history,
)
from lit_spikes.tools.recover.ledger import (
    LEDGER_NAME,
    LEDGER_VERSION,
    LEDGER_VERSIONS,
    BranchRecord,
    Intervention,
    Ledger,
    LedgerMismatch,
    LedgerUnreadable,
    NotALogRoot,
    Totals,
    UnknownFormatVersion,
    atomic_write_text,
    dedupe_spikes,
    read_ledger,
)
from lit_spikes.tools.recover.loop import RecoverInterrupted, RecoverResult, RecoveryLoop, recover
from lit_spikes.tools.recover.outcome import ACCEPTED_RUN, write_stitched_run
from lit_spikes.tools.recover.ranks import RankZeroStopped
from lit_spikes.tools.recover.remedies import (
    DEFAULT_LADDER,
    SpikeContext,
    describe_remedy,
    remedy_callbacks,
)
from lit_spikes.tools.recover.report import print_ledger

__all__ = [
    "ACCEPTED_RUN",
    "DEFAULT_LADDER",
    "HISTORY_NAME",
    "HISTORY_VERSION",
    "HISTORY_VERSIONS",
    "LEDGER_NAME",
    "LEDGER_VERSION",
    "LEDGER_VERSIONS",
    "BranchRecord",
    "DetectorConfig",
    "HistoryLog",
    "Intervention",
    "Ledger",
    "LedgerMismatch",
    "LedgerUnreadable",
    "NotALogRoot",
    "RankZeroStopped",
    "RecoverConfig",
    "RecoverInterrupted",
    "RecoverResult",
    "RecoveryLoop",
    "SpikeContext",
    "SpikeGate",
    "Totals",
    "UnknownFormatVersion",
    "atomic_write_text",
    "build_parser",
    "dedupe_spikes",
    "describe_remedy",
    "main",
    "parse",
    "print_ledger",
    "read_history",
    "read_ledger",
    "recover",
    "remedy_callbacks",
    "skip_stepped",
    "write_stitched_run",
]
