"""The recovery loop on modules and data that are not the project's
(``tests.modules.spiky_modules``): an LR jump (state-caused: a lower LR removes it) and
poisoned data positions through a ``StepLoader`` (data-caused: skipping them removes it).
It detects the spike, rolls back to a real checkpoint, accepts a remedy that ends better
than doing nothing, its ledger counts match the runs it made, and interrupted and
restarted it ends with the same weights."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_spikes.tools.recover import (
    HISTORY_NAME,
    BranchRecord,
    DetectorConfig,
    RecoverConfig,
    RecoverResult,
    SpikeContext,
    read_history,
    read_ledger,
    recover,
)
from tests.modules.recover_setup import Crash, scale_lr, weights
from tests.modules.spiky_modules import JumpRegressor, StepRegressionData, ValidatedRegressor

STEPS = 60
JUMP_STEP = 30
POISON = 30
MODEL = "tests.modules.spiky_modules.JumpRegressor"
DATA = "tests.modules.spiky_modules.StepRegressionData"
VALIDATED = "tests.modules.spiky_modules.ValidatedRegressor"
VALIDATED_DATA = "tests.modules.spiky_modules.ValidatedRegressionData"


def skip_data(before: int = 2, length: int = 4) -> dict[str, Any]:
    args = {"before": before, "length": length}
    return {"class_path": "lit_spikes.callbacks.BatchSkipper", "init_args": args}


class CappedLR(Callback):
    """A user's remedy (not the project's): no LR above ``cap`` from ``start_step`` on.
    Its ``for_spike`` starts it at the rollback's checkpoint."""

    def __init__(self, cap: float, start_step: int = 0) -> None:
        self.cap, self.start_step = cap, start_step

    @classmethod
    def for_spike(cls, spike: SpikeContext, cap: float) -> dict[str, Any]:
        return {"cap": cap, "start_step": spike.ckpt_step}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.start_step:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = min(group["lr"], self.cap)


@dataclass(frozen=True)
class JumpSettings:
    """A module's settings as a dataclass, as the project's own modules take theirs."""

    jump_step: int | None = None
    lr: float = 0.1


class ConfiguredRegressor(ValidatedRegressor):
    """``ValidatedRegressor`` configured by a dataclass argument."""

    def __init__(self, settings: JumpSettings = JumpSettings()) -> None:
        assert isinstance(settings, JumpSettings), settings  # not the dict a config holds
        super().__init__(lr=settings.lr, jump_step=settings.jump_step)


def config(root: Path, model: dict[str, Any], data: dict[str, Any], **changes: Any) -> Any:
    values: dict[str, Any] = {
        "log_root": root,
        "model": model,
        "data": data,
        "max_steps": STEPS,
        "checkpoint_every": 10,
        "val_every": None,
        # These losses are noisy before the spike: a ratio of 4, not the default 1.4
        "detector": DetectorConfig(ratio=4.0),
        "rollback_distance": 5,
        "accept_margin": 5,
        "compare": True,
    }
    return RecoverConfig(**{**values, **changes})


def jump_config(root: Path, **changes: Any) -> RecoverConfig:
    """A validated module (``val_loss``, every 10 steps) whose LR jumps at ``JUMP_STEP``."""
    model = {"class_path": VALIDATED, "init_args": {"jump_step": JUMP_STEP}}
    data = {"class_path": VALIDATED_DATA, "init_args": {"rows": 4096}}
    ladder = [skip_data(), scale_lr(0.05)]  # skipping data cannot remove an LR jump
    model = changes.pop("model", model)
    changes = {"ladder": ladder, "val_every": 10, **changes}
    result: RecoverConfig = config(root, model, data, **changes)
    return result


def poison_config(root: Path, **changes: Any) -> RecoverConfig:
    model = {"class_path": MODEL, "init_args": {}}
    data = {"class_path": DATA, "init_args": {"rows": 4096, "poison": [POISON]}}
    ladder = [scale_lr(0.5), skip_data()]  # a lower LR cannot remove a poisoned batch
    result: RecoverConfig = config(root, model, data, **{"ladder": ladder, **changes})
    return result


