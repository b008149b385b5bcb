"""``lit-spikes study --model X --data Y`` (issue 66) on modules written for the tests:
through the console script in a new process, the report's findings against the cells'
own files; a module whose resume is not exact fails the exact-resume finding; the
options' checks before anything runs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lit_spikes.tools.cli import main as lit_spikes
from lit_spikes.tools.study.config import StudyConfig
from tests.modules.study_modules import STUDY_ARGS

REPO = Path(__file__).resolve().parents[2]


def _findings(root: Path) -> dict[str, tuple[int, int]]:
    with (root / "findings.csv").open() as handle:
        return {row["key"]: (int(row["holds"]), int(row["n"])) for row in csv.DictReader(handle)}


def _cells(root: Path) -> dict[str, dict[str, Any]]:
    return {
        str(p.parent.relative_to(root)): json.loads(p.read_text())
        for p in root.glob("*/*/cell.json")
    }


@pytest.fixture(scope="module")
def studied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``lit-spikes study --quick`` on ``ChartedConv`` with batch 35 poisoned, in a new
    process (the console script's module): its log root and what it printed."""
    root = tmp_path_factory.mktemp("study") / "run"
    script = "import sys; from lit_spikes.tools.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", script, "study", *STUDY_ARGS, "--quick", "--log_root", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root, done.stdout


@pytest.mark.slow
def test_the_study_of_a_users_module_finds_its_planted_spike(studied: tuple[Path, str]) -> None:
    """Two seeds (``--quick``), each spiking at the poisoned batch 35: both flagged, both
    resumes exact, skipping the data beats doing nothing in both (by ``val_loss``), and
    diagnose calls both spikes data-caused."""
    root, printed = studied
    found = _findings(root)
    assert found["spike"] == (2, 2)
    assert found["exact_resume_equal"] == (2, 2)
    assert found["skip_data_better"] == (2, 2)
    assert found["skip_data_better_no_spike"] == (0, 0)
    assert found["diagnose_data-caused"] == (2, 2)
    assert set(found) >= {f"{r}_better" for r in ("scale_lr", "skip_step", "clip")}
    assert "the exact resume equals the reference" in printed and "2 of 2 seeds" in printed


@pytest.mark.slow
def test_the_findings_are_the_cells_own(studied: tuple[Path, str]) -> None:
    """Each count re-derived from the cells' files: the reference's onsets, the resume's
    comparison, the diagnosis; each seed's own weights (``--seed_args``: the two seeds'
    do-nothing runs end apart)."""
    root, _ = studied
    cells = _cells(root)
    seeds = ["seed00", "seed01"]
    assert sorted(cells) == sorted(
        f"{s}/{c}"
        for s in seeds
        for c in (
            "reference",
            "resume_exact",
            "skip_data",
            "scale_lr",
            "skip_step",
            "clip",
            "diagnose_step35",
        )
    )
    for seed in seeds:
        assert cells[f"{seed}/reference"]["onsets"] == [35]
        assert cells[f"{seed}/skip_data"]["onsets"] == []  # the window covers batch 35
        assert cells[f"{seed}/resume_exact"]["params_equal"] is True
        assert cells[f"{seed}/resume_exact"]["start_step"] == 30
        assert cells[f"{seed}/diagnose_step35"]["cause"] == "data-caused"
    finals = [_last_val(cells[f"{s}/reference"]["records"]) for s in seeds]
    assert finals[0] != finals[1]
    report = (root / "report.md").read_text()
    assert "val_loss at step 60" in report and "| 0 | 35 | 30 | equal |" in report
    with (root / "cells.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(cells)


def _last_val(records: list[dict[str, Any]]) -> float:
    return float([r for r in records if "val_step" in r][-1]["val"]["val_loss"])


def test_a_resume_that_is_not_exact_fails_the_finding(tmp_path: Path) -> None:
    """The control: a module keeping a count no checkpoint holds resumes onto other
    inputs; the study says so (0 of 1) and names what differs."""
    args = [
        a
        if a != "tests.modules.tb_modules.ChartedConv"
        else "tests.modules.study_modules.CountingConv"
        for a in STUDY_ARGS
    ]
    args += ["--seeds", "[0]", "--ladder", "[lit_spikes.callbacks.ClipGradients]"]
    run = lit_spikes(["study", *args, "--workers", "1", "--log_root", str(tmp_path)])
    assert run is not None
    assert _findings(tmp_path)["exact_resume_equal"] == (0, 1)
    resume = _cells(tmp_path)["seed00/resume_exact"]
    assert resume["losses_equal"] is False and resume["params_equal"] is False
    assert resume["differing"]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--seed_args", "[model.no_such_arg]", "seed_args: 'model.no_such_arg' names no init"),
        ("--seeds", "[1, 1]", "seeds=[1, 1] must be distinct"),
        ("--no_spike_step", "12", "no_spike_step=12 must be in [checkpoint_every"),
        ("--ladder", "[scale_lr]", "ladder: 'scale_lr' is now named by its class"),
    ],
)
def test_bad_options_are_usage_errors_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    root = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        lit_spikes(["study", *STUDY_ARGS, option, value, "--log_root", str(root)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not root.exists()


def test_help_after_a_class_path_lists_the_modules_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        lit_spikes(["study", "--model", "tests.modules.tb_modules.ChartedConv", "--help"])
    out = capsys.readouterr().out
    assert "--seed_args" in out and "--ladder" in out
    assert "Given: tests.modules.tb_modules.ChartedConv" in out
    assert "--model.init_args.log_as" in out


def test_the_seed_goes_where_seed_args_say() -> None:
    config = StudyConfig(
        model={"class_path": "tests.modules.tb_modules.ChartedConv"},
        data={"class_path": "tests.modules.spiky_modules.ValidatedRegressionData"},
        seed_args=["model.seed", "data.seed"],
        max_steps=60,
        checkpoint_every=10,
        val_every=20,
    )
    run = config.recover(7)
    assert run.model["init_args"]["seed"] == 7 and run.data["init_args"]["seed"] == 7
    assert run.seed == 7 and config.model["init_args"].get("seed") is None
