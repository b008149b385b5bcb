"""``recover`` and ``diagnose`` on a user's module that brings no ``ExactResume`` and
draws dropout masks from the global RNG: they add ExactResume and a seed themselves, so
a recover killed mid-branch and run again ends as the uninterrupted one, and a diagnosis
replays alike every time. And diagnose replays only within the run (a OneCycleLR's end),
judges with the run's own detector, reads the tag it monitored, and does not call a bump
much smaller than the spike the spike recurring (issue 31, items 7 and 8)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lit_spikes.callbacks import ExactResume, SpikeDetector
from lit_spikes.shared.training import checkpoint_path, quiet_branches, step_checkpoint
from lit_spikes.tools.cli import main as cli_main
from lit_spikes.tools.detector_config import DetectorConfig
from lit_spikes.tools.diagnose import DiagnoseConfig, Replay, diagnose, judged, verdict_cause
from lit_spikes.tools.judgement import Rise
from lit_spikes.tools.recover import (
    BranchRecord,
    RecoverConfig,
    RecoverResult,
    read_ledger,
    recover,
)
from tests.modules.recover_setup import Crash, scale_lr, weights
from tests.modules.spiky_modules import FEATURES, JumpRegressor, StepRegressionData

MODEL = f"{__name__}.DropoutJump"
DATA = "tests.modules.spiky_modules.StepRegressionData"
JUMP = 30


class DropoutJump(JumpRegressor):
    """``JumpRegressor`` with dropout, its weights drawn from the global RNG (as most
    modules draw them), and no ExactResume of its own."""

    def __init__(self, jump_step: int | None = None, dropout: float = 0.2) -> None:
        super().__init__(jump_step=jump_step)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 1)
        )


class OneCycleRegressor(JumpRegressor):
    """``JumpRegressor`` under ``OneCycleLR(total_steps=total_steps)`` (it raises a step
    past them), logging its loss as ``train_loss``."""

    def __init__(self, total_steps: int) -> None:
        super().__init__()
        self.total_steps = total_steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


def plain_run(
    root: Path,
    name: str,
    model: pl.LightningModule,
    data: Any,
    steps: int,
    callbacks: Sequence[Any],
) -> Path:
    """A plain Lightning run with ``step=<k>.ckpt`` every 10 steps and TensorBoard events
    (diagnose reads the original loss there), and only ``callbacks`` besides."""
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=TensorBoardLogger(root, name=name, version=""),
        callbacks=[step_checkpoint(root / name / "checkpoints", 10), *callbacks],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(), quiet_branches():  # levels put back after
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    return root / name


# ------------------------------------------------------------------ recover (item 7)


def config(root: Path) -> RecoverConfig:
    return RecoverConfig(
        log_root=root,
        model={"class_path": MODEL, "init_args": {"jump_step": JUMP}},
        data={"class_path": DATA, "init_args": {"rows": 4096}},
        max_steps=50,
        checkpoint_every=10,
        val_every=None,
        detector=DetectorConfig(ratio=4.0),
        rollback_distance=5,
        accept_margin=5,
        ladder=(scale_lr(0.05),),
    )


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> tuple[RecoverResult, RecoverResult]:
    """The uninterrupted recover, and the one killed in its remedy branch and run again."""
    root = tmp_path_factory.mktemp("recover")
    reference = recover(config(root / "full"))

    def crash(record: BranchRecord) -> list[Callback]:
        return [Crash(35)] if record.name == "spike1/scale_lr" else []

    with pytest.raises(RuntimeError, match="injected crash at step 35"):
        recover(config(root / "crash"), extra_callbacks=crash)
    return reference, recover(config(root / "crash"))


@pytest.mark.slow
def test_recover_killed_mid_branch_ends_as_the_uninterrupted_run(
    recovered: tuple[RecoverResult, RecoverResult],
) -> None:
    reference, resumed = recovered
    assert resumed.ledger.branch("spike1/scale_lr").restarts == 1
    assert resumed.ledger.interventions[0].accepted == "spike1/scale_lr"
    names = [b.name for b in reference.ledger.branches]
    assert [b.name for b in resumed.ledger.branches] == names == ["base", "spike1/scale_lr"]
    got, want = weights(resumed.final_ckpt), weights(reference.final_ckpt)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert [(r["step"], r["loss"]) for r in resumed.lineage if "step" in r] == [
        (r["step"], r["loss"]) for r in reference.lineage if "step" in r
    ]


@pytest.mark.slow
def test_diagnose_replays_a_recover_branch_exactly_within_its_ledgers_steps(
    recovered: tuple[RecoverResult, RecoverResult],
) -> None:
    """The branch's checkpoint holds ExactResume's states (recover added it): the replay
    is the run's, to the bit, judged by the loop's detector (ratio 4), and ends at the
    ledger's 50 steps."""
    root = Path(recovered[0].ledger.config["log_root"])
    spike = int(read_ledger(root).interventions[0].spike["step"])
    ckpt, config = checkpoint_path(root / "base", 20), DiagnoseConfig(horizon=25)
    model = {"class_path": MODEL, "init_args": {"jump_step": JUMP}}
    data = {"class_path": DATA, "init_args": {"rows": 4096}}
    verdict = diagnose(ckpt, spike, config, model=model, data=data)
    assert verdict.same_data.bit_equal is True, verdict.evidence
    assert verdict.same_data.detector_from_checkpoint and "ratio=4.0" in verdict.evidence[1]
    assert verdict.same_data.last_step == 49 and verdict.cause == "state-caused"


