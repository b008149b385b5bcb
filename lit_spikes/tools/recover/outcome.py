"""What a finished loop adds up to: the totals of its accepted lineage, the rows that
compare it with doing nothing and with QK-norm, and the lineage stitched into one
TensorBoard run."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_spikes.tools.defaults import LOGGED_AS, STEP_SCALARS
from lit_spikes.tools.recover.history import lineage_records
from lit_spikes.tools.recover.ledger import Ledger, Totals
from lit_spikes.tools.recover.measure import common_measure, validations

ACCEPTED_RUN = "accepted"
"""TensorBoard run of the stitched accepted lineage, ``<log_root>/accepted``."""
COMPARISON_ROWS = (
    ("compare/do_nothing", "do nothing (continue through the spike)"),
    ("compare/qk_norm", "QK-norm at the same LR (from scratch)"),
)


def totals(ledger: Ledger, records: Sequence[dict[str, Any]], final_ckpt: Path) -> Totals:
    """The loop's cost and its final run's counts, from the branches' own records and
    ``records``, the final lineage's."""
    head = ledger.main_branches()[-1]
    steps = [r for r in records if "step" in r]
    vals = [r for r in records if "val_bpc" in r]
    main = ledger.main_branches()
    last = steps[-1]
    return Totals(
        lineage=[b.name for b, _, _ in ledger.lineage(head.name)],
        steps_final=len(steps),
        steps_trained=sum(b.steps_trained for b in main),
        steps_recomputed=sum(b.steps_trained for b in main) - len(steps),
        steps_repeated=sum(b.steps_repeated for b in ledger.branches),
        batches_skipped=int(last["position"] - last["step"]),
        skip_stepped=sorted(int(r["step"]) for r in steps if r.get("skipped")),
        unrecovered=ledger.lineage_spikes(head.name),
        val_bpc=float(vals[-1]["val_bpc"]) if vals else None,
        final_ckpt=str(final_ckpt),
    )


def _max_logit_after(records: Sequence[dict[str, Any]], first: int) -> float | None:
    steps = (r for r in records if "step" in r and r["step"] >= first and "max_logit" in r)
    return max((float(r["max_logit"]) for r in steps), default=None)


def comparison_rows(
    ledger: Ledger, root: Path, records: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Rows of the report: the recovered run (``records``: its lineage's), and with
    ``compare`` doing nothing and QK-norm. ``spikes`` counts flagged steps (the recovered
    run: those on its lineage that no remedy removed; a rejected branch's spike is not on
    it). ``measure`` is one measure of every row, named in ``measured_by`` (``measure``)."""
    assert ledger.totals is not None
    first = int(ledger.interventions[0].spike["step"]) if ledger.interventions else 0
    recovered = "recovered (accepted lineage)"
    rows: list[dict[str, Any]] = [
        {
            "run": recovered,
            "val_bpc": ledger.totals.val_bpc,
            "spikes": len(ledger.totals.unrecovered),
            "max_logit_after": _max_logit_after(records, first),
        }
    ]
    measured: dict[str, Sequence[dict[str, Any]]] = {recovered: records}
    names = {b.name for b in ledger.branches}
    for name, label in COMPARISON_ROWS:
        if name not in names:
            continue
        row_records = lineage_records(ledger, root, name)
        vals = [r for r in row_records if "val_bpc" in r]
        rows.append(
            {
                "run": label,
                "val_bpc": float(vals[-1]["val_bpc"]) if vals else None,
                "spikes": len(ledger.lineage_spikes(name)),
                "max_logit_after": _max_logit_after(row_records, first),
            }
        )
        measured[label] = row_records
    measure = common_measure(measured)
    for row in rows:
        row["measure"], row["measured_by"] = measure.values[row["run"]], measure.name
    return rows


TAGS = {"loss": "train/loss", **{key: LOGGED_AS.get(key, key) for key in STEP_SCALARS}}
"""The per-step tags of the stitched run: those every branch logs (``TinyGPTModule``)."""


def write_stitched_run(
    run_dir: Path, records: Sequence[dict[str, Any]], spikes: Sequence[dict[str, Any]] = ()
) -> None:
    """Write the accepted lineage as one TensorBoard run, each step once: the same tags
    as the branches, validation at the index of its last step (as Lightning logs it)."""
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(run_dir, ignore_errors=True)
    steps = [int(r["step"]) for r in records if "step" in r]
    if len(steps) != len(set(steps)):
        raise RuntimeError(f"the stitched lineage holds a step twice: {sorted(steps)}")
    writer = SummaryWriter(log_dir=str(run_dir))
    try:
        for record in records:
            if "step" in record:
                for key, tag in TAGS.items():
                    if key in record:
                        writer.add_scalar(tag, float(record[key]), int(record["step"]))
                if record.get("skipped"):
                    writer.add_scalar("skip_step/skipped", 1.0, int(record["step"]))
            else:
                for name, value in validations([record]).get(int(record["val_step"]), {}).items():
                    writer.add_scalar(name, value, int(record["val_step"]) - 1)
        for spike in spikes:
            writer.add_scalar(f"spike/{spike['metric']}", float(spike["value"]), int(spike["step"]))
    finally:
        writer.close()
