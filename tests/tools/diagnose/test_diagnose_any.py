"""``diagnose`` on modules and data that are not the project's (tests/modules/spiky_modules.py),
trained by a plain Lightning Trainer: an LR jump is state-caused, poisoned data positions
are data-caused, a one-off fault is not reproducible; the module and data come as
factories, as class paths, or from the ``config.yaml`` of a ``lit-spikes fit`` run."""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lit_spikes.callbacks import ExactResume, SpikeDetector
from lit_spikes.shared.training import checkpoint_path, quiet_branches, step_checkpoint
from lit_spikes.tools.cli import main as cli_main
from lit_spikes.tools.detector_config import DetectorConfig
from lit_spikes.tools.diagnose import DiagnoseConfig, callbacks_from_checkpoint, diagnose
from tests.modules.spiky_modules import (
    CosineRegressor,
    FaultyRegressor,
    JumpRegressor,
    PlateauRegressor,
    StepJumpCosineRegressor,
    StepRegressionData,
    TrainLossRegressor,
    ValidatedRegressionData,
)

STEPS, EVERY, K = 36, 10, 10
"""The original runs' length, their checkpoint interval, the checkpoint diagnosed."""
SPIKE = 25
"""The planted step: the LR jumps there (its loss spikes one step later), its data
position is poisoned, the fault hits."""
CONFIG = DiagnoseConfig(
    window_before=5, window_after=10, horizon=4, detector=DetectorConfig(ratio=3.0)
)
"""Short replays; a ratio above the noise of the regressions' early losses (1.4 flags it)."""
JUMP = "tests.modules.spiky_modules.JumpRegressor"
DATA = "tests.modules.spiky_modules.StepRegressionData"


def original_run(
    root: Path,
    name: str,
    model: pl.LightningModule,
    data: Any,
    callbacks: Sequence[Any] = (),
    exact_resume: bool = True,
    **trainer_kwargs: Any,
) -> Path:
    """A plain Lightning run: ``ExactResume`` (unless not ``exact_resume``),
    ``step=<k>.ckpt`` every ``EVERY`` steps and TensorBoard events (where diagnose reads
    the loss the run logged), and ``callbacks``. Returns its directory."""
    run_dir = root / name
    callbacks = [ExactResume(), *callbacks] if exact_resume else list(callbacks)
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(root, name=name, version=""),
        callbacks=[*callbacks, step_checkpoint(run_dir / "checkpoints", EVERY)],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **{"limit_val_batches": 0, **trainer_kwargs},
    )
    with warnings.catch_warnings(), quiet_branches():  # levels put back after
        warnings.simplefilter("ignore")  # Lightning's notes on workers and the like
        trainer.fit(model, datamodule=data)
    return run_dir


def test_an_lr_jump_of_any_module_is_state_caused(tmp_path: Path) -> None:
    run = original_run(tmp_path, "jump", JumpRegressor(jump_step=SPIKE), StepRegressionData())
    model = {"class_path": JUMP, "init_args": {"jump_step": SPIKE}}
    verdict = diagnose(checkpoint_path(run, K), SPIKE + 1, CONFIG, model=model, data=DATA)
    assert verdict.cause == "state-caused", verdict.evidence
    same, (other, *_) = verdict.same_data, verdict.other_data
    assert same.bit_equal and same.loss_at_spike == verdict.original_loss, verdict.evidence
    assert SPIKE + 1 in same.flagged and same.extra == {}  # no columns stated
    assert other.skipped == (SPIKE + 1 - 5, SPIKE + 1 + 11)
    assert other.spiked, verdict.evidence  # other data, the same jump: a spike still
    # Replayed without the jump (another module's settings) it does not come back at all.
    calm = diagnose(checkpoint_path(run, K), SPIKE + 1, CONFIG, model=JUMP, data=DATA)
    assert calm.cause == "not-reproducible", calm.evidence


