"""What the tools read of a module comes through ``ToolFacts`` alone: a module written for
the test (``FactRegressor``) states every fact otherwise than the defaults, and recover,
diagnose's judge and the stitched TensorBoard run follow it; a module that states none
gets tables and rules with nothing of the demo in them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_spikes.callbacks import SpikeDetector
from lit_spikes.tool_facts import Column, ToolFacts, Variant, facts_of
from lit_spikes.tools.detector_config import DetectorConfig
from lit_spikes.tools.diagnose.replay import judge_of
from lit_spikes.tools.recover import (
    RecoverConfig,
    print_ledger,
    read_ledger,
    recover,
)
from lit_spikes.tools.recover.history import lineage_records
from tests.modules.recover_setup import scale_lr
from tests.modules.spiky_modules import FactRegressor, JumpRegressor

FACTS = "tests.modules.spiky_modules.FactRegressor"
PLAIN = "tests.modules.spiky_modules.ValidatedRegressor"
DATA = {
    "class_path": "tests.modules.spiky_modules.ValidatedRegressionData",
    "init_args": {"rows": 4096},
}
RUNG = '[{"class_path": "lit_spikes.callbacks.LRScaler", "init_args": {"factor": 0.05}}]'


def ledger_text(root: Path) -> str:
    console = Console(width=250, record=True)
    print_ledger(read_ledger(root), console)
    return console.export_text()


def comparison_headers(text: str) -> list[str]:
    """The headers of the "What the loop bought" table in the printed ledger."""
    header = next(line for line in text.splitlines() if "spikes flagged" in line)
    return [cell.strip() for cell in header.strip("┃ ").split("┃")]


@pytest.fixture(scope="module")
def facts_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """recover on ``FactRegressor`` from the command line, with neither ``--max_steps``
    nor a ``--detector.*`` rule: both come from its facts."""
    from lit_spikes.tools.cli import main

    root = tmp_path_factory.mktemp("facts") / "run"
    argv = ["recover", "--model", FACTS, "--model.init_args.jump_step", "30"]
    argv += ["--data", DATA["class_path"], "--data.init_args.rows", "4096"]
    argv += ["--checkpoint_every", "10", "--val_every", "10", "--rollback_distance", "5"]
    argv += ["--accept_margin", "5", "--ladder", RUNG, "--compare", "true"]
    result = main([*argv, "--log_root", str(root)])
    assert result is not None and result.ledger.status == "done"
    return root


def test_recover_takes_the_run_length_rule_and_warmup_from_the_modules_facts(
    facts_run: Path,
) -> None:
    ledger = read_ledger(facts_run)
    assert ledger.totals is not None and ledger.totals.steps_final == 60  # its run_steps
    spike = ledger.interventions[0].spike
    assert int(spike["step"]) in (30, 31) and spike["reference"] > 0  # its ratio-4 rule
    config = RecoverConfig(model=FACTS, data=DATA, val_every=10)
    detector = config.detector.build(config.facts)
    assert (detector.ratio, detector.robust_z, detector.window) == (4.0, None, 20)
    assert (config.steps, detector.min_step) == (60, 12)
    model = {"class_path": FACTS, "init_args": {"run_steps": 40}}
    changed = RecoverConfig(model=model, data=DATA, val_every=10)
    assert changed.steps == 40  # read from an instance of its init_args


def test_the_comparison_shows_the_modules_columns_and_direction_only(facts_run: Path) -> None:
    text = ledger_text(facts_run)
    assert comparison_headers(text) == [
        "run",
        "val score",
        "spikes flagged",
        "largest LR after 1st spike",
        "largest weight norm after 1st spike",
        "compared",
    ]
    assert "compared by val_score at step 60" in text and "higher is better" in text
    assert "bits/char" not in text and "attn logit" not in text
    ledger = read_ledger(facts_run)
    assert ledger.totals is not None and ledger.totals.val is not None
    name, value = ledger.totals.val
    assert name == "val score" and f"val score {value:.3f}" in text
    nothing = next(r for r in ledger.comparison if r["run"].startswith("do nothing"))
    assert nothing["cells"][2] == ["largest LR after 1st spike", 2.0, 2]  # the jump: 0.1 x 20
    assert all(isinstance(row["cells"][3][1], float) for row in ledger.comparison)  # logged


def test_a_column_the_module_logs_itself_is_recorded_and_compared(facts_run: Path) -> None:
    """A column's key may be what the module logs with ``self.log`` (``FactRegressor``'s
    ``weight_norm``): each branch's history records it at every step, and the comparison
    shows its largest value from the first spike on (it showed n/a, the key unrecorded)."""
    ledger = read_ledger(facts_run)
    first = ledger.interventions[0].spike.step
    branch = next(b for b in ledger.branches if b.name == "compare/do_nothing")
    records = lineage_records(ledger, facts_run, branch.name)
    norms = [r["weight_norm"] for r in records if "step" in r]
    assert len(norms) == 60 and all(n > 0 for n in norms)  # every step, the module's value
    largest = max(r["weight_norm"] for r in records if r.get("step", -1) >= first)
    nothing = next(r for r in ledger.comparison if r["run"].startswith("do nothing"))
    assert nothing["cells"][3] == ["largest weight norm after 1st spike", largest, 2]


def test_the_modules_variant_is_a_comparison_row_from_scratch(facts_run: Path) -> None:
    """``--compare true`` trains the module's variant (``FactRegressor``: no LR jump) from
    scratch beside doing nothing: its init_args changed as the variant says, the others
    as given; the cause gone, it flags no spike where doing nothing does."""
    ledger = read_ledger(facts_run)
    branch = ledger.branch("compare/no_jump")
    assert (branch.start_step, branch.parent, branch.model_changes) == (0, None, {"jump": 1.0})
    final = torch.load(facts_run / "compare/no_jump/checkpoints/step=60.ckpt", weights_only=True)
    assert final["hyper_parameters"]["jump"] == 1.0
    assert final["hyper_parameters"]["jump_step"] == 30  # the command line's, kept
    rows = {row["run"]: row for row in ledger.comparison}
    assert rows["no LR jump (from scratch)"]["spikes"] == 0
    assert rows["do nothing (continue through the spike)"]["spikes"] >= 1
    assert "no LR jump (from scratch)" in ledger_text(facts_run)


def test_compare_names_the_modules_variants_and_refuses_others(tmp_path: Path) -> None:
    model = {"class_path": FACTS, "init_args": {"jump_step": 30}}
    given: dict[str, Any] = {"log_root": tmp_path, "model": model, "data": DATA, "val_every": 10}
    assert RecoverConfig(**given, compare="no_jump").compare_rows == ("no_jump",)
    assert RecoverConfig(**given, compare=True).compare_rows == ("do_nothing", "no_jump")
    with pytest.raises(ValueError, match=r"some of \['do_nothing', 'no_jump'\], each once"):
        RecoverConfig(**given, compare=["do_nothing", "qk_norm"])


def test_the_stitched_run_logs_the_loss_under_the_modules_tag(facts_run: Path) -> None:
    events = EventAccumulator(str(facts_run / "accepted"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "fit/loss" in tags and "train/loss" not in tags
    assert len(events.Scalars("fit/loss")) == 60


def test_a_module_that_states_nothing_gets_no_demo_column_or_rule(tmp_path: Path) -> None:
    model = {"class_path": PLAIN, "init_args": {"jump_step": 30}}
    config = RecoverConfig(
        log_root=tmp_path,
        model=model,
        data=DATA,
        max_steps=60,
        checkpoint_every=10,
        val_every=10,
        detector=DetectorConfig(ratio=4.0),
        rollback_distance=5,
        accept_margin=5,
        ladder=(scale_lr(0.05),),
        compare=True,
    )
    assert config.facts == ToolFacts()
    recover(config)
    text = ledger_text(tmp_path)
    assert comparison_headers(text) == ["run", "spikes flagged", "compared"]
    assert "bits/char" not in text and "attn logit" not in text and "n/a" not in text
    default = DetectorConfig().build(config.facts)
    assert (default.ratio, default.robust_z, default.min_step) == (None, 8.0, 0)


def test_diagnose_judges_by_the_modules_rule_where_none_is_given() -> None:
    judge = judge_of(DetectorConfig(), {}, lambda: facts_of(FactRegressor()))
    assert (judge.settings["ratio"], judge.settings["window"]) == (4.0, 20)
    plain = judge_of(DetectorConfig(), {}, lambda: facts_of(JumpRegressor()))
    assert (plain.settings["ratio"], plain.settings["robust_z"]) == (None, 8.0)
    given = judge_of(DetectorConfig(z_score=5.0), {}, lambda: facts_of(FactRegressor()))
    assert (given.settings["ratio"], given.settings["z_score"]) == (None, 5.0)


def test_facts_are_checked_when_stated() -> None:
    with pytest.raises(ValueError, match=r"val_mode='up' must be 'min' or 'max'"):
        ToolFacts(val_mode="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"run_steps=0 must be >= 1"):
        ToolFacts(run_steps=0)
    with pytest.raises(ValueError, match=r"warmup_steps=-1"):
        ToolFacts(warmup_steps=-1)
    with pytest.raises(ValueError, match=r"columns=.*must be Column objects"):
        ToolFacts(columns=("max_logit",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"digits=-1"):
        Column("lr", "LR", digits=-1)
    for name in ("do_nothing", "qk/norm", ""):
        with pytest.raises(ValueError, match=r"Variant.name=.*letters, digits and underscores"):
            Variant(name, "a row", {"lr": 0.1})
    with pytest.raises(ValueError, match=r"Variant 'slow': give a label and the init_args"):
        Variant("slow", "slower", {})
    twice = [Variant("slow", "slower", {"lr": 0.1}), Variant("slow", "slowest", {"lr": 0.01})]
    with pytest.raises(ValueError, match=r"variants: each name once, not \['slow', 'slow'\]"):
        ToolFacts(variants=twice)

    class Wrong(JumpRegressor):
        tool_facts = "val_loss"

    with pytest.raises(TypeError, match=r"Wrong.tool_facts is a str, not a lit_spikes.ToolFacts"):
        facts_of(Wrong())
    assert isinstance(DetectorConfig().build(facts_of(JumpRegressor())), SpikeDetector)


class DrawingFactRegressor(FactRegressor):
    """States its run length and draws from the global RNG when built, as a module that
    initialises its layers without its own seed does."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.nn.init.normal_(self.net[0].weight)


