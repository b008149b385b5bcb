"""The step progress bar: global steps out of max_steps, also in a resumed run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback, TQDMProgressBar

from lit_spikes.shared.progress import StepProgressBar, with_step_progress_bar
from lit_spikes.shared.training import RunSpec, checkpoint_path
from lit_spikes.tools.cli import build_cli
from tests.conftest import TINY_CLI, fit

N, K = 12, 6


def train_bar(trainer: pl.Trainer) -> tuple[float, float | None, str]:
    [bar] = [cb for cb in trainer.callbacks if isinstance(cb, StepProgressBar)]  # type: ignore[attr-defined]
    assert bar.progress is not None and bar.train_progress_bar_id is not None
    task = bar.progress.tasks[bar.train_progress_bar_id]
    return task.completed, task.total, task.description.strip()


def test_the_bar_counts_global_steps_from_a_resumed_step(tmp_path: Path) -> None:
    bar = {"enable_progress_bar": True, "callbacks": [StepProgressBar()]}
    full = fit(tmp_path, "full", N, checkpoint_every=K, **bar)  # type: ignore[arg-type]
    assert train_bar(full.trainer) == (N, N, "Step")
    first_seen: list[tuple[float, float | None, str]] = []

    class FirstStep(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if not first_seen:
                first_seen.append(train_bar(trainer))

    resumed = fit(
        tmp_path,
        "resumed",
        N,
        ckpt_path=checkpoint_path(tmp_path / "full", K),
        checkpoint_every=K,  # the callbacks of the run it resumes
        enable_progress_bar=True,
        callbacks=[StepProgressBar(), FirstStep()],
    )
    assert first_seen == [(K, N, "Step")]  # it starts where the checkpoint is
    assert train_bar(resumed.trainer) == (N, N, "Step")  # Lightning's own: N of N - K
    trainer = RunSpec(tmp_path, "spec", N, progress_bar=True).trainer()
    assert sum(isinstance(cb, StepProgressBar) for cb in trainer.callbacks) == 1  # type: ignore[attr-defined]


def test_a_bar_of_the_users_own_is_kept() -> None:
    tqdm = TQDMProgressBar()
    assert with_step_progress_bar([tqdm]) == [tqdm]
    [added] = with_step_progress_bar([])
    assert isinstance(added, StepProgressBar)


def test_a_trainer_without_max_steps_is_refused(tmp_path: Path) -> None:
    trainer = pl.Trainer(max_epochs=1, callbacks=[StepProgressBar()], logger=False)
    with pytest.raises(ValueError, match=r"StepProgressBar needs a Trainer with max_steps"):
        StepProgressBar().setup(trainer, pl.LightningModule(), "fit")


def test_the_cli_uses_it_unless_told_otherwise(tmp_path: Path) -> None:
    root = ["--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "true"]
    cli = build_cli([*TINY_CLI, *root], run=False)
    assert any(isinstance(cb, StepProgressBar) for cb in cli.trainer.callbacks)  # type: ignore[attr-defined]
    own = ["--trainer.callbacks", "TQDMProgressBar"]
    cli = build_cli([*TINY_CLI, *root, *own], run=False)
    bars = [cb for cb in cli.trainer.callbacks if isinstance(cb, TQDMProgressBar | StepProgressBar)]  # type: ignore[attr-defined]
    assert [type(b) for b in bars] == [TQDMProgressBar]