def test_poisoned_data_positions_are_data_caused(tmp_path: Path) -> None:
    data = functools.partial(StepRegressionData, poison=[SPIKE])
    run = original_run(tmp_path, "poison", JumpRegressor(), data())
    verdict = diagnose(checkpoint_path(run, K), SPIKE, CONFIG, model=JumpRegressor, data=data)
    assert verdict.cause == "data-caused", verdict.evidence
    same, (other, *_) = verdict.same_data, verdict.other_data
    assert same.bit_equal and SPIKE in same.flagged, verdict.evidence
    assert other.skipped == (SPIKE - 5, SPIKE + 11)
    assert not other.spiked and other.max_loss < 0.01 * same.max_loss, verdict.evidence
    # (c) from an earlier file of the same run: its history repeats to the bit
    earlier = diagnose(
        checkpoint_path(run, 20),
        SPIKE,
        CONFIG,
        model=JumpRegressor,
        data=data,
        earlier_ckpt=checkpoint_path(run, K),
    )
    assert earlier.cause == "data-caused" and earlier.earlier is not None
    assert earlier.earlier.bit_equal, earlier.evidence


def test_poisoned_data_augmented_at_each_read_is_data_caused(tmp_path: Path) -> None:
    """Issue 53: with noise drawn in ``__getitem__`` the replay read other rows than the
    run had, and diagnose called the poisoned batch a hardware fault. The rows are read
    with keyed RNGs now: the replay is the run, to the bit."""
    data = functools.partial(StepRegressionData, poison=[SPIKE], augment=0.05)
    run = original_run(tmp_path, "augmented", JumpRegressor(), data())
    verdict = diagnose(checkpoint_path(run, K), SPIKE, CONFIG, model=JumpRegressor, data=data)
    assert verdict.cause == "data-caused", verdict.evidence
    assert verdict.same_data.bit_equal and SPIKE in verdict.same_data.flagged, verdict.evidence


def test_a_one_off_fault_is_not_reproducible(tmp_path: Path) -> None:
    marker = tmp_path / "fault.marker"
    model = functools.partial(FaultyRegressor, fault_step=SPIKE, fault_marker=str(marker))
    run = original_run(tmp_path, "fault", model(), StepRegressionData())
    assert marker.is_file()  # the fault hit the original run, once
    verdict = diagnose(checkpoint_path(run, K), SPIKE, CONFIG, model=model, data=DATA)
    assert verdict.cause == "not-reproducible", verdict.evidence
    same = verdict.same_data
    assert verdict.original_loss is not None and same.bit_equal is False, verdict.evidence
    assert same.loss_at_spike < 0.1 * verdict.original_loss and not same.spiked
    assert verdict.other_data == []


def test_a_later_state_its_own_history_does_not_give_is_not_reproducible(tmp_path: Path) -> None:
    """(c): a fault scaled the run's weights once at step 15, between its files of steps 10
    and 20, and its batch at step 25 is poisoned. From the step-20 file the spike comes
    back to the bit and skipping the data removes it, which alone reads data-caused; but
    the step-10 file's replay, which meets no fault, reaches another loss at the spike:
    the later state is not what the run's own history gives, so not-reproducible."""
    marker = tmp_path / "fault.marker"
    model = functools.partial(
        FaultyRegressor, fault_step=15, fault_marker=str(marker), fault_scale=2.0
    )
    data = functools.partial(StepRegressionData, poison=[SPIKE])
    run = original_run(tmp_path, "fault", model(), data())
    assert marker.is_file()  # the fault hit the run, once: no replay meets it
    verdict = diagnose(checkpoint_path(run, 20), SPIKE, CONFIG, model=model, data=data,
                       earlier_ckpt=checkpoint_path(run, K))  # fmt: skip
    assert verdict.same_data.bit_equal and verdict.other_data, verdict.evidence
    assert max(o.ratio for o in verdict.other_data) < 0.5, verdict.evidence  # (b): data
    assert verdict.earlier is not None and verdict.earlier.bit_equal is False, verdict.evidence
    assert verdict.cause == "not-reproducible", verdict.evidence


def test_a_file_without_rng_states_of_a_module_that_draws_nothing_is_evidence(
    tmp_path: Path,
) -> None:
    """A run without ExactResume (its files hold no seeds) of a module that draws nothing,
    hit by a one-off fault: the replay's own per-step seeds are no draw of the module, so
    its other loss is evidence, and nothing says "no RNG states"."""
    marker = tmp_path / "fault.marker"
    model = functools.partial(FaultyRegressor, fault_step=SPIKE, fault_marker=str(marker))
    run = original_run(tmp_path, "plain", model(), StepRegressionData(), exact_resume=False)
    with pytest.warns(UserWarning, match="from a checkpoint without ExactResume's state"):
        verdict = diagnose(checkpoint_path(run, K), SPIKE, CONFIG, model=model, data=DATA)
    assert verdict.cause == "not-reproducible", verdict.evidence
    assert verdict.same_data.bit_equal is False
    assert "no RNG states" not in " ".join(verdict.evidence), verdict.evidence


