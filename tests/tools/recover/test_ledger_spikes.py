"""The ledger's spikes are ``Spike`` objects in memory and the plain records it always
wrote on disk: a ledger of an earlier version (a ``position`` of null, no ``reference``)
reads back, and one written again holds the same records."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lit_spikes.callbacks import Spike
from lit_spikes.tools.recover.ledger import LEDGER_VERSION, Ledger, read_ledger, write_ledger

STOP = {"step": 31, "metric": "loss", "value": 9.5, "reference": 1.5, "position": 31}
LOGGED = {"step": 40, "metric": "grad_norm", "value": 7.0, "reference": 2.0, "position": None}
OLDEST = {"step": 45, "metric": "loss", "value": 3.0}


def ledger_data() -> dict[str, object]:
    branch = {"name": "main", "kind": "main", "start_step": 0, "ckpt_path": None, "parent": None}
    spiked = branch | {"status": "spiked", "spike": STOP, "unrecovered": [LOGGED, OLDEST]}
    intervention = {"index": 0, "spike": STOP | {"branch": "main"}, "ckpt_step": 20}
    intervention |= {"ckpt_path": "main/checkpoints/step=20.ckpt", "owner": "main"}
    return {"config": {}, "version": 2, "branches": [spiked], "interventions": [intervention]}


def test_a_ledgers_spikes_read_back_as_spikes_and_are_written_as_they_were(tmp_path: Path) -> None:
    (tmp_path / "ledger.json").write_text(json.dumps(ledger_data()))
    ledger = read_ledger(tmp_path)
    (branch,) = ledger.branches
    assert isinstance(branch.spike, Spike) and branch.spike.position == 31
    logged, oldest = branch.unrecovered
    assert logged.position is None and math.isnan(oldest.reference)
    (intervention,) = ledger.interventions
    assert intervention.spike.branch == "main" and intervention.steps_rolled_back == 12
    assert [s.step for s in ledger.lineage_spikes("main")] == [31, 40, 45]
    write_ledger(tmp_path / "again.json", ledger)
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["branches"][0]["spike"] == STOP
    assert again["interventions"][0]["spike"] == STOP | {"branch": "main"}
    written = again["branches"][0]["unrecovered"]
    assert written[0] == {k: v for k, v in LOGGED.items() if v is not None}
    assert {k: v for k, v in written[1].items() if k != "reference"} == OLDEST
    assert math.isnan(written[1]["reference"])  # the oldest records knew none
    text = json.dumps(again, sort_keys=True)  # NaN written as NaN: compared as text
    assert json.dumps(Ledger.from_dict(again).to_dict(), sort_keys=True) == text


def test_a_version_2_ledgers_demo_fields_read_as_the_modules() -> None:
    """Version 2 recorded the demo's ``val_bpc`` and ``max_logit`` for every module;
    version 3 records the module's validation metric alone (``Totals.val``)."""
    data = ledger_data()
    branch = data["branches"][0] | {"val_bpc": 1.2, "max_logit": 30.0}  # type: ignore[index]
    totals = {"lineage": ["main"], "steps_final": 40, "steps_trained": 40}
    totals |= {"steps_recomputed": 0, "steps_repeated": 0, "batches_skipped": 0}
    totals |= {"skip_stepped": [], "unrecovered": [OLDEST], "final_ckpt": "x.ckpt"}
    old = data | {"branches": [branch], "totals": totals | {"val_bpc": 1.25}}
    ledger = Ledger.from_dict(old)
    assert ledger.totals is not None and ledger.totals.val == ["val bits/char", 1.25]
    written = ledger.to_dict()
    assert written["version"] == LEDGER_VERSION and "val_bpc" not in written["totals"]
    assert not {"val_bpc", "max_logit"} & set(written["branches"][0])
    newer = Ledger.from_dict(old | {"totals": totals | {"val_bpc": 1.25, "val": ["acc", 0.9]}})
    assert newer.totals is not None and newer.totals.val == ["acc", 0.9]


def test_a_version_3_ledgers_qk_norm_branch_reads_as_the_modules_variant() -> None:
    """Versions 2 and 3 held the demo's QK-norm row as ``gpt_changes``; version 4 holds
    any variant's ``model_changes`` (``ToolFacts.variants``), over the model's init_args."""
    data = ledger_data()
    qk = data["branches"][0] | {"name": "compare/qk_norm", "gpt_changes": {"qk_norm": True}}  # type: ignore[index]
    ledger = Ledger.from_dict(data | {"version": 3, "branches": [qk]})
    assert ledger.branches[0].model_changes == {"gpt": {"qk_norm": True}}
    written = ledger.to_dict()
    assert written["version"] == LEDGER_VERSION and "gpt_changes" not in written["branches"][0]
    assert Ledger.from_dict(written).branches[0].model_changes == {"gpt": {"qk_norm": True}}