def test_fit_ends_where_the_module_states_unless_told(tmp_path: Path) -> None:
    from lit_spikes.tools.cli import main

    argv = ["fit", "--model", FACTS, "--model.init_args.run_steps", "24"]
    argv += ["--data", DATA["class_path"], "--data.init_args.rows", "4096"]
    argv += ["--checkpoint_every", "12", "--trainer.limit_val_batches", "0"]
    main([*argv, "--trainer.default_root_dir", str(tmp_path / "stated")])
    files = sorted(p.name for p in (tmp_path / "stated" / "checkpoints").glob("step=*.ckpt"))
    assert files == ["step=12.ckpt", "step=24.ckpt"]
    told = [*argv, "--trainer.max_steps", "12", "--trainer.default_root_dir", str(tmp_path / "t")]
    main(told)
    assert sorted(p.name for p in (tmp_path / "t" / "checkpoints").glob("*.ckpt")) == [
        "step=12.ckpt"
    ]


def test_reading_the_run_length_draws_nothing_from_the_runs_rngs() -> None:
    from lit_spikes.tools.fit_plan import stated_run_steps

    section = {
        "class_path": "tests.tools.test_tool_facts.DrawingFactRegressor",
        "init_args": {"run_steps": 33},
    }
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert stated_run_steps(section) == 33
    assert torch.equal(torch.rand(3), expected)
    assert stated_run_steps({"class_path": PLAIN, "init_args": {}}) is None  # states none


