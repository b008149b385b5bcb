"""`lit-spikes` (LightningCLI): options, defaults and errors."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import LRScaler
from lit_spikes.tools.cli import main
from tests.conftest import TINY_CLI


def test_fit_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--checkpoint_every",
        "--model.gpt.n_layer",
        "--model.optim.peak_lr",
        "--data.config.seed",
        "--trainer.max_steps",
        "--ckpt_path",
        "--config",
    ):
        assert option in out, option
    # --ckpt_path says what lit-spikes takes, not Lightning's keywords it refuses
    assert "'latest': the newest valid one" in " ".join(out.split())
    # Any module and data by class path, the project's own the defaults, listed; the
    # project's options first, Lightning's Trainer last (argparse orders sections as they
    # are added: the Trainer's come last, no private reordering)
    assert "--model CLASS_PATH: the LightningModule to train" in out
    assert "Default: lit_spikes.demo.module.TinyGPTModule" in out
    assert "Default: lit_spikes.demo.data.StepDataModule" in out
    order = ["--checkpoint_every", "--model CLASS_PATH", "--data CLASS_PATH", "--ckpt_path"]
    positions = [out.index(option) for option in [*order, "--trainer.max_steps"]]
    assert positions == sorted(positions)


def test_defaults_reproduce_the_seed_setup() -> None:
    from lit_spikes.tools.cli import build_cli

    parsed = build_cli([], run=False)
    module, data, trainer = parsed.model, parsed.datamodule, parsed.trainer
    assert (module.model_config.n_layer, module.model_config.d_model) == (4, 64)
    assert not module.model_config.qk_norm
    assert module.optim_config.peak_lr == 0.1 and module.optim_config.max_steps == 400
    assert data.config.batch_size == 16 and trainer.max_steps == 400


def test_negative_checkpoint_every_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--checkpoint_every", "-5"])
    assert exit_info.value.code != 0
    assert "--checkpoint_every=-5 must be >= 0" in capsys.readouterr().err


def test_trainer_can_stop_before_the_schedule_ends(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.max_steps", "100", "--print_config"])
    out = capsys.readouterr().out
    assert "max_steps: 100" in out and "max_steps: 400" in out  # the trainer's, the schedule's


def test_console_script_exits_zero(tmp_path: Path) -> None:
    """`lit-spikes` is sys.exit(main()): a finished run must exit 0, printing nothing odd."""
    import subprocess
    import sys

    script = "import sys; from lit_spikes.tools.cli import main; sys.exit(main())"
    tiny = [
        "fit",
        *TINY_CLI,
        "--trainer.max_steps",
        "2",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--checkpoint_every",
        "0",
    ]
    result = subprocess.run(
        [sys.executable, "-c", script, *tiny], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LitSpikesCLI object" not in result.stdout + result.stderr


class AnnounceTraining(Callback):
    """Prints ``training`` after step 2: a test's cue that the run's signal handlers
    (Lightning's, ``PreemptionCheckpoint``'s) are in place."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 2:
            print("training", flush=True)