def assert_recovered(result: RecoverResult, rejected: str, accepted: str) -> None:
    """One spike at its planted step, a rollback to a real scheduled checkpoint, the
    first rung rejected, the second accepted and ending better than doing nothing, and
    ledger counts that match the branches' own records."""
    ledger = result.ledger
    root = Path(ledger.config["log_root"])
    assert ledger.status == "done" and len(ledger.interventions) == 1
    intervention = ledger.interventions[0]
    assert int(intervention.spike["step"]) in (JUMP_STEP, JUMP_STEP + 1)
    assert intervention.ckpt_step == 20  # the newest every-10 file >= 5 steps before
    assert intervention.ckpt_path is not None
    assert Path(intervention.ckpt_path) == (root / "base/checkpoints/step=20.ckpt").resolve()
    assert Path(intervention.ckpt_path).is_file()
    assert intervention.tried == [f"spike1/{rejected}", f"spike1/{accepted}"]
    assert intervention.outcomes[f"spike1/{rejected}"].startswith("rejected: spike at step")
    assert intervention.accepted == f"spike1/{accepted}"
    rows = {row["run"]: row for row in ledger.comparison}
    recovered = rows["recovered (accepted lineage)"]["measure"]
    nothing = rows["do nothing (continue through the spike)"]["measure"]
    assert recovered < nothing / 10, (recovered, nothing)
    assert len({row["measured_by"] for row in ledger.comparison}) == 1
    # The counts: each branch's steps are the step records of its own history
    for branch in ledger.branches:
        steps = [r for r in read_history(root / branch.name / HISTORY_NAME) if "step" in r]
        assert branch.steps_trained == len(steps), branch.name
        assert branch.end_step == steps[-1]["step"], branch.name
    totals = ledger.totals
    assert totals is not None
    assert totals.lineage == ["base", f"spike1/{accepted}"]
    assert totals.steps_final == STEPS == len([r for r in result.lineage if "step" in r])
    main = [b for b in ledger.branches if b.kind != "compare"]
    assert totals.steps_trained == sum(b.steps_trained for b in main)
    assert totals.steps_recomputed == totals.steps_trained - STEPS
    assert len(ledger.branches) == len(list(root.glob("*/*/" + HISTORY_NAME))) + 1  # base
    assert sum(e["event"] == "branch_start" for e in ledger.events) == len(ledger.branches)


def test_an_lr_jump_is_rolled_back_and_a_lower_lr_accepted(tmp_path: Path) -> None:
    result = recover(jump_config(tmp_path / "jump"))
    assert_recovered(result, rejected="skip_data", accepted="scale_lr")
    accepted = result.ledger.branch("spike1/scale_lr")
    assert accepted.remedies == [
        {
            "class_path": "lit_spikes.callbacks.LRScaler",
            "init_args": {"factor": 0.05, "start_step": 20},
        }
    ]
    model = result.ledger.config["model"]  # with the class's defaults, as the CLI fills them
    assert model["class_path"] == VALIDATED and model["init_args"]["jump_step"] == JUMP_STEP
    # Issue 55: the rows compare the module's validation metric at one step (it compared
    # the last 10 steps' train losses)
    (measured_by,) = {row["measured_by"] for row in result.ledger.comparison}
    assert measured_by == f"val_loss at step {STEPS} (the last validation of every run)"
    last = read_history(Path(result.ledger.config["log_root"]) / "spike1/scale_lr" / HISTORY_NAME)
    assert result.ledger.comparison[0]["measure"] == last[-1]["val"]["val_loss"]
    assert model["init_args"]["lr"] == 0.1
    assert not any(b.name == "compare/qk_norm" for b in result.ledger.branches)