def test_exact_resume_is_added_unless_opted_out(tmp_path: Path) -> None:
    from lit_spikes.tools.recover.branch import Builders, branch_run

    record = BranchRecord(name="base", kind="base", start_step=0, ckpt_path=None, parent=None)
    for exact, added in ((True, 1), (False, 0)):
        chosen = replace(config(tmp_path), exact_resume=exact)
        _, _, spec = branch_run(Builders.of(chosen), record, [SpikeDetector()], None, False)
        assert sum(isinstance(c, ExactResume) for c in spec.callbacks) == added


# ------------------------------------------------------------------ diagnose (item 7)


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the dropout module without ExactResume: its files hold no RNG states."""
    root = tmp_path_factory.mktemp("dropout")
    model, data = DropoutJump(jump_step=25), StepRegressionData()
    return plain_run(root, "run", model, data, 36, [SpikeDetector(ratio=3.0)])


def test_diagnose_twice_replays_and_judges_alike(dropout_run: Path) -> None:
    ckpt = checkpoint_path(dropout_run, 10)
    config = DiagnoseConfig(window_after=10, horizon=4)
    model = {"class_path": MODEL, "init_args": {"jump_step": 25}}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # what a process may have: the replays train on one, as fit's
    try:
        with pytest.warns(UserWarning, match="without ExactResume's state"):
            first, second = (diagnose(ckpt, 26, config, model=model, data=DATA) for _ in range(2))
        assert torch.get_num_threads() == config.num_threads == 1
    finally:
        torch.set_num_threads(threads)
    for replays in zip(
        (first.same_data, *first.other_data), (second.same_data, *second.other_data), strict=True
    ):
        assert replays[0] is not None and replays[1] is not None
        a, b = ({k: v for k, v in asdict(r).items() if k != "wall_s"} for r in replays)
        assert a == b
    assert first.cause == second.cause == "state-caused", first.evidence
    # The run saved no RNG states: another loss than the original's is no evidence
    assert first.same_data.bit_equal is None and "no RNG states" in " ".join(first.evidence)


# ------------------------------------------------------------------ diagnose (item 8)


@pytest.fixture(scope="module")
def cycle_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 steps under OneCycleLR(total_steps=40), a poisoned batch at step 35, the run's
    detector on ``train_loss`` at ratio 3."""
    root = tmp_path_factory.mktemp("cycle")
    model, data = OneCycleRegressor(40), StepRegressionData(poison=[35])
    detector = SpikeDetector(monitor="train_loss", ratio=3.0)
    run = plain_run(root, "run", model, data, 40, [ExactResume(), detector])
    assert 35 in [s["step"] for s in detector.spikes]
    torch.save([s.to_dict() for s in detector.spikes], run / "spikes.pt")  # plain records
    return run


