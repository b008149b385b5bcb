"""The demos' study as one configuration of the study of any module (``make study``:
configs/study/demo.yaml), the command's place among ``lit-spikes``'s, the Wilson interval
and a Ctrl-C that stops the pool."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lit_spikes.tools.cli import main as lit_spikes
from lit_spikes.tools.study.config import StudyConfig
from lit_spikes.tools.study.findings import wilson

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "study"


def _config(name: str, **changes: Any) -> StudyConfig:
    return StudyConfig(**yaml.safe_load((CONFIGS / name).read_text()) | changes)


def test_wilson_interval() -> None:
    lo, hi = wilson(11, 12)  # Wilson's 95% interval of 11 of 12: 0.65-0.99
    assert (round(lo, 2), round(hi, 2)) == (0.65, 0.99)
    assert wilson(0, 12)[0] == 0.0 and 0.2 < wilson(0, 12)[1] < 0.3
    assert wilson(12, 12)[1] == 1.0 and 0.7 < wilson(12, 12)[0] < 0.8
    assert all(math.isnan(x) for x in wilson(0, 0))
    with pytest.raises(ValueError, match="k=3"):
        wilson(3, 2)


def test_make_study_runs_the_demos_configuration_which_meets_the_issue() -> None:
    """``make study`` is ``lit-spikes study --config configs/study/demo.yaml``: the demo by
    its class path, 12 seeds, a sweep of 3 seeds over two decades with and without
    QK-norm; its quick form is the same study, smaller (the same rungs, control, variant)."""
    makefile = (REPO / "Makefile").read_text()
    assert "STUDY_CONFIG ?= configs/study/demo.yaml" in makefile
    assert re.search(r"study --config \$\(STUDY_CONFIG\)", makefile)
    full, quick = _config("demo.yaml"), _config("demo-quick.yaml")
    assert full.model["class_path"] == "lit_spikes.demo.module.TinyGPTModule"
    assert len(full.seeds) >= 12 and full.sweep.seeds >= 3 and full.variants
    lrs = full.sweep.peak_lrs
    assert lrs is not None and len(lrs) >= 5 and math.log10(max(lrs) / min(lrs)) >= 2 - 1e-9
    assert full.sweep.variant == quick.sweep.variant == "qk_norm"
    assert full.rung_names == quick.rung_names and full.controls == quick.controls
    assert (full.log_root, quick.log_root) == (Path("runs/study"), Path("runs/study-quick"))


def _recounted(cells: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """The demo's findings for one seed, recounted from the cells' files apart from the
    report's code: val bits/char at the last validation, the largest logit over the run."""

    def bpc(name: str) -> float:
        return float([r for r in cells[name]["records"] if "val_step" in r][-1]["val"]["val/bpc"])

    def logit(name: str) -> float:
        return max(float(r["max_logit"]) for r in cells[name]["records"] if "max_logit" in r)

    spiked = cells["seed00/reference"]["onset"] is not None
    suffix = "" if spiked else "_no_spike"
    resume = cells["seed00/resume_exact"]
    counts = {
        "spike": (int(spiked), 1),
        "exact_resume_equal": (int(resume["params_equal"] and resume["losses_equal"]), 1),
        "other_data_seed_differs": (int(not cells["seed00/other_data_seed"]["losses_equal"]), 1),
        "variant_qk_norm_better": (int(bpc("seed00/variant_qk_norm") < bpc("seed00/reference")), 1),
        "variant_qk_norm_lowers_max_logit": (
            int(logit("seed00/variant_qk_norm") < logit("seed00/reference")),
            1,
        ),
    }
    for rung in ("fresh_adamw", "skip_before", "skip_straddle", "scale_lr", "clip"):
        counts[f"{rung}_better{suffix}"] = (int(bpc(f"seed00/{rung}") < bpc("seed00/reference")), 1)
    return counts


@pytest.mark.slow
def test_the_demos_quick_study_through_the_cli(tmp_path: Path) -> None:
    """configs/study/demo-quick.yaml on one seed: every cell the demos' study names, and
    the report's counts as the cells' own files give them."""
    root = tmp_path / "study"
    args = ["study", "--config", str(CONFIGS / "demo-quick.yaml"), "--seeds", "[0]"]
    run = lit_spikes([*args, "--workers", "2", "--log_root", str(root)])
    assert run is not None
    cells = {
        str(p.parent.relative_to(root)): json.loads(p.read_text())
        for p in root.glob("*/*/cell.json")
    }
    rows = ["reference", "resume_exact", "other_data_seed", "variant_qk_norm"]
    rows += ["fresh_adamw", "skip_before", "skip_straddle", "scale_lr", "clip"]
    assert {f"seed00/{row}" for row in rows} <= set(cells)
    assert len([n for n in cells if n.startswith("sweep/")]) == 2 * 2  # 2 LRs, with and without
    with (root / "findings.csv").open() as handle:
        found = {r["key"]: (int(r["holds"]), int(r["n"])) for r in csv.DictReader(handle)}
    expected = _recounted(cells)
    assert {k: found[k] for k in expected} == expected
    assert found["exact_resume_equal"] == (1, 1) and found["other_data_seed_differs"] == (1, 1)
    assert (root / "study_outcomes.png").exists() and (root / "report.md").exists()


def test_lit_spikes_study_is_a_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        lit_spikes(["--help"])
    assert "\n  study " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        lit_spikes(["study", "--log_root", str(tmp_path / "s"), "--seeds", "[]"])
    assert exit_info.value.code == 2
    assert "seeds=[] must be distinct seeds >= 0" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_a_signal_whose_raise_was_dropped_still_stops_the_study() -> None:
    """A signal's raise that lands in a weakref callback is printed and dropped: the study
    must not go on computing cells, nor end as done, after a Ctrl-C."""
    import signal

    from lit_spikes.tools.study.jobs import StudyInterrupted, _signals_stop

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(StudyInterrupted) as stopped, _signals_stop() as check:
            check()  # nothing fired yet: no raise
            with pytest.raises(StudyInterrupted):  # as if a weakref callback dropped it
                signal.raise_signal(signal.SIGINT)
            with pytest.raises(StudyInterrupted):
                check()  # between cells
        assert stopped.value.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
