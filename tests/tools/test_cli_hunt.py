"""`lit-spikes` defects from the adversarial hunt (issue 27) and what a new user tripped
over (issue 22): each test here failed on the code before its fix."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lit_spikes.callbacks import LRScaler
from lit_spikes.tools.cli import main
from tests.conftest import REPO, TINY_CLI, assert_states_equal, load_ckpt, tb_steps

QUIET = ["--trainer.enable_model_summary", "false"]


def _scaled_run(tmp_path: Path, name: str, steps: int) -> Path:
    """A run whose LRScaler comes from a --config file: step=5, 10 (and ``steps``)."""
    config = tmp_path / "scaler.yaml"
    callback = {"class_path": "lit_spikes.callbacks.LRScaler"}
    callback["init_args"] = {"factor": 0.5, "start_step": 5}  # type: ignore[assignment]
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    root = tmp_path / name
    main(["fit", *TINY_CLI, *QUIET, "--config", str(config), "--checkpoint_every", "5",
          "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(root)])  # fmt: skip
    return root


def test_a_copied_checkpoint_resumes_with_the_callbacks_its_record_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Copied away from its run directory (no config.yaml two folders up), the file's own
    record of callbacks rebuilds its LRScaler: the resume is the uninterrupted run."""
    ref = _scaled_run(tmp_path, "ref", 12)
    copy = tmp_path / "archive" / "step=10.ckpt"
    copy.parent.mkdir()
    shutil.copy(ref / "checkpoints" / "step=10.ckpt", copy)
    capsys.readouterr()
    resumed = tmp_path / "resumed"
    cli = main(["fit", *QUIET, "--checkpoint_every", "2", "--trainer.max_steps", "12",
                "--trainer.default_root_dir", str(resumed), "--ckpt_path", str(copy)])  # fmt: skip
    assert cli is not None
    (scaler,) = [c for c in cli.trainer.callbacks if isinstance(c, LRScaler)]
    assert (scaler.factor, scaler.start_step, scaler.end_step) == (0.5, 5, None)
    err = capsys.readouterr().err
    assert "callbacks from the checkpoint's record" in err and "LRScaler(factor=0.5" in err
    assert_states_equal(
        load_ckpt(ref / "checkpoints" / "step=12.ckpt"),
        load_ckpt(resumed / "checkpoints" / "step=12.ckpt"),
    )
    # What a --config gives explicitly wins: its own scaler instead of the record's.
    other = tmp_path / "other.yaml"
    callback = {"class_path": "lit_spikes.callbacks.LRScaler", "init_args": {"factor": 0.25}}
    other.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    with warnings.catch_warnings():
        # Lightning's note that the file's LRScaler(factor=0.5) is not among the callbacks:
        # on purpose here, the config's scaler replaces it.
        warnings.filterwarnings("ignore", r"Be aware .*LRScaler\{'factor': 0\.5", UserWarning)
        cli = main(["fit", *QUIET, "--checkpoint_every", "0", "--trainer.max_steps", "11",
                    "--trainer.default_root_dir", str(tmp_path / "explicit"), "--config",
                    str(other), "--ckpt_path", str(copy)])  # fmt: skip
    assert cli is not None
    assert [c.factor for c in cli.trainer.callbacks if isinstance(c, LRScaler)] == [0.25]


def test_a_callback_the_record_names_but_cannot_rebuild_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = _scaled_run(tmp_path, "ref", 10)
    checkpoint = torch.load(ref / "checkpoints" / "step=10.ckpt", weights_only=True)
    checkpoint["callbacks"]["EarlyStopping{'monitor': 'val/bpc', 'mode': 'min'}"] = {"wait": 1}
    copy = tmp_path / "step=10.ckpt"
    torch.save(checkpoint, copy)
    capsys.readouterr()
    out = tmp_path / "resumed"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.max_steps", "12", "--trainer.default_root_dir", str(out),
              "--ckpt_path", str(copy)])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot rebuild from the file: EarlyStopping{'monitor': 'val/bpc'" in err
    assert "LRScaler" not in err.partition("cannot rebuild")[2]  # that one it rebuilds
    assert not out.exists()


JOB = ["fit", *TINY_CLI, *QUIET, "--checkpoint_every", "4", "--trainer.max_steps", "6"]


def _events_of_a_run_cut_short(root: Path) -> list[Path]:
    """What the job ``JOB`` killed before its first checkpoint leaves: its config.yaml and
    events, no checkpoint (its run, less its files: tools/test_requeue.py kills one)."""
    main([*JOB, "--trainer.default_root_dir", str(root)])
    shutil.rmtree(root / "checkpoints")
    events = sorted(root.glob("events.out.tfevents.*"))
    assert events and (root / "config.yaml").is_file()
    return events


def test_ckpt_path_last_requeues_a_job_that_died_before_its_first_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same command line starts the job anew (README: `last` is the one command for
    a job's first start and its requeues), its partial events removed, said in a line."""
    root = tmp_path / "job"
    old = _events_of_a_run_cut_short(root)
    capsys.readouterr()
    cli = main([*JOB, "--trainer.default_root_dir", str(root), "--ckpt_path", "last"])
    assert cli is not None and cli.trainer.global_step == 6
    assert "has no checkpoint to resume" in capsys.readouterr().err
    assert not any(path.exists() for path in old)
    assert tb_steps(root)["train/loss"] == list(range(6))  # each step once
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == [
        "step=4.ckpt",
        "step=6.ckpt",
    ]


@pytest.mark.parametrize("last", [False, True])
def test_a_live_run_without_a_checkpoint_yet_is_named_first_exit_75(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    directory_holder: Any,
    last: bool,
) -> None:
    """The lock is probed before the directory's files are judged: the run still training
    there is what to say (exit 75, naming it), not that its events are in the way; and
    --ckpt_path last removes nothing of it."""
    root = tmp_path / "run"
    events = _events_of_a_run_cut_short(root)
    holder = directory_holder(root)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(root)]
             + ["--ckpt_path", "last"] * last)  # fmt: skip
    assert exit_info.value.code == 75
    assert str(holder.pid) in capsys.readouterr().err
    assert all(path.exists() for path in events)