CYCLE = {"class_path": f"{__name__}.OneCycleRegressor", "init_args": {"total_steps": 40}}
POISON = {"class_path": DATA, "init_args": {"poison": [35]}}


def test_replays_end_at_the_runs_end(cycle_run: Path) -> None:
    verdict = diagnose(checkpoint_path(cycle_run, 30), 35, model=CYCLE, data=POISON)
    assert verdict.same_data.last_step == 39, verdict.evidence  # not 35 + 20: OneCycleLR's end
    assert "Replays end at step 40, the run's end (its LR scheduler's total_steps=40)" in (
        " ".join(verdict.evidence)
    )


def test_the_original_loss_is_read_under_the_tag_the_runs_detector_monitored(
    cycle_run: Path,
) -> None:
    config = DiagnoseConfig(horizon=4)  # within the run's 40 steps
    verdict = diagnose(checkpoint_path(cycle_run, 30), 35, config, model=CYCLE, data=POISON)
    assert verdict.original_loss is not None, verdict.evidence  # train_loss, not "loss"
    assert verdict.same_data.bit_equal is True, verdict.evidence


def test_replays_are_judged_by_the_runs_detector(cycle_run: Path) -> None:
    config = DiagnoseConfig(horizon=4, loss_tag="train_loss")
    verdict = diagnose(checkpoint_path(cycle_run, 30), 35, config, model=CYCLE, data=POISON)
    same = verdict.same_data
    # The run's detector (train_loss, ratio 3), continued: it flags what the run flagged
    assert same.detector_from_checkpoint, verdict.evidence
    run_flags = [int(s["step"]) for s in torch.load(cycle_run / "spikes.pt") if s["step"] >= 30]
    assert same.flagged == run_flags and verdict.cause == "data-caused", verdict.evidence
    assert "the run's SpikeDetector(monitor=['train_loss']" in verdict.evidence[1]


def test_a_spike_step_past_the_runs_end_is_a_usage_error(
    cycle_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = checkpoint_path(cycle_run, 30)
    with pytest.raises(ValueError, match=r"spike_step=40 is past the run's end: .*up to 39 "):
        diagnose(ckpt, 40, model=CYCLE, data=POISON)
    argv = ["diagnose", "--ckpt_path", str(ckpt), "--spike_step", "41", "--data", DATA]
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*argv, "--model", CYCLE["class_path"], "--model.init_args.total_steps", "40"])
    assert exit_info.value.code == 2
    assert "total_steps=40" in capsys.readouterr().err


def test_a_bump_far_smaller_than_the_spike_is_not_its_recurrence(cycle_run: Path) -> None:
    """A detector so keen it flags the other-data replay's noise: those bumps are not the
    spike coming back, the verdict stays data-caused."""
    keen = DiagnoseConfig(horizon=4, detector=DetectorConfig(monitor=("train_loss",), ratio=1.01))
    verdict = diagnose(checkpoint_path(cycle_run, 30), 35, keen, model=CYCLE, data=POISON)
    assert any(other.spiked for other in verdict.other_data), verdict.evidence
    assert verdict.cause == "data-caused", verdict.evidence
    assert " ".join(verdict.evidence).count("the spike is gone (bar 0.5)") == 3


def test_the_no_spike_advice_names_options_that_exist() -> None:
    from lit_spikes.tools.diagnose import build_parser, explain

    same = Replay("r", 20, None, 3.0, 3.0, {}, [], True, 40)  # a fresh detector's
    named = set(re.findall(r"--[a-z_.-]+", explain.no_spike_line(28, same, 3.0)))
    usage = " ".join(build_parser().format_help().split())
    assert named and [name for name in named if f"{name} " not in usage] == []