def test_fit_records_the_modules_validation_metric_for_the_hparams_view(tmp_path: Path) -> None:
    """The HPARAMS view's metric is the module's own (``hp/val_score``), not the demo's
    ``hp/val_bpc``, which a user's module never logs."""
    from lit_spikes.tools.cli import main

    argv = ["fit", "--model", FACTS, "--model.init_args.run_steps", "12"]
    argv += ["--data", DATA["class_path"], "--data.init_args.rows", "4096"]
    argv += ["--trainer.val_check_interval", "6", "--trainer.check_val_every_n_epoch", "null"]
    main([*argv, "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path)])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "hp/val_score" in scalars and "hp/val_bpc" not in scalars
    last = events.Scalars("val_score")[-1]
    (recorded,) = events.Scalars("hp/val_score")
    assert (recorded.step, recorded.value) == (last.step, last.value)


def test_recovers_events_name_the_modules_validation_metric(facts_run: Path) -> None:
    events = [e for e in read_ledger(facts_run).events if e["event"] in ("branch_finished", "done")]
    assert events and all("val_score" in e and "val_bpc" not in e for e in events)
    done = events[-1]
    assert done["event"] == "done" and done["val_score"] == read_ledger(facts_run).totals.val[1]


def test_diagnose_shows_the_modules_columns_and_no_other(facts_run: Path) -> None:
    """diagnose's table had a "max attn logit" column of n/a for every module: now the
    module's own columns (``FactRegressor``: its largest LR), none for one that states none."""
    from lit_spikes.tools.diagnose import Replay, Verdict, diagnose, print_verdict

    ckpt = next(facts_run.glob("*/checkpoints/step=20.ckpt"))
    model = {"class_path": FACTS, "init_args": {"jump_step": 30}}
    verdict = diagnose(ckpt, 31, model=model, data=DATA)
    assert [c.key for c in verdict.columns] == ["lr", "weight_norm"]
    assert verdict.same_data.extra["lr"] == 2.0  # a key of diagnose's own step records
    norm = verdict.same_data.extra["weight_norm"]  # one the module logs itself
    assert norm is not None and norm > 0

    def table(columns: tuple[Column, ...]) -> str:
        console = Console(width=200, record=True)
        same = Replay("same", 20, None, 3.0, 3.5, {"lr": 2.0}, [31], True, 40)
        print_verdict(Verdict("no-spike", 31, 20, "x", 3.0, same, [], None, [], columns), console)
        return console.export_text()

    assert "largest LR" in table(verdict.columns) and " 2.00 " in table(verdict.columns)
    plain = table(())
    assert "attn logit" not in plain and "largest LR" not in plain and "n/a" not in plain


def test_the_ledgers_spikes_are_plain_records_and_diagnose_names_the_columns_on_the_command_line(
    facts_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On disk a spike is the record it always was (no null fields); ``lit-spikes
    diagnose`` prints and writes the module's own column."""
    import json

    from lit_spikes.tools.cli import main

    ledger = json.loads((facts_run / "ledger.json").read_text())
    records = [i["spike"] for i in ledger["interventions"]]
    records += [b["spike"] for b in ledger["branches"] if b.get("spike")]
    assert records and all(None not in record.values() for record in records)
    assert all({"step", "metric", "value", "reference", "position"} <= set(r) for r in records)
    ckpt = next(facts_run.glob("*/checkpoints/step=20.ckpt"))
    argv = ["diagnose", "--ckpt_path", str(ckpt), "--spike_step", "31", "--model", FACTS]
    argv += ["--model.init_args.jump_step", "30", "--data", DATA["class_path"]]
    main([*argv, "--data.init_args.rows", "4096", "--json", str(tmp_path / "v.json")])
    assert "largest LR" in capsys.readouterr().out
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert [c["key"] for c in verdict["columns"]] == ["lr", "weight_norm"]
    assert verdict["same_data"]["extra"]["lr"] == 2.0
    assert verdict["same_data"]["extra"]["weight_norm"] > 0