def test_poisoned_positions_are_rolled_back_and_skipped(tmp_path: Path) -> None:
    result = recover(poison_config(tmp_path / "poison"))
    assert_recovered(result, rejected="scale_lr", accepted="skip_data")
    spike = result.ledger.interventions[0].spike
    assert spike["step"] == POISON and spike["position"] == POISON
    skipper = result.ledger.branch("spike1/skip_data").remedies[-1]
    assert skipper["init_args"] == {"ranges": [[POISON - 2, POISON + 2]]}
    assert result.ledger.totals is not None and result.ledger.totals.batches_skipped == 4
    # Issue 55: the rows compare the train loss over the same batches, after the skipped
    # ones: the recovered run trains position p at step p - 4 (it compared the last 10
    # steps' losses, of other batches in each run)
    rows = {row["run"]: row for row in result.ledger.comparison}
    (measured_by,) = {row["measured_by"] for row in rows.values()}
    window = range(POISON + 2, STEPS)  # after the skip window 28-31, to the do-nothing's end
    assert measured_by.startswith(f"train loss, mean over data positions {POISON + 2}-59 ")
    root = Path(result.ledger.config["log_root"])
    heads = {
        "recovered (accepted lineage)": "spike1/skip_data",
        "do nothing (continue through the spike)": "compare/do_nothing",
    }
    for run, head in heads.items():
        history = read_history(root / head / HISTORY_NAME)
        loss = {r["position"]: r["loss"] for r in history if "step" in r}
        assert rows[run]["measure"] == sum(loss[p] for p in window) / len(window), run


def test_a_users_remedy_callback_is_a_rung_built_for_the_spike(tmp_path: Path) -> None:
    rung = {
        "class_path": "tests.tools.recover.test_recover_any.CappedLR",
        "init_args": {"cap": 0.1},
    }
    result = recover(jump_config(tmp_path / "user", ladder=[rung]))
    intervention = result.ledger.interventions[0]
    assert intervention.accepted == "spike1/CappedLR"
    branch = result.ledger.branch("spike1/CappedLR")
    assert branch.remedies == [
        {"class_path": rung["class_path"], "init_args": {"cap": 0.1, "start_step": 20}}
    ]


@pytest.mark.parametrize("make", [jump_config, poison_config], ids=["jump", "poison"])
def test_interrupted_and_restarted_it_ends_with_the_same_weights(tmp_path: Path, make: Any) -> None:
    reference = recover(make(tmp_path / "full"))
    accepted = reference.ledger.interventions[0].accepted
    config = make(tmp_path / "crash")

    def crash(record: BranchRecord) -> list[Callback]:
        return [Crash(45)] if record.name == accepted else []

    with pytest.raises(RuntimeError, match="injected crash at step 45"):
        recover(config, extra_callbacks=crash)
    assert read_ledger(config.log_root).branch(accepted).status == "running"
    result = recover(config)  # the same arguments: it continues from the ledger
    assert result.ledger.sessions == 2 and result.ledger.branch(accepted).restarts == 1
    got, want = weights(result.final_ckpt), weights(reference.final_ckpt)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert [(r["step"], r["loss"]) for r in result.lineage if "step" in r] == [
        (r["step"], r["loss"]) for r in reference.lineage if "step" in r
    ]


def test_factories_train_as_their_class_paths_and_a_restart_needs_them(tmp_path: Path) -> None:
    def model() -> JumpRegressor:
        return JumpRegressor(jump_step=JUMP_STEP)

    def data() -> StepRegressionData:
        return StepRegressionData(rows=4096)

    base = jump_config(tmp_path / "factory", compare=False)
    result = recover(base, model=model, data=data)
    assert result.ledger.config["model"] == {"factory": f"{__name__}.{model.__qualname__}"}
    by_path = recover(jump_config(tmp_path / "paths", compare=False))
    got, want = weights(result.final_ckpt), weights(by_path.final_ckpt)
    assert all(torch.equal(got[k], want[k]) for k in want)
    named = RecoverConfig.from_dict({**result.ledger.config, "log_root": str(base.log_root)})
    with pytest.raises(ValueError, match=r"RecoverConfig.model names the factory .*give it"):
        recover(named)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_steps": None}, r"max_steps is required for model tests.modules.spiky_modules"),
        ({"ladder": ["scale_lr"]}, r"'scale_lr' is now named by its class: 'lit_spikes"),
        ({"ladder": [scale_lr(1.5)]}, r"factor must be in \(0, 1\)"),
        (
            {"ladder": [{"class_path": "lit_spikes.callbacks.LRScaler", "init_args": {"f": 1}}]},
            r"LRScaler takes the options \['factor'\], not \['f'\]",
        ),
        ({"ladder": [scale_lr(0.5), scale_lr(0.1)]}, r"each class once"),
        ({"ladder": ["torch.nn.Linear"]}, r"ladder='torch.nn.Linear' is not a Callback"),
        (
            {"compare": "qk_norm"},
            r"compare=\['qk_norm'\]: give true, false or some of \['do_nothing'\], each once "
            r"\(the rows tests\.modules\.spiky_modules\.\w+ offers: 'do_nothing' and its "
            r"ToolFacts\.variants\)",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        jump_config(tmp_path, **changes)


def test_a_model_or_data_that_is_not_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"model='tests.modules.spiky_modules.Nothing'.*no class"):
        RecoverConfig(model={"class_path": "tests.modules.spiky_modules.Nothing"}, max_steps=10)
    with pytest.raises(
        ValueError, match=r"data='tests.modules.spiky_modules.JumpRegressor' is not a"
    ):
        RecoverConfig(data={"class_path": MODEL})