@pytest.mark.parametrize("every", ["0", "1000"])
def test_console_script_stopped_by_sigterm_exits_128_plus_the_signal(
    tmp_path: Path, every: str
) -> None:
    """With checkpoints the preemption callback stops the run; without them Lightning
    does, with SystemExit(None): either way a scheduler must not see status 0."""
    import signal
    import subprocess
    import sys

    script = "import sys; from lit_spikes.tools.cli import main; sys.exit(main())"
    run = ["fit", *TINY_CLI, "--trainer.default_root_dir", str(tmp_path), "--checkpoint_every"]
    run += [every, "--trainer.max_steps", "100000", "--model.optim.max_steps", "100000"]
    run += ["--trainer.callbacks+=tests.tools.test_cli.AnnounceTraining"]
    child = subprocess.Popen(
        [sys.executable, "-c", script, *run],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert child.stdout is not None
        for line in child.stdout:  # once it trains, every signal handler is in place
            if line.strip() == "training":
                break
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    if every != "0":  # the file the preemption wrote, and how to go on from it
        hint = f"resume with the same command and --ckpt_path {tmp_path / 'checkpoints'}/step="
        assert hint in stderr


def test_top_level_help_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("fit", "recover", "diagnose"):
        assert f"\n  {command} " in out, command
    # No command, or a misspelt one: every command named, not LightningCLI's two
    for argv, what in (
        ([], "no command given"),
        (["recovr"], "unknown command 'recovr'"),
        (["--print_config"], "no command given (before --print_config)"),  # LightningCLI's
    ):  # message named {fit,validate} (issue 52, item 9)
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert f"{what}: choose from fit, validate, recover, diagnose" in capsys.readouterr().err


def test_fit_writes_checkpoints_as_the_scripts_do() -> None:
    """Files are written atomically (one process or DDP) and the profiler is Lightning's
    default; with a profiler asked for, it is the one asked for."""
    from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

    from lit_spikes.checkpoints import AtomicCheckpointIO
    from lit_spikes.tools.cli import build_cli

    trainer = build_cli([], run=False).trainer
    io_plugin = trainer.strategy.checkpoint_io
    assert isinstance(io_plugin, AtomicCheckpointIO)
    assert type(trainer.profiler) is PassThroughProfiler
    args = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.profiler", "simple"]
    trainer = build_cli(args, run=False).trainer
    io_plugin = trainer.strategy.checkpoint_io
    assert isinstance(io_plugin, AtomicCheckpointIO)
    assert isinstance(trainer.profiler, SimpleProfiler)


def test_a_resume_refuses_model_flags_that_differ_from_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LightningCLI hands the model the checkpoint's settings whatever the command line
    says: a flag asking for others must not be dropped without a word."""
    args = ["fit", *TINY_CLI, "--checkpoint_every", "5", "--trainer.enable_model_summary", "false"]
    main([*args, "--trainer.default_root_dir", str(tmp_path / "ref"), "--trainer.max_steps", "10"])
    resume = [*args, "--trainer.max_steps", "12", "--ckpt_path"]
    resume += [str(tmp_path / "ref" / "checkpoints" / "step=10.ckpt")]
    for flag, value, saved in [("optim.lr_scale", "0.5", "1.0"), ("gpt.dropout", "0.1", "0.0")]:
        with pytest.raises(SystemExit):
            main(
                [
                    *resume,
                    "--trainer.default_root_dir",
                    str(tmp_path / "x"),
                    f"--model.{flag}",
                    value,
                ]
            )
        assert f"--model.{flag}={value} (the checkpoint's: {saved})" in capsys.readouterr().err
    assert not (tmp_path / "x" / "checkpoints").exists()
    # A thread count is the process's to choose: kept as asked, with the module's warning.
    with pytest.warns(UserWarning, match="num_threads: checkpoint 1, now 2"):
        cli = main(
            [*resume, "--trainer.default_root_dir", str(tmp_path / "y"), "--model.num_threads", "2"]
        )
    assert cli is not None and cli.model.num_threads == 2 and cli.trainer.global_step == 12


def test_ckpt_path_alone_resumes_the_checkpoints_data_and_model_bit_exactly(
    tmp_path: Path,
) -> None:
    """What a preempted run prints, ``--ckpt_path <file>``, is enough: the model and the
    data config come from the checkpoint (LightningCLI restores only the model's), and so
    do the Trainer's gradient clipping and the callbacks of the run's config.yaml."""
    from tests.conftest import assert_states_equal, load_ckpt

    every = ["--checkpoint_every", "2", "--trainer.enable_model_summary", "false"]
    every += ["--trainer.max_steps", "12"]
    data = ["--data.config.seed", "5", "--data.config.world.num_chars", "30000"]
    clip = ["--trainer.gradient_clip_val", "0.05", "--trainer.gradient_clip_algorithm", "value"]
    scaler = [
        "--trainer.callbacks+=lit_spikes.callbacks.LRScaler",
        "--trainer.callbacks.factor",
        "0.5",
    ]
    scaler += ["--trainer.callbacks.start_step", "6"]
    ref = tmp_path / "ref"
    main(["fit", *TINY_CLI, *every, *data, *clip, *scaler, "--trainer.default_root_dir", str(ref)])
    ckpt = ["--ckpt_path", str(ref / "checkpoints" / "step=10.ckpt")]
    resumed = tmp_path / "resumed"
    flags = [*every, "--trainer.limit_val_batches", "0"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(data seed|data config|different setup).*")
        cli = main(["fit", *flags, "--trainer.default_root_dir", str(resumed), *ckpt])
    assert cli is not None and cli.datamodule.config.seed == 5
    assert cli.datamodule.config.world.num_chars == 30000 and cli.model.model_config.d_model == 16
    assert cli.trainer.gradient_clip_val == 0.05
    # the run's callbacks (here its remedy) from its config.yaml, beside its checkpoints
    (scaling,) = [c for c in cli.trainer.callbacks if isinstance(c, LRScaler)]
    assert (scaling.factor, scaling.start_step) == (0.5, 6)
    assert "lit_spikes.callbacks.LRScaler" in (resumed / "config.yaml").read_text()
    assert str(cli.trainer.gradient_clip_algorithm.value) == "value"
    assert_states_equal(
        load_ckpt(ref / "checkpoints" / "step=12.ckpt"),
        load_ckpt(resumed / "checkpoints" / "step=12.ckpt"),
    )
    # A data setting asked for is kept, and the run says it is another one.
    with pytest.warns(UserWarning, match=r"another data config \(batch_size: checkpoint 4, now 2"):
        other = ["--trainer.default_root_dir", str(tmp_path / "other"), "--data.config.batch_size"]
        main(["fit", *flags, *other, "2", *ckpt])


def test_commands_the_module_cannot_run_and_lightnings_other_keywords_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("test", "predict"):  # TinyGPTModule has no test or predict step
        with pytest.raises(SystemExit) as exit_info:
            main([command])
        assert exit_info.value.code == 2
        assert f"unknown command '{command}': choose from fit, validate" in capsys.readouterr().err
    for keyword in ("best", "hpc"):
        with pytest.raises(SystemExit):
            main(["fit", *TINY_CLI, "--ckpt_path", keyword])
        assert "use --ckpt_path latest for the newest" in capsys.readouterr().err


def test_ckpt_path_last_starts_a_new_run_then_resumes_the_newest_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning's "last" is set and forget: one command line for a job's first start and
    for every requeue of it. Where there is no checkpoint yet it starts the run; then it
    resumes the newest file, bit-exactly."""
    from tests.conftest import assert_states_equal, load_ckpt

    every = ["--checkpoint_every", "2", "--trainer.enable_model_summary", "false"]
    root = tmp_path / "job"
    job = ["fit", *TINY_CLI, *every, "--trainer.default_root_dir", str(root)]
    main([*job, "--ckpt_path", "last", "--trainer.max_steps", "6"])
    cli = main([*job, "--ckpt_path", "last", "--trainer.max_steps", "12"])
    assert cli is not None and cli.trainer.ckpt_path == str(root / "checkpoints" / "step=6.ckpt")
    straight = tmp_path / "straight"
    main(["fit", *TINY_CLI, *every, "--trainer.default_root_dir", str(straight)])
    assert_states_equal(
        load_ckpt(straight / "checkpoints" / "step=12.ckpt"),
        load_ckpt(root / "checkpoints" / "step=12.ckpt"),
    )
    # validate has nothing to start: no checkpoint is an error there
    with pytest.raises(SystemExit):
        none = ["--trainer.default_root_dir", str(tmp_path / "none"), "--ckpt_path", "last"]
        main(["validate", *TINY_CLI, *none])
    assert "--ckpt_path last: checkpoint directory" in capsys.readouterr().err


def test_a_run_ending_off_its_checkpoint_interval_leaves_its_last_step(tmp_path: Path) -> None:
    """max_steps 12 with a checkpoint every 5: step=12.ckpt too, and extending the run from
    it with --ckpt_path latest equals the uninterrupted run."""
    from tests.conftest import assert_states_equal, load_ckpt

    args = ["fit", *TINY_CLI, "--checkpoint_every", "5", "--trainer.enable_model_summary", "false"]
    short, full = tmp_path / "short", tmp_path / "full"
    main([*args, "--trainer.default_root_dir", str(short), "--trainer.max_steps", "12"])
    files = sorted(p.name for p in (short / "checkpoints").iterdir())
    assert files == ["step=10.ckpt", "step=12.ckpt", "step=5.ckpt"]
    cli = main([*args, "--trainer.default_root_dir", str(short), "--trainer.max_steps", "20",
                "--ckpt_path", "latest"])  # fmt: skip
    assert cli is not None and Path(cli.trainer.ckpt_path).name == "step=12.ckpt"
    main([*args, "--trainer.default_root_dir", str(full), "--trainer.max_steps", "20"])
    assert_states_equal(
        load_ckpt(full / "checkpoints" / "step=20.ckpt"),
        load_ckpt(short / "checkpoints" / "step=20.ckpt"),
    )
    # Shorter than the interval: still one file.
    main([*args, "--trainer.default_root_dir", str(tmp_path / "tiny"), "--trainer.max_steps", "3"])
    assert sorted(p.name for p in (tmp_path / "tiny" / "checkpoints").iterdir()) == ["step=3.ckpt"]


def test_fit_refuses_to_mix_two_histories_in_one_checkpoint_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new run, or a resume from another directory or from an older file, into a
    directory with a run's checkpoints would write beside them, and --ckpt_path latest
    would later pick whichever step is highest: refused, nothing written."""
    args = ["fit", *TINY_CLI, "--checkpoint_every", "5", "--trainer.enable_model_summary", "false"]
    run, other = tmp_path / "run", tmp_path / "other"
    main([*args, "--trainer.default_root_dir", str(run), "--trainer.max_steps", "10"])
    main([*args, "--trainer.default_root_dir", str(other), "--trainer.max_steps", "5"])
    capsys.readouterr()
    before = sorted(p.name for p in run.rglob("*"))
    own_older = str(run / "checkpoints" / "step=5.ckpt")
    foreign = str(other / "checkpoints" / "step=5.ckpt")
    for extra, message in [
        ([], "a new run there would mix its files and TensorBoard steps"),
        (["--ckpt_path", foreign], f"--ckpt_path {foreign} is not one of them"),
        (["--ckpt_path", own_older], "is at step 5, but"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--trainer.default_root_dir", str(run), *extra])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"{run / 'checkpoints'} holds the checkpoints of a run (step=5 to step=10)" in err
        assert message in err
        assert sorted(p.name for p in run.rglob("*")) == before
    resumed = main([*args, "--trainer.default_root_dir", str(run), "--trainer.max_steps", "15",
                    "--ckpt_path", str(run / "checkpoints" / "step=10.ckpt")])  # fmt: skip
    assert resumed is not None and resumed.trainer.global_step == 15  # its own newest: fine
    # A run of no checkpoints leaves only its events: a second one would log its steps
    # into the same curves (20 duplicated steps)
    bare = ["fit", *TINY_CLI, "--checkpoint_every", "0", "--trainer.max_steps", "3"]
    main([*bare, "--trainer.default_root_dir", str(tmp_path / "bare")])
    events = sorted((tmp_path / "bare").glob("events.out.tfevents.*"))
    with pytest.raises(SystemExit):
        main([*bare, "--trainer.default_root_dir", str(tmp_path / "bare")])
    assert "holds the TensorBoard events of a run" in capsys.readouterr().err
    assert sorted((tmp_path / "bare").glob("events.out.tfevents.*")) == events
    # ... but --ckpt_path last is a job's requeue: a run of no checkpoint has nothing to
    # resume or protect, it starts anew, its events replaced (test_cli_hunt.py)
    main([*bare, "--trainer.default_root_dir", str(tmp_path / "bare"), "--ckpt_path", "last"])
    assert "has no checkpoint to resume" in capsys.readouterr().err
    assert not any(path.exists() for path in events)


def test_a_resume_keeps_explicit_settings_even_when_they_equal_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint's settings fill in only what the command line and --config leave
    out: an explicit value that happens to be the default is still asked for."""
    import yaml

    args = ["fit", *TINY_CLI, "--checkpoint_every", "5", "--trainer.enable_model_summary", "false"]
    ref = tmp_path / "ref"
    main([*args, "--trainer.default_root_dir", str(ref), "--trainer.max_steps", "10",
          "--model.optim.lr_scale", "0.5", "--data.config.seed", "7"])  # fmt: skip
    resume = [*args, "--trainer.max_steps", "12", "--ckpt_path"]
    resume += [str(ref / "checkpoints" / "step=10.ckpt")]
    # lr_scale 1.0 is the default, but not the checkpoint's 0.5: refused, not dropped.
    with pytest.raises(SystemExit):
        main([*resume, "--trainer.default_root_dir", str(tmp_path / "x"),
              "--model.optim.lr_scale", "1.0"])  # fmt: skip
    assert "--model.optim.lr_scale=1.0 (the checkpoint's: 0.5)" in capsys.readouterr().err
    # Seed 0 (the default) from a --config file: kept, and the data module says so.
    (tmp_path / "data.yaml").write_text(yaml.safe_dump({"data": {"config": {"seed": 0}}}))
    with pytest.warns(UserWarning, match="trained with data seed 7, this run uses 0"):
        cli = main([*resume, "--trainer.default_root_dir", str(tmp_path / "y"),
                    "--config", str(tmp_path / "data.yaml")])  # fmt: skip
    assert cli is not None and cli.datamodule.config.seed == 0
    assert cli.model.optim_config.lr_scale == 0.5  # what was not given: the checkpoint's


def test_validate_takes_any_checkpoint_and_leaves_the_run_alone(tmp_path: Path) -> None:
    """validate trains nothing: the run's last file is fine, and its TensorBoard curves in
    the same directory are not purged from the checkpoint's step on."""
    from tests.conftest import tb_scalars

    root = tmp_path / "run"
    args = [*TINY_CLI, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "10"]
    main(["fit", *args, "--checkpoint_every", "5", "--trainer.enable_model_summary", "false"])
    before = tb_scalars(root)["train/loss"]
    for step in (10, 5):
        ckpt = str(root / "checkpoints" / f"step={step}.ckpt")
        cli = main(["validate", *args, "--trainer.limit_val_batches", "2", "--ckpt_path", ckpt])
        assert cli is not None and "val/bpc" in cli.trainer.callback_metrics
    assert (
        [s for s, _ in tb_scalars(root)["train/loss"]] == [s for s, _ in before] == list(range(10))
    )
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == [
        "step=10.ckpt",
        "step=5.ckpt",
    ]
    # Each validation is a run of its own, named by its checkpoint: the training run's
    # config.yaml is not overwritten with the validate command's.
    assert yaml.safe_load((root / "config.yaml").read_text())["checkpoint_every"] == 5
    for step in (10, 5):
        run = root / "validate" / f"step={step}"
        assert [s for s, _ in tb_scalars(run)["val/bpc"]] == [0]
        assert yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"].endswith(
            f"step={step}.ckpt"
        )


def test_a_fit_validates_its_final_model_off_the_validation_interval(tmp_path: Path) -> None:
    """A run of 12 steps validating every 5 ends with the validation of step 12 too."""
    from tests.conftest import tb_scalars

    root = tmp_path / "run"
    args = [*TINY_CLI, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "12"]
    main(["fit", *args, "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "5"])
    assert [s for s, _ in tb_scalars(root)["val/bpc"]] == [4, 9, 11]  # after steps 5, 10, 12


def test_checkpointing_turned_off_the_lightning_way_names_the_option_that_does_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    args = [*TINY_CLI, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "3"]
    with pytest.raises(SystemExit):
        main(["fit", *args, "--trainer.enable_checkpointing", "false"])
    assert "give --checkpoint_every 0 for none" in capsys.readouterr().err
    assert not root.exists()
    main(["fit", *args, "--trainer.enable_checkpointing", "false", "--checkpoint_every", "0"])
    assert not (root / "checkpoints").exists()


def test_runspec_and_the_cli_take_the_standard_set_from_one_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock, the checkpoints, ValidateAtEnd, the logger and the checkpoint plugin of
    RunSpec's and of lit-spikes fit's Trainers come from one builder: a change there
    (here: the step checkpoint) reaches both."""
    from lit_spikes.callbacks import RunDirectoryLock
    from lit_spikes.checkpoints import AtomicCheckpointIO
    from lit_spikes.shared import training
    from lit_spikes.shared.tb import RunLogger

    class Marker(Callback):
        pass

    import lit_spikes.tools.fit_cli  # noqa: F401 (imported before the change, as in any process)

    monkeypatch.setattr(training, "step_checkpoint", lambda dirpath, every: Marker())
    spec = training.RunSpec(tmp_path, "spec", 12, checkpoint_every=5, val_every=5)
    args = [*TINY_CLI, "--trainer.default_root_dir", str(tmp_path / "cli"), "--checkpoint_every"]
    args += ["5", "--trainer.max_steps", "12", "--trainer.val_check_interval", "5"]
    cli = main(["fit", *args])
    assert cli is not None
    for trainer in (spec.trainer(), cli.trainer):
        kinds = {type(callback) for callback in trainer.callbacks}
        assert {Marker, RunDirectoryLock, training.ValidateAtEnd} <= kinds
        assert isinstance(trainer.logger, RunLogger)
        assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