def test_a_skip_position_before_the_resume_point_is_a_usage_error_before_any_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = tmp_path / "ref"
    main(["fit", *TINY_CLI, *QUIET, "--checkpoint_every", "5", "--trainer.max_steps", "10",
          "--trainer.default_root_dir", str(ref)])  # fmt: skip
    out = tmp_path / "resumed"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *QUIET, "--trainer.default_root_dir", str(out), "--data.config.skip", "[5]",
              "--trainer.max_steps", "20",
              "--ckpt_path", str(ref / "checkpoints" / "step=10.ckpt")])  # fmt: skip
    assert exit_info.value.code == 2
    assert "skip positions [5] lie before data position 10" in capsys.readouterr().err
    assert not out.exists()  # no config.yaml, no events


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--model.optim.peak_lr", "nan", "OptimConfig.peak_lr=nan must be finite and positive"),
        ("--model.optim.peak_lr", "inf", "OptimConfig.peak_lr=inf must be finite and positive"),
        ("--model.optim.peak_lr", "Infinity", "peak_lr=inf must be finite and positive"),
        ("--trainer.gradient_clip_val", "-1", "--trainer.gradient_clip_val=-1 must be a finite"),
        ("--trainer.gradient_clip_val", "nan", "--trainer.gradient_clip_val=nan must be a fin"),
    ],
)
def test_nonfinite_and_negative_settings_get_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    root = tmp_path / "run"
    for given in ([flag, value], [f"{flag}={value}"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(root), *given])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) <= 4, err
    assert not root.exists()


def test_max_epochs_ends_the_run_as_lightning_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An epoch of the endless step stream is the training text's tokens' worth of steps:
    here (1800 tokens, batches of 16 x 16) 8 steps, before max_steps (20)."""
    small = ["--data.config.world.num_chars", "2000", "--data.config.batch_size", "16"]
    small += ["--checkpoint_every", "0", "--trainer.max_epochs", "1"]
    cli = main(["fit", *TINY_CLI, *QUIET, *small, "--trainer.default_root_dir", str(tmp_path)])
    assert cli is not None
    tokens = int(cli.datamodule.train_tokens.numel())
    steps = -(-tokens // (16 * 16))
    assert steps < 20 and cli.trainer.global_step == steps
    assert f"an epoch here is {steps} steps" in capsys.readouterr().err


def test_top_level_help_and_dispatch_import_neither_torch_nor_lightning() -> None:
    """`lit-spikes --help` took 5.7 s: it imported everything before parsing."""
    code = (
        "import sys; from lit_spikes.tools.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    assert "\n  check-resume " in done.stdout


def test_an_option_before_the_command_gets_a_usage_line_of_every_command(
    tmp_path: Path,
) -> None:
    """``lit-spikes -c FILE`` reaches LightningCLI's own parser, whose usage line said
    ``{fit,validate}`` of the six commands. The command as a user types it: a new process."""
    command = [sys.executable, "-m", "lit_spikes.tools.cli", "-c", str(tmp_path / "none.yaml")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stderr
    usage = (
        "usage: lit-spikes [-c CONFIG] {fit,validate,recover,diagnose,check-resume,forensics,study}"
    )
    assert done.stderr.startswith(usage), done.stderr


def test_check_resume_is_dispatched_with_its_exit_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[list[str]] = []
    fake = types.ModuleType("lit_spikes.tools.check_resume")
    fake.main = lambda argv: calls.append(argv) or 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lit_spikes.tools.check_resume", fake)
    assert main(["check-resume", "--steps", "4"]) == 1
    monkeypatch.setattr(sys, "argv", ["lit-spikes", "check-resume", "--steps", "5"])
    with pytest.raises(SystemExit) as exit_info:  # the console script: its status
        main()
    assert exit_info.value.code == 1 and calls == [["--steps", "4"], ["--steps", "5"]]


def test_fit_help_puts_the_projects_options_first_and_says_what_they_mean_here(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Lines depend on the terminal's width and on which classes earlier imports registered
    # (jsonargparse lists every known subclass of a Trainer argument): count the options.
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    first_trainer = out.index("--trainer.accelerator")
    for own in ("--checkpoint_every", "--ckpt_path", "--model.gpt.n_layer", "--data.config.seed"):
        assert out.index(own) < first_trainer, own
    steps_help = " ".join(out[out.index("--trainer.max_steps MAX_STEPS") :].split()[:20])
    assert "where the LR schedule ends" in steps_help and "1000" not in steps_help
    options = [line for line in out.splitlines() if line.startswith("  -")]
    assert len(options) < 70, len(options)


def test_a_typo_gets_the_lines_that_matter_and_a_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.max_stepz", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean --trainer.max_steps?" in err
    assert len(err.splitlines()) <= 4, err  # 83 lines before, the usage block first


def test_a_fit_prints_no_litlogger_tip_nor_leafspec_warning_and_counts_flops(
    tmp_path: Path,
) -> None:
    script = "import sys; from lit_spikes.tools.cli import main; sys.exit(main())"
    run = ["fit", *TINY_CLI, "--trainer.max_steps", "2", "--checkpoint_every", "0"]
    run += ["--trainer.default_root_dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-c", script, *run], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "litlogger" not in out and "LeafSpec" not in out
    assert "Total FLOPs" in out and "Total FLOPs: 0 " not in out
