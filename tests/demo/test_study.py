"""`lit-spikes study`: the Wilson interval, the early-warning leads, the remedies'
placement, the presets, usage errors before any run, and the quick preset end to end:
the report's counts against the cells' own files, and a rerun that computes only the
cell that was not finished."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from lit_spikes.demo.study.cells import REMEDIES, RESULT, placement
from lit_spikes.demo.study.cli import main
from lit_spikes.demo.study.config import QUICK, LeadConfig, StudyConfig
from lit_spikes.demo.study.findings import wilson
from lit_spikes.demo.study.leads import crossings, lead

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "study"


def test_wilson_interval() -> None:
    lo, hi = wilson(11, 12)  # the issue's example: 0.65-0.99
    assert (round(lo, 2), round(hi, 2)) == (0.65, 0.99)
    assert wilson(0, 12)[0] == 0.0 and 0.2 < wilson(0, 12)[1] < 0.3
    assert wilson(12, 12)[1] == 1.0 and 0.7 < wilson(12, 12)[0] < 0.8
    assert all(math.isnan(x) for x in wilson(0, 0))
    with pytest.raises(ValueError, match="k=3"):
        wilson(3, 2)


def test_lead_counts_steps_from_the_first_crossing_before_the_onset() -> None:
    config = LeadConfig(ratio=1.5, window=3, lookback=4)
    values = {s: 1.0 for s in range(20)}
    values[8] = 9.0  # a crossing far before the spike: outside the lookback
    values[14] = values[15] = 2.0  # crosses at 14 (2 > 1.5 x 1), no longer at 15
    assert crossings(values, config) == [8, 14]
    assert lead(values, onset=16, config=config) == 2
    assert lead(values, onset=14, config=config) == 0
    assert lead(values, onset=19, config=config) is None


def test_placement_is_the_checkpoint_before_the_spike_and_the_demos_windows() -> None:
    config = StudyConfig()
    plan = placement(config, 147)  # the README's spike: the demos' step-100 checkpoint
    assert plan["ckpt_step"] == 100
    assert plan["skip_before"] == [117, 147] and plan["skip_straddle"] == [137, 167]
    assert placement(config, None)["place"] == config.no_spike_step


def test_presets_are_the_yaml_files_and_the_default_meets_the_issue() -> None:
    assert yaml.safe_load((CONFIGS / "quick.yaml").read_text()) == QUICK
    default = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    assert StudyConfig(**_built(default)) == StudyConfig(log_root=Path("runs/study"))
    config = StudyConfig()
    assert len(config.seeds) >= 12 and config.sweep.seeds >= 3
    lrs = config.sweep.peak_lrs
    assert len(lrs) >= 5 and math.log10(max(lrs) / min(lrs)) >= 2 - 1e-9


def _built(values: dict[str, Any]) -> dict[str, Any]:
    from lit_spikes.demo.study.config import LeadConfig, SweepConfig

    return values | {
        "sweep": SweepConfig(**values["sweep"]),
        "leads": LeadConfig(**values["leads"]),
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "warmup_steps=100 must be in (0, steps=0)"),
        (["--model_seeds", "[1, 1]"], "model_seeds=[1, 1] must be distinct"),
        (["--sweep.seeds", "0"], "sweep.seeds=0 must be >= 1"),
        (["--no_spike_step", "60"], "no_spike_step=60 must be in"),
        (["--steps_per_run", "3"], "--steps_per_run"),
        (["--workers", "-1"], "workers=-1 must be >= 0"),
        (["--recurrence", "0"], "recurrence=0.0 must be in (0, 1] (diagnose's bar)"),
    ],
)
def test_bad_options_exit_2_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    root = tmp_path / "study"
    with pytest.raises(SystemExit) as exit_info:
        main(["--log_root", str(root), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not root.exists()


def test_a_log_root_of_another_study_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "study"
    root.mkdir()
    (root / "study.json").write_text(json.dumps({"fingerprint": "0123"}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--quick", "--log_root", str(root)])
    assert exit_info.value.code == 2
    assert "holds a study run with other settings" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["study.json"]


def _cells_on_disk(root: Path) -> dict[str, dict[str, Any]]:
    return {
        str(path.parent.relative_to(root)): json.loads(path.read_text())
        for path in root.glob(f"*/*/{RESULT}")
    }


def _counts_from_disk(cells: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """The findings recounted from the cells' files, independently of the report's code."""
    seeds: dict[str, dict[str, dict[str, Any]]] = {}
    for name, cell in cells.items():
        if not name.startswith("sweep/"):
            seeds.setdefault(name.split("/")[0], {})[cell["kind"]] = cell
    runs = list(seeds.values())
    ref = [s["reference"] for s in runs]

    def below(kind: str) -> int:
        return sum(s[kind]["val_bpc"] < s["reference"]["val_bpc"] for s in runs)

    n = len(runs)
    counts = {
        "spike": (sum(r["onset"] is not None for r in ref), n),
        "exact_resume_equal": (
            sum(
                s["resume_exact"]["params_equal"] and s["resume_exact"]["losses_equal"]
                for s in runs
            ),
            n,
        ),
        "fresh_adamw_worse": (n - below("fresh_adamw"), n),
        "other_data_differs": (sum(not s["other_data_seed"]["losses_equal"] for s in runs), n),
        "scale_lr_better": (below("scale_lr"), n),
        "skip_before_better": (below("skip_before"), n),
        "skip_straddle_better": (below("skip_straddle"), n),
        "clip_no_cure": (n - below("clip"), n),
        "qk_norm_bounds_logit": (
            sum(s["qk_norm"]["max_logit"] < s["reference"]["max_logit"] for s in runs),
            n,
        ),
    }
    diagnosed = [s["diagnose"]["cause"] for s in runs if "diagnose" in s]
    for cause in set(diagnosed):
        counts[f"diagnose_{cause}"] = (diagnosed.count(cause), len(diagnosed))
    return counts


def _findings_csv(root: Path) -> dict[str, tuple[int, int]]:
    with (root / "findings.csv").open() as handle:
        return {row["key"]: (int(row["holds"]), int(row["n"])) for row in csv.DictReader(handle)}


@pytest.mark.slow
def test_quick_study_end_to_end_and_a_rerun_computes_only_what_is_unfinished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "study"
    first = main(["--quick", "--log_root", str(root), "--workers", "2"])
    config = StudyConfig(**_built(QUICK) | {"log_root": root})
    seeds = len(config.seeds)
    sweep = len(config.sweep.peak_lrs) * 2 * config.sweep.seeds
    cells = _cells_on_disk(root)
    spiked = sum(c["onset"] is not None for c in cells.values() if c["kind"] == "reference")
    assert len(cells) == seeds * (2 + len(REMEDIES)) + spiked + sweep
    assert sorted(first.computed) == sorted(cells)
    # Every training cell is a Lightning run of its own, with the HParams to filter it by.
    for name, cell in cells.items():
        if cell["kind"] != "diagnose":
            events = b"".join(p.read_bytes() for p in (root / name).glob("events.out.tfevents.*"))
            assert b"model_seed" in events and cell["kind"].encode() in events, name
    assert _findings_csv(root) == _counts_from_disk(cells)
    assert all(c["params_equal"] for c in cells.values() if c["kind"] == "resume_exact")
    progress = capsys.readouterr().err
    assert f"study: {len(cells)}/{len(cells)} cells done" in progress and "left" in progress

    # A killed cell: no cell.json, leftovers in its directory. The rerun of the same
    # command computes it alone (here in this process) and ends with the same numbers.
    victim = f"{config.seeds[-1][0]:02d}"
    victim = next(n for n in cells if n.startswith(f"seed{victim}") and n.endswith("/scale_lr"))
    (root / victim / RESULT).unlink()
    (root / victim / "leftover.tmp").write_text("half a run")
    before = {n: (root / n / RESULT).read_bytes() for n in cells if n != victim}
    report = (root / "findings.csv").read_text()
    # An interim report counts only what is done, and computes nothing.
    interim = main(["--quick", "--log_root", str(root), "--report_only"])
    assert interim.computed == [] and not (root / victim / RESULT).exists()
    assert _findings_csv(root)["scale_lr_better"][1] == seeds - 1
    second = main(["--quick", "--log_root", str(root), "--workers", "1"])
    assert second.computed == [victim]
    assert {n: (root / n / RESULT).read_bytes() for n in before} == before
    assert not (root / victim / "leftover.tmp").exists()
    again = json.loads((root / victim / RESULT).read_text())
    assert again["history"] == cells[victim]["history"]
    assert again["val_bpc"] == cells[victim]["val_bpc"]
    assert (root / "findings.csv").read_text() == report


def test_lit_spikes_study_is_a_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lit_spikes.tools.cli import main as lit_spikes

    with pytest.raises(SystemExit) as exit_info:
        lit_spikes(["--help"])
    assert "\n  study " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        lit_spikes(["study", "--log_root", str(tmp_path / "s"), "--sweep.peak_lrs", "[]"])
    assert exit_info.value.code == 2
    assert "sweep.peak_lrs=[] must be positive LRs" in capsys.readouterr().err
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
