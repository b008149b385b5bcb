"""``lit-spikes fit`` on bad input: it fails before training and writes nothing; a busy
directory exits 75 naming its holder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lit_spikes.callbacks.run_lock import LOCK_NAME
from lit_spikes.tools.cli import main as cli_main
from tests.conftest import (
    TINY_CLI,
)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--trainer.max_steps", "0"], "--trainer.max_steps=0 must be positive"),
        (["--trainer.max_steps", "-7"], "--trainer.max_steps=-7 must be positive"),
        (["--model.optim.max_steps", "0"], "max_steps=0 must be"),
        (["--checkpoint_every", "-1"], "--checkpoint_every=-1 must be >= 0"),
        (
            [
                "--trainer.callbacks+=lit_spikes.callbacks.BatchSkipper",
                "--trainer.callbacks.ranges=[[30, 20]]",
            ],
            "ranges entry",
        ),
        (["--trainer.callbacks+=lit_spikes.callbacks.NoSuchRemedy"], "NoSuchRemedy"),
        (["--trainer.default_root_dir", "/proc/lit-spikes/run"], "cannot be created"),
        (["--trainer.default_root_dir", "/proc/self"], "/proc/self is not writable"),
        (["--model.gpt.block_size", "8"], "DataConfig.block_size=16 exceeds GPTConfig.block_"),
        (["--model.gpt.vocab_size", "10"], "vocab_size=10 is smaller than the 41 characters"),
        (["--trainer.accumulate_grad_batches", "2"], "Trainer(accumulate_grad_batches=2)"),
        (["--trainer.overfit_batches", "2"], "Trainer(overfit_batches=2)"),
        (["--trainer.val_check_interval", "0"], "--trainer.val_check_interval=0 must be >= 1"),
        (
            ["--trainer.devices", "3"],
            "must divide by world_size=3 (num_nodes x devices): train on 2",
        ),
        (["--trainer.val_check_interval", "1.5"], "val_check_interval=1.5 must be a whole"),
        (["--trainer.val_check_interval", "0.5"], "val_check_interval=0.5 must be a whole"),
        (
            [
                *("--model.gpt.block_size", "256", "--data.config.block_size", "256"),
                *("--data.config.world.num_chars", "1000"),
            ],
            "characters, fewer than DataConfig.block_size=256 + 1",
        ),
    ],
)
def test_bad_cli_input_fails_before_training_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(root), *extra])
    assert exit_info.value.code != 0
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # not even an empty directory, wherever the root was


def test_a_checkpoint_directory_that_cannot_take_files_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the root was checked: a run trained to its first checkpoint, then failed.
    (Root ignores permissions: a file in the directory's place stands for read-only.)"""
    root = tmp_path / "run"
    root.mkdir()
    (root / "checkpoints").write_text("a file where the directory goes")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(
            ["fit", *TINY_CLI, "--checkpoint_every", "5", "--trainer.default_root_dir", str(root)]
        )
    assert exit_info.value.code == 2
    assert f"{root / 'checkpoints'} cannot be created" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["checkpoints"]


def test_lit_spikes_fit_into_a_busy_directory_exits_75_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], directory_holder: Any
) -> None:
    root = tmp_path / "run"
    holder = directory_holder(root)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(root)])
    assert exit_info.value.code == os.EX_TEMPFAIL  # a scheduler may retry later
    assert f"run directory {root} is in use by another run (pid {holder.pid} on " in (
        capsys.readouterr().err
    )
    assert sorted(p.name for p in root.iterdir()) == [LOCK_NAME]  # no config.yaml either
    # With the holder's checkpoints there, still the busy directory (not "go on with it
    # with --ckpt_path latest", which would then stop the same way)
    (root / "checkpoints").mkdir()
    (root / "checkpoints" / "step=5.ckpt").write_bytes(b"the holder's, being trained")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(root)])
    assert exit_info.value.code == os.EX_TEMPFAIL
    assert "is in use by another run" in capsys.readouterr().err
