"""``lit-spikes study --model X --data Y`` (issue 66) on modules written for the tests:
through the console script in a new process, the report's findings against the cells'
own files; a module whose resume is not exact fails the exact-resume finding; the
options' checks before anything runs."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lit_spikes.tools.cli import main as lit_spikes
from lit_spikes.tools.study.config import StudyConfig
from lit_spikes.tools.study.early_warning import (
    LeadConfig,
    LeadCount,
    count_run,
    find_blocks,
    verdict,
)
from tests.modules.study_modules import RUN_ARGS, STUDY_ARGS

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
    """``lit-spikes study --quick`` on ``ValidatedRegressor`` with batch 35 poisoned, its
    LR swept, in a new process (the console script's module): its log root and what it
    printed."""
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
    resumes exact, each remedy beats doing nothing in both (by ``val_loss``: the spike's
    damage is removed), and diagnose calls both spikes data-caused."""
    root, printed = studied
    found = _findings(root)
    assert found["spike"] == (2, 2)
    assert found["exact_resume_equal"] == (2, 2)
    for rung in ("skip_data", "scale_lr", "skip_step", "clip"):
        assert found[f"{rung}_better"] == (2, 2), rung
        assert found[f"{rung}_better_no_spike"] == (0, 0), rung
    assert found["diagnose_data-caused"] == (2, 2)
    assert "the exact resume equals the reference" in printed and "2 of 2 seeds" in printed


@pytest.mark.slow
def test_the_findings_are_the_cells_own(studied: tuple[Path, str]) -> None:
    """Each count re-derived from the cells' files: the reference's onsets, the resume's
    comparison, the diagnosis; each seed's own weights (``--seed_args``: the two seeds'
    do-nothing runs end apart)."""
    root, _ = studied
    cells = _cells(root)
    seeds = ["seed00", "seed01"]
    kinds = ("reference", "resume_exact", "skip_data", "scale_lr", "skip_step", "clip")
    seeded = [f"{s}/{c}" for s in seeds for c in (*kinds, "diagnose_step35")]
    assert sorted(c for c in cells if not c.startswith("sweep/")) == sorted(seeded)
    for seed in seeds:
        assert cells[f"{seed}/reference"]["onsets"] == [35]
        assert 35 not in cells[f"{seed}/skip_data"]["onsets"]  # its window covers batch 35
        assert cells[f"{seed}/resume_exact"]["params_equal"] is True
        assert cells[f"{seed}/resume_exact"]["start_step"] == 30
        assert cells[f"{seed}/diagnose_step35"]["cause"] == "data-caused"
    finals = [_last_val(cells[f"{s}/reference"]["records"]) for s in seeds]
    assert finals[0] != finals[1]
    report = (root / "report.md").read_text()
    assert "val_loss at step 60" in report and "| 0 | 35 | 30 | equal |" in report
    for signal in ("grad_norm", "loss trend (5-step mean)", "update net.0", "update net.2"):
        assert f"**{signal}**" in report  # the MLP's two linear layers, found by structure
    assert "warns best" in report or "No signal warns better than chance" in report
    with (root / "cells.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(cells) - 6  # the sweep's apart
    for figure in ("study_outcomes.png", "study_warnings.png", "study_sweep.png"):
        assert (root / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_sweep_spans_two_decades_and_gives_wortsmans_sensitivity(
    studied: tuple[Path, str],
) -> None:
    """``--quick``'s sweep: the model's own LR (0.1) times 0.1, 1 and 10, plain and with
    the variant (a 4x wider hidden layer), each from scratch; each point's losses are the
    run's validation before its first step and after its last; the LR sensitivity printed
    is recomputed here from sweep.csv by the paper's definition."""
    root, printed = studied
    with (root / "sweep.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(round(float(r["peak_lr"]), 9), r["variant"]) for r in rows] == [
        (lr, v) for lr in (0.01, 0.1, 1.0) for v in ("False", "True")
    ]
    assert {r["measure"] for r in rows} == {"val_loss"}
    cells = _cells(root)
    wide = cells["sweep/lr0.01-variant-seed00"]
    assert wide["records"][0]["val_step"] == 0  # validated before the first step
    assert (
        wide["start_step"] == 0 and not (root / "sweep/lr0.01-variant-seed00/checkpoints").exists()
    )
    for variant, name in (("False", "plain"), ("True", 'with {"hidden": 128}')):
        arm = [r for r in rows if r["variant"] == variant]
        initial = sum(float(r["initial_loss"]) for r in arm) / len(arm)
        finals = [float(r["final_loss"]) for r in arm]
        finals = [f if math.isfinite(f) else initial for f in finals]
        best = min([*finals, initial])
        expected = sum(min(f, initial) - best for f in finals) / len(finals)
        assert f"LR sensitivity {name}: {expected:.4f} over peak LRs 0.01-1 " in printed


def _last_val(records: list[dict[str, Any]]) -> float:
    return float([r for r in records if "val_step" in r][-1]["val"]["val_loss"])


def test_a_resume_that_is_not_exact_fails_the_finding(tmp_path: Path) -> None:
    """The control: a module keeping a count no checkpoint holds resumes onto other
    inputs; the study says so (0 of 1) and names what differs."""
    args = ["--model", "tests.modules.study_modules.CountingConv", *RUN_ARGS, "--seeds", "[0]"]
    args += ["--ladder", "[lit_spikes.callbacks.ClipGradients]"]
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
        ("--sweep.lr_arg", "model.no_lr", "the model's no_lr is None, not a learning rate"),
        ("--sweep.variant", "qk_norm", "sweep.variant='qk_norm': tests.modules.spiky"),
        ("--sweep.factors", "[1.0]", "sweep.factors=[1.0] must be two or more"),
        ("--variants", "true", "ValidatedRegressor states no ToolFacts.variants"),
        ("--controls", "{other: {optim: {}}}", "StudyConfig.controls: 'other'"),
        (
            "--ladder",
            "[lit_spikes.callbacks.ClipGradients, lit_spikes.callbacks.ClipGradients]",
            "must be named apart",
        ),
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
    assert "--seed_args" in out and "--ladder" in out and "--sweep.lr_arg" in out
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


def test_alarms_count_against_the_spikes_that_follow_within_the_lead() -> None:
    """A signal flat at 1 crosses at step 30 (3 steps before the spike at 33) and at step
    10 (no spike follows): at lead 1 both are false alarms; at lead 5 one is true, the
    spike is warned, and chance is the share of the judged steps a spike follows within
    5. The spike's own step and its aftermath (its window) are not judged."""
    config = LeadConfig(ratio=1.5, window=4, leads=[1, 5])
    values = {s: 1.0 for s in range(45)}
    values[10] = values[30] = 2.0
    values[33] = values[34] = 9.0  # the spike and the step after it: not judged
    counts = [LeadCount(lead) for lead in config.leads]
    count_run(values, [33], {33}, config, counts, first_step=0)
    one, five = counts
    judged = [s for s in range(4, 45) if not 33 <= s < 37]
    assert (one.alarms, one.true_alarms, one.warned) == (2, 0, 0)
    assert (five.alarms, five.true_alarms, five.warned, five.spikes) == (2, 1, 1, 1)
    assert five.steps == len(judged) and five.followed == len(range(28, 33))
    assert five.chance == 5 / len(judged) and five.precision == 0.5


def test_blocks_are_found_by_the_modules_structure() -> None:
    """A transformer-like module: its ``ModuleList``'s items; a lone ``Sequential``: its
    layers with parameters (not the activation)."""
    from torch import nn

    class Tower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.head = nn.Linear(4, 5)

    assert list(find_blocks(Tower())) == ["blocks.0", "blocks.1", "blocks.2"]
    wrapped = nn.Sequential()
    wrapped.add_module("net", nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)))
    assert list(find_blocks(wrapped)) == ["net.0", "net.2"]


def test_a_signal_crossing_at_random_warns_no_better_than_chance() -> None:
    """Crossing every 5th step, once just before the one spike: 1 true alarm of 25,
    whose precision's interval reaches below chance; the verdict says no signal warns."""
    config = LeadConfig(ratio=1.5, window=4, leads=[1])
    values = {s: 2.0 if s % 5 == 4 else 1.0 for s in range(130)}
    values[100] = 9.0
    counts = [LeadCount(1)]
    count_run(values, [100], {100}, config, counts, first_step=0)
    (one,) = counts
    assert (one.alarms, one.true_alarms, one.warned) == (25, 1, 1)
    assert not one.better_than_chance
    assert verdict({"noise": counts}).startswith("No signal warns better than chance")


@pytest.mark.parametrize(("mode", "better"), [("min", "lower"), ("max", "higher")])
def test_a_remedy_is_better_by_the_modules_own_direction(mode: str, better: str) -> None:
    """Compared with doing nothing by the module's metric: lower is better, or higher for
    a module that says ``val_mode="max"`` (an accuracy)."""
    from types import SimpleNamespace

    from lit_spikes.tool_facts import ToolFacts
    from lit_spikes.tools.study.report import _better

    config: Any = SimpleNamespace(facts=ToolFacts(val_mode=mode))  # type: ignore[arg-type]
    lower = {"values": {"reference": 2.0, "clip": 1.0}}
    higher = {"values": {"reference": 2.0, "clip": 3.0}}
    assert _better(config, "clip", lower) is (better == "lower")
    assert _better(config, "clip", higher) is (better == "higher")
    assert _better(config, "clip", {"values": {"reference": 2.0, "clip": None}}) is None


def test_the_comparison_names_each_tensor_that_differs(tmp_path: Path) -> None:
    """The exact resume's comparison: every tensor ``torch.equal`` (a difference in the
    last bit of one is named), every loss logged equal (NaN equal to NaN)."""
    from types import SimpleNamespace

    import torch

    from lit_spikes.tools.study.cells import FINAL_STATE, _compare
    from lit_spikes.tools.study.jobs import Cell

    reference = tmp_path / "seed00" / "reference"
    reference.mkdir(parents=True)
    saved = {"a": torch.zeros(3), "b": torch.ones(2)}
    torch.save(saved, reference / FINAL_STATE)
    logged = [{"step": 5, "loss": 1.5}, {"step": 6, "loss": math.nan}]
    (reference / "cell.json").write_text(json.dumps({"records": logged}))
    config: Any = SimpleNamespace(log_root=tmp_path)
    cell = Cell("seed00/resume_exact", "resume_exact", 0, 0, 2)
    same = _compare(config, cell, {k: v.clone() for k, v in saved.items()}, logged)
    assert same == {"params_equal": True, "losses_equal": True, "differing": []}
    nudged = {"a": saved["a"], "b": torch.nextafter(saved["b"], torch.tensor(2.0))}
    other = _compare(config, cell, nudged, [{"step": 5, "loss": 1.5000001}])
    assert other == {"params_equal": False, "losses_equal": False, "differing": ["b"]}


def test_findings_count_seeds_with_and_without_a_spike_apart() -> None:
    """A remedy's findings: in the seed that spiked it ended lower than doing nothing
    (better), in the seed that did not, higher (its cost where nothing went wrong)."""
    from types import SimpleNamespace

    from lit_spikes.tool_facts import ToolFacts
    from lit_spikes.tools.study.report import findings

    rung = {"name": "clip", "class_path": "lit_spikes.callbacks.ClipGradients"}
    config: Any = SimpleNamespace(
        detector=SimpleNamespace(monitor=("loss",)),
        facts=ToolFacts(),
        rungs=({**rung, "init_args": {"value": 1.0}},),
        variant_cells=[],
        controls={},
    )
    exact = {"params_equal": True, "losses_equal": True}
    seeds = [
        {"reference": {"onset": 35}, "resume_exact": exact},
        {"reference": {"onset": None}, "resume_exact": exact},
    ]
    name = "val_loss at step 60 (the last validation of every run)"
    measures = [
        {"name": name, "values": {"reference": 2.0, "clip": 1.0}},
        {"name": name, "values": {"reference": 1.0, "clip": 1.5}},
    ]
    found = {f.key: (f.holds, f.n) for f in findings(config, seeds, measures)}
    assert found == {
        "spike": (1, 2),
        "exact_resume_equal": (2, 2),
        "clip_better": (1, 1),
        "clip_better_no_spike": (0, 1),
    }


@pytest.mark.slow
def test_every_cell_is_in_the_hparams_view(studied: tuple[Path, str]) -> None:
    """Each training cell is a TensorBoard run with its row, seed and kind (a sweep point
    its LR) and its final val_loss as ``hp/val_loss``; the report is TensorBoard text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    root, _ = studied
    cells = _cells(root)
    for name in ("seed01/skip_data", "sweep/lr1-variant-seed00"):
        accumulator = EventAccumulator(str(root / name), size_guidance={"tensors": 0})
        accumulator.Reload()
        content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        assert hparams["row"].string_value == name.rsplit("/", 1)[-1]
        assert hparams["seed"].number_value == int(name.endswith("01/skip_data"))
        final = [r["val"]["val_loss"] for r in cells[name]["records"] if "val_step" in r][-1]
        logged = accumulator.Scalars("hp/val_loss")[-1].value
        assert logged == pytest.approx(final, rel=1e-6) or math.isnan(final)  # float32
    assert hparams["peak_lr"].number_value == 1.0 and hparams["variant"].number_value == 1.0
    summary = EventAccumulator(str(root / "summary"), size_guidance={"tensors": 0})
    summary.Reload()
    text = summary.Tensors("study/report/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.startswith("# lit-spikes study")


def test_a_rerun_computes_only_the_cell_that_was_killed(tmp_path: Path) -> None:
    """A study is a job: a cell killed half-way (no ``cell.json``, leftovers in its
    directory) is all the same command computes again, to the same numbers; the other
    cells' files stay byte for byte, and the report is the same. An interim report
    (``--report_only``) computes nothing. Another study's settings in that log root are
    a usage error."""
    args = ["study", *STUDY_ARGS[:2], *RUN_ARGS, "--seeds", "[0]", "--workers", "1"]
    args += ["--ladder", "[lit_spikes.callbacks.LRScaler]", "--log_root", str(tmp_path)]
    first = lit_spikes(args)
    assert first is not None and sorted(first.computed) == sorted(_cells(tmp_path))
    victim = "seed00/scale_lr"
    before = {n: (tmp_path / n / "cell.json").read_bytes() for n in first.computed if n != victim}
    findings_before = (tmp_path / "findings.csv").read_text()
    killed = json.loads((tmp_path / victim / "cell.json").read_text())
    (tmp_path / victim / "cell.json").unlink()
    (tmp_path / victim / "leftover.tmp").write_text("half a run")
    interim = lit_spikes([*args, "--report_only"])
    assert interim is not None and interim.computed == []
    assert _findings(tmp_path)["scale_lr_better"] == (0, 0)
    second = lit_spikes(args)
    assert second is not None and second.computed == [victim]
    assert {n: (tmp_path / n / "cell.json").read_bytes() for n in before} == before
    assert not (tmp_path / victim / "leftover.tmp").exists()
    again = json.loads((tmp_path / victim / "cell.json").read_text())
    assert again["records"] == killed["records"]
    assert (tmp_path / "findings.csv").read_text() == findings_before
    with pytest.raises(SystemExit) as exit_info:
        lit_spikes([*args, "--rollback_distance", "6"])
    assert exit_info.value.code == 2