class ScaleGrads(Callback):
    """A callback of the user's, stateless (so no checkpoint records it): the gradients
    times ``factor`` from ``start_step`` on."""

    def __init__(self, factor: float, start_step: int) -> None:
        self.factor, self.start_step = factor, start_step

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step >= self.start_step:
            for parameter in pl_module.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(self.factor)


def test_a_lit_spikes_fit_run_is_diagnosed_from_its_config_yaml(tmp_path: Path) -> None:
    """Its config.yaml names the module, the data and the callbacks: no model or data
    given, and a callback only config.yaml records replays too (the CLI's resume's way)."""
    data = StepRegressionData(poison=[SPIKE])
    scale = {"class_path": f"{__name__}.ScaleGrads", "init_args": {"factor": 0.5, "start_step": 15}}
    run = original_run(tmp_path, "fit", JumpRegressor(), data, [ScaleGrads(0.5, 15)])
    saved = {
        "model": {"class_path": JUMP, "init_args": {"lr": 0.1}},
        "data": {"class_path": DATA, "init_args": {"poison": [SPIKE]}},
        "trainer": {"callbacks": [scale]},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    ckpt = checkpoint_path(run, K)
    rebuilt = callbacks_from_checkpoint(torch.load(ckpt, weights_only=False), ckpt)
    assert [type(cb) for cb in rebuilt] == [ScaleGrads, ExactResume]
    verdict = diagnose(ckpt, SPIKE, CONFIG)
    assert verdict.cause == "data-caused" and verdict.same_data.bit_equal, verdict.evidence
    # A config.yaml without the callback: the replay trains otherwise, the loss differs
    del saved["trainer"]
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    verdict = diagnose(ckpt, SPIKE, CONFIG)
    assert verdict.cause == "not-reproducible", verdict.evidence


def test_a_schedule_over_the_runs_max_steps_is_replayed_with_them(tmp_path: Path) -> None:
    """Issue 55: a cosine over ``trainer.max_steps``, clipping and a poisoned batch. The
    replays ran with max_steps at the spike plus the horizon: another schedule from the
    second replayed step, and a verdict of 'not-reproducible ... hardware fault'."""
    data = StepRegressionData(poison=[SPIKE])
    run = original_run(tmp_path, "cosine", CosineRegressor(), data, gradient_clip_val=1.0)
    saved = {
        "model": {"class_path": "tests.modules.spiky_modules.CosineRegressor"},
        "data": {"class_path": DATA, "init_args": {"poison": [SPIKE]}},
        "trainer": {"max_steps": STEPS, "gradient_clip_val": 1.0},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    verdict = diagnose(checkpoint_path(run, K), SPIKE, CONFIG)
    assert verdict.cause == "data-caused", verdict.evidence
    assert verdict.same_data.bit_equal and verdict.same_data.last_step == SPIKE + CONFIG.horizon


def test_a_replay_that_is_not_the_run_says_so_instead_of_blaming_the_hardware(
    tmp_path: Path,
) -> None:
    """Issue 55: the cosine module's run without a config.yaml: its max_steps is not known,
    the replays train another schedule, and their loss differs from the run's logged one
    from the second replayed step on. It said "hardware fault, bit flip"."""
    data = functools.partial(StepRegressionData, poison=[SPIKE])
    run = original_run(tmp_path, "bare", CosineRegressor(), data())
    verdict = diagnose(checkpoint_path(run, K), SPIKE, CONFIG, model=CosineRegressor, data=data)
    assert verdict.cause == "not-reproducible", verdict.evidence
    text = " ".join(verdict.evidence)
    found = re.search(r"The replay is not the run: its loss at step (\d+), before the spike", text)
    assert found is not None and K < int(found.group(1)) < SPIKE, text  # (not its first step:
    # the LR of the file's step is in the file, the next one is the replay's schedule's)
    assert "max_steps at the horizon's end (the run's is not known" in text
    unlike = text.partition("It differs from the run in ")[2].partition(". Give")[0]
    assert "max_steps: the run's is not known" in unlike, text  # (threads may differ too)
    assert "hardware fault" not in text


def test_a_replay_that_is_not_the_run_names_each_setting_that_differs(tmp_path: Path) -> None:
    """Issue 55: a one-off fault (not reproducible) replayed with another LR and with
    clipping the run did not have: the evidence names each setting with both values (it
    said only that "a setting differs", and listed what it replayed with)."""
    marker = tmp_path / "fault.marker"
    model = functools.partial(FaultyRegressor, fault_step=SPIKE, fault_marker=str(marker))
    run = original_run(tmp_path, "fault", model(), StepRegressionData())
    other = functools.partial(model, lr=0.05)
    clip = {"gradient_clip_val": 0.5}
    verdict = diagnose(checkpoint_path(run, K), SPIKE, CONFIG, model=other, data=DATA,
                       trainer_kwargs=clip)  # fmt: skip
    text = " ".join(verdict.evidence)
    assert "The replay is not the run" in text and "hardware fault" not in text, text
    unlike = text.partition("It differs from the run in ")[2].partition(". Give")[0]
    assert "--model.lr: the run's 0.1, the replay's 0.05" in unlike, text
    clipped = "the replay's {'value': 0.5, 'algorithm': 'norm'}"
    assert f"gradient clipping (--trainer.gradient_clip_val): the run's None, {clipped}" in unlike
    assert "--model.hidden" not in text  # the same


def test_an_lr_jump_planted_in_optimizer_step_under_the_cosine_is_state_caused(
    tmp_path: Path,
) -> None:
    """Issue 55: the cosine module (its schedule reads trainer.max_steps) with clipping and
    an LR jump planted in its optimizer_step from step 25: the replays train the run's
    schedule, so the jump comes back with the same state and data."""
    model = {"class_path": "tests.modules.spiky_modules.StepJumpCosineRegressor",
             "init_args": {"jump_step": SPIKE, "jump": 1000.0}}  # fmt: skip
    run = original_run(tmp_path, "jump", StepJumpCosineRegressor(jump_step=SPIKE, jump=1000.0),
                       StepRegressionData(), gradient_clip_val=1.0)  # fmt: skip
    saved = {
        "model": model,
        "data": {"class_path": DATA},
        "trainer": {"max_steps": STEPS, "gradient_clip_val": 1.0},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    verdict = diagnose(checkpoint_path(run, K), SPIKE + 1, CONFIG)
    assert verdict.cause == "state-caused", verdict.evidence
    assert verdict.same_data.bit_equal, verdict.evidence


def test_a_validation_that_steers_the_run_is_replayed_as_it_ran(tmp_path: Path) -> None:
    """Issue 55: a ReduceLROnPlateau on val_loss every 5 steps, the run validated every 5
    (2 batches), a poisoned batch. The replays validated nothing (limit_val_batches=0):
    the plateau read the file's last val_loss at every check and lowered the LR the run
    kept. With the record's validation settings they validate as the run did:
    data-caused, bit-equal."""
    data = functools.partial(ValidatedRegressionData, poison=[SPIKE])
    validation = {"val_check_interval": 5, "check_val_every_n_epoch": None, "limit_val_batches": 2}
    run = original_run(tmp_path, "plateau", PlateauRegressor(lr=0.01), data(), **validation)
    saved = {  # at lr 0.01 val_loss improves at each validation: the LR stays
        "model": {"class_path": "tests.modules.spiky_modules.PlateauRegressor",
                  "init_args": {"lr": 0.01}},
        "data": {"class_path": "tests.modules.spiky_modules.ValidatedRegressionData",
                 "init_args": {"poison": [SPIKE]}},
        "trainer": {"max_steps": STEPS, **validation},
    }  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    verdict = diagnose(checkpoint_path(run, K), SPIKE, CONFIG)
    assert verdict.cause == "data-caused", verdict.evidence
    assert verdict.same_data.bit_equal, verdict.evidence


def test_the_runs_own_loss_curve_is_found_and_named(tmp_path: Path) -> None:
    """Issue 55: SpikeDetector() at its default monitor (what training_step returns) and a
    module that logs train_loss: diagnose said "no original loss to compare with" unless
    --loss_tag train_loss was given. It reads that curve now, and says so."""
    data = functools.partial(StepRegressionData, poison=[SPIKE])
    run = original_run(tmp_path, "named", TrainLossRegressor(), data(), [SpikeDetector()])
    ckpt = checkpoint_path(run, K)
    verdict = diagnose(ckpt, SPIKE, CONFIG, model=TrainLossRegressor, data=data)
    assert verdict.cause == "data-caused" and verdict.same_data.bit_equal, verdict.evidence
    assert verdict.original_loss is not None
    assert "The original loss is the run's TensorBoard tag 'train_loss'." in verdict.evidence


def test_the_module_is_asked_for_where_the_file_cannot_say(tmp_path: Path) -> None:
    run = original_run(tmp_path, "bare", JumpRegressor(), StepRegressionData())
    with pytest.raises(ValueError, match=r"does not build TinyGPTModule .*give its model"):
        diagnose(checkpoint_path(run, K), SPIKE, CONFIG)
    with pytest.raises(
        ValueError, match=r"model='tests.modules.spiky_modules.Nothing': .*no class"
    ):
        diagnose(
            checkpoint_path(run, K), SPIKE, CONFIG, model="tests.modules.spiky_modules.Nothing"
        )
    with pytest.raises(
        ValueError, match=r"data='tests.modules.spiky_modules.JumpRegressor' is not a "
    ):
        diagnose(checkpoint_path(run, K), SPIKE, CONFIG, model=JUMP, data=JUMP)


# ------------------------------------------------------------------ the command line


def test_the_command_line_takes_class_paths_and_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = original_run(tmp_path, "poison", JumpRegressor(), StepRegressionData(poison=[SPIKE]))
    ckpt = checkpoint_path(run, K)
    options = {
        "window_after": 10,
        "horizon": 4,
        "detector": {"ratio": 3.0},
        "model": JUMP,
        "data": {"class_path": DATA, "init_args": {"poison": [SPIKE]}},
    }
    (tmp_path / "diagnose.yaml").write_text(yaml.safe_dump(options))
    argv = ["diagnose", "--config", str(tmp_path / "diagnose.yaml"), "--ckpt_path", str(ckpt)]
    verdict = cli_main([*argv, "--spike_step", str(SPIKE), "--json", str(tmp_path / "v.json")])
    assert verdict.cause == "data-caused", verdict.evidence
    assert "Verdict: data-caused" in capsys.readouterr().out
    written = json.loads((tmp_path / "v.json").read_text())
    assert written["cause"] == "data-caused"
    ratios = [o["judgement"]["ratio"] for o in written["other_data"]]  # each window's, read
    assert ratios == [o.ratio for o in verdict.other_data] and len(ratios) == 3
    # The same on the command line alone, the other cause: without the poison
    argv = ["diagnose", "--ckpt_path", str(ckpt), "--spike_step", str(SPIKE), "--model", JUMP]
    argv += ["--data", DATA, "--window_after", "10", "--horizon", "4", "--detector.ratio", "3"]
    assert cli_main(argv).cause == "not-reproducible"
    # The built-in data's options are refused beside another --data
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*argv, "--poison", f"[{SPIKE}]"])
    assert exit_info.value.code == 2
    assert "give the settings of --data as --data.init_args.NAME" in capsys.readouterr().err


def test_help_lists_every_option_with_its_docstring(capsys: pytest.CaptureFixture[str]) -> None:
    from lit_spikes.tools.diagnose import DiagnoseCommand

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["diagnose", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # the help's line breaks as spaces
    names = [f.name for f in fields(DiagnoseConfig)] + ["detector.help"]
    names += [f.name for f in fields(DiagnoseCommand)] + ["model", "data", "config"]
    assert [name for name in names if f"--{name} " not in out] == []
    # The detector's fields (None by default: the run's own detector) under --detector.help
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["diagnose", "--detector.help"])
    assert exit_info.value.code == 0
    nested = " ".join(capsys.readouterr().out.split())
    assert [f.name for f in fields(DetectorConfig) if f"--detector.{f.name} " not in nested] == []
    for docstring in (
        "Replays train this many steps past the spike",  # DiagnoseConfig.horizon
        "The TensorBoard tag of the loss the run logged",  # DiagnoseConfig.loss_tag
        "An earlier checkpoint of the run, for replay (c).",  # DiagnoseCommand
    ):
        assert docstring in out
    assert "--ckpt-path" not in out and "--spike-step" not in out  # one spelling: fit's


def test_a_misspelt_option_gets_two_lines_and_the_one_it_meant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, error in [
        (["--ckpt_path", "a.ckpt", "--spike-step", "5"], "(did you mean --spike_step?)"),
        (["--ckpt_pth", "a.ckpt", "--spike_step", "5"], "(did you mean --ckpt_path?)"),
        (["--ckpt_path", "a.ckpt"], "required: spike_step"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["diagnose", *argv])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("usage: lit-spikes diagnose"), lines
        assert error in lines[1], lines