def test_the_command_line_takes_the_module_and_the_ladder_by_class_path(tmp_path: Path) -> None:
    from lit_spikes.tools.cli import main

    rungs = '[{"class_path": "lit_spikes.callbacks.LRScaler", "init_args": {"factor": 0.05}}]'
    argv = ["recover", "--model", MODEL, "--model.init_args.jump_step", str(JUMP_STEP)]
    argv += ["--data", DATA, "--data.init_args.rows", "4096", "--max_steps", str(STEPS)]
    argv += ["--checkpoint_every", "10", "--val_every", "null", "--detector.ratio", "4"]
    argv += ["--rollback_distance", "5", "--accept_margin", "5", "--ladder", rungs]
    result = main([*argv, "--log_root", str(tmp_path / "cli")])
    assert result is not None and result.ledger.status == "done"
    assert result.ledger.interventions[0].accepted == "spike1/scale_lr"
    reference = recover(jump_config(tmp_path / "api", ladder=[scale_lr(0.05)], compare=False))
    got, want = weights(result.final_ckpt), weights(reference.final_ckpt)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_module_configured_by_a_dataclass_gets_one(tmp_path: Path) -> None:
    model = {
        "class_path": "tests.tools.recover.test_recover_any.ConfiguredRegressor",
        "init_args": {"settings": {"jump_step": JUMP_STEP}},
    }
    result = recover(jump_config(tmp_path / "dataclass", model=model, compare=False))
    assert result.ledger.interventions[0].accepted == "spike1/scale_lr"
    assert result.ledger.config["model"]["init_args"]["settings"]["jump_step"] == JUMP_STEP


def test_the_command_lines_trainer_settings_train_every_branch(tmp_path: Path) -> None:
    """Issue 55: recover took no --trainer.*, so a run's gradient_clip_val=1.0 was dropped
    and every branch trained another run than the one that spiked. Each branch's files
    record the clipping they trained with, and the ledger the setting."""
    from lit_spikes.tools.recover.cli import parse

    argv = ["--model", MODEL, "--max_steps", "60", "--val_every", "null"]
    parsed, _ = parse([*argv, "--trainer.gradient_clip_val", "1.0"])
    assert parsed.trainer == {"gradient_clip_val": 1.0}
    result = recover(poison_config(tmp_path, trainer=parsed.trainer))
    (intervention,) = result.ledger.interventions  # the poisoned batch spikes, clipped too
    assert intervention.tried == ["spike1/scale_lr", "spike1/skip_data"]
    assert intervention.accepted == "spike1/skip_data"
    assert result.ledger.config["trainer"] == {"gradient_clip_val": 1.0}
    files = [*tmp_path.glob("*/checkpoints/*.ckpt"), *tmp_path.glob("*/*/checkpoints/*.ckpt")]
    trained = {f.parent.parent.relative_to(tmp_path).as_posix() for f in files}
    assert trained >= {"base", "spike1/scale_lr", "spike1/skip_data"}, trained
    for file in files:
        clip = torch.load(file, weights_only=True)["callbacks"]["ExactResume{}"]["fingerprint"]
        assert clip["gradient_clip"] == {"value": 1.0, "algorithm": "norm"}, file


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "max_steps",
            "--trainer.max_steps: recover sets it for every branch; use its option --max_steps",
        ),
        ("gradient_clip", "--trainer.gradient_clip: the Trainer takes no argument 'gradient_clip'"),
    ],
)
def test_trainer_settings_the_loop_sets_or_the_trainer_lacks_are_refused(
    tmp_path: Path, name: str, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        jump_config(tmp_path, trainer={name: 1})