def replay(flagged: list[int], height: float, at_spike: bool = False) -> Replay:
    """A replay of plain numbers whose loss rose ``height`` over a median of 2 (a rise of
    ln((2 + height) / 2): 10 is ln 6)."""
    rises = {"loss": Rise(30, 2.0 + height, 2.0)}
    spike = {"loss": height} if at_spike else {}
    return Replay(
        "r", 20, None, 3.0, 3.0, {}, flagged, True, 40, spike_excess=spike, rises=rises,
        spike_rises=rises if at_spike else {},
    )  # fmt: skip


def judged_against(same: Replay, *heights: float, bar: float = 0.5) -> list[Replay]:
    others = [replay([30] if h else [], h) for h in heights]
    for other in others:
        other.judgement = judged(same, other, bar)
    return others


def test_recurrence_needs_half_the_spikes_rise_flagged_or_not() -> None:
    same = replay([28], 10.0, at_spike=True)
    assert verdict_cause(28, same, judged_against(same, 1.0)) == "data-caused"  # 0.23
    assert verdict_cause(28, same, judged_against(same, 5.0)) == "state-caused"  # 0.70
    low = judged_against(same, 1.0, bar=0.1)
    assert verdict_cause(28, same, low, recurrence=0.1) == "state-caused"
    assert verdict_cause(28, same, judged_against(same, 0.0)) == "data-caused"
    # The rise decides, not a flag: 0.77 of the spike under the detector's threshold
    quiet = replay([], 7.7)
    quiet.judgement = judged(same, quiet)
    assert verdict_cause(28, same, [quiet]) == "state-caused"
    # Three windows: the median of their ratios; two of three decide
    assert verdict_cause(28, same, judged_against(same, 9.0, 6.0, 0.0)) == "state-caused"
    assert verdict_cause(28, same, judged_against(same, 9.0, 1.0, 0.0)) == "data-caused"
    with pytest.raises(ValueError, match=r"recurrence=0 must be in \(0, 1\]"):
        DiagnoseConfig(recurrence=0)


def windows_of(same: Replay, *heights: float) -> list[Replay]:
    others = judged_against(same, *heights)
    for index, other in enumerate(others):
        other.skipped = (23, 54 + 31 * index)
    return others


def test_split_windows_are_said_with_what_would_settle_them() -> None:
    from lit_spikes.tools.diagnose import build_parser, explain

    same = replay([28], 10.0, at_spike=True)
    config = DiagnoseConfig()
    lines = explain.other_data_lines(28, same, windows_of(same, 9.0, 1.0, 0.0), 28, config)
    assert [line[:5] for line in lines[:3]] == ["(b1) ", "(b2) ", "(b3) "]
    assert "positions 23-53 skipped" in lines[0] and "positions 23-84 skipped" in lines[1]
    assert "it rises 0.95 of the spike's height" in lines[0]
    assert "the spike is still there (bar 0.5)" in lines[0]
    assert "the spike is gone (bar 0.5)" in lines[1] and "the spike is gone" in lines[2]
    assert lines[3].startswith("The other-data replays disagree: 1 of 3 bring the spike back")
    assert "the median of their ratios, 0.23, decides" in lines[3]
    usage = " ".join(build_parser().format_help().split())
    named = re.findall(r"--[a-z_.-]+", lines[3])
    assert named == ["--windows", "--earlier_ckpt_path"]
    assert [name for name in named if f"{name} " not in usage] == []  # options that exist
    agree = explain.other_data_lines(28, same, windows_of(same, 0.0, 0.0, 1.0), 28, config)
    assert agree[3] == "All 3 other-data replays leave the spike out (median ratio 0.00)."


@pytest.mark.parametrize("tool", [RecoverConfig, DiagnoseConfig])
def test_a_bad_thread_count_is_refused_naming_the_field(tool: Any) -> None:
    with pytest.raises(ValueError, match=rf"{tool.__name__}\.num_threads=0: give a whole number"):
        tool(num_threads=0)
