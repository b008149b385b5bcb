"""The loop's use of the one judgement (``lit_spikes.tools.judgement``): the spike's
rise, measured as a remedy is planned, and what each remedy branch's gate holds its own
rise against before it accepts the branch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_spikes.callbacks import Spike
from lit_spikes.tool_facts import ToolFacts
from lit_spikes.tools.judgement import Judgement, Rise, rise_in
from lit_spikes.tools.recover.config import RecoverConfig
from lit_spikes.tools.recover.gate import RiseCheck
from lit_spikes.tools.recover.history import lineage_records
from lit_spikes.tools.recover.ledger import BranchRecord, Ledger


def spike_rise(
    records: Sequence[dict[str, Any]], spike: Spike, window: int
) -> tuple[str, Rise | None]:
    """The curve a remedy is judged by (the name the spike was flagged by where the
    lineage's ``records`` hold it, else the loss) and the spike's rise in it over the
    median of the detector's ``window`` steps before it (None: not recorded)."""
    at_spike = [r for r in records if r.get("step") == spike.step]
    metric = spike.metric if at_spike and spike.metric in at_spike[0] else "loss"
    return metric, rise_in(judged_curve(records, metric), spike.step, spike.step, window)


def judged_curve(records: Sequence[dict[str, Any]], metric: str) -> dict[int, float]:
    """``metric`` by step in a lineage's records, less the steps whose update ``SkipStep``
    dropped (``skipped``): their loss never reached the weights."""
    return {
        int(r["step"]): float(r[metric])
        for r in records
        if "step" in r and metric in r and not r.get("skipped")
    }


def rise_check(
    ledger: Ledger, root: Path, config: RecoverConfig, facts: ToolFacts, record: BranchRecord
) -> RiseCheck | None:
    """What a remedy branch's gate holds its rise against: its spike's rise and the
    curve of its lineage so far (None: no remedy, one accepted already, or a spike whose
    rise was not recorded: a ledger of an older version)."""
    if record.intervention is None or record.accepted_at is not None:
        return None
    intervention = ledger.interventions[record.intervention]
    if intervention.spike_rise is None:
        return None
    metric = intervention.rise_metric
    curve = judged_curve(lineage_records(ledger, root, record.name), metric)
    window = config.detector.build(facts).window
    return RiseCheck(
        metric, intervention.spike_rise, config.recurrence, window, record.start_step, curve
    )


def flag_judgement(
    ledger: Ledger, root: Path, config: RecoverConfig, facts: ToolFacts, branch: BranchRecord
) -> Judgement | None:
    """A remedy branch a new flag stopped: that flag's rise against its spike's, for the
    log (None: no rise recorded to hold it against)."""
    check = rise_check(ledger, root, config, facts, branch)
    if check is None or branch.spike is None:
        return None
    rise = rise_in(check.curve, branch.spike.step, branch.spike.step, check.window)
    return None if rise is None else Judgement(check.metric, rise, check.spike, check.bar)


def ratio_of(judgement: Judgement | None) -> dict[str, Any]:
    """A judgement's ratio for an event (``{}``: none; JSON has no inf)."""
    if judgement is None:
        return {}
    ratio = judgement.ratio
    return {"rise_ratio": round(ratio, 3) if math.isfinite(ratio) else "inf"}
