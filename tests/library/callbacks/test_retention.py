"""``CheckpointRetention``: it keeps the files a rollback or resume needs and prunes only its run's
own directory."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import pytest

from lit_spikes.callbacks import (
    CheckpointRetention,
    ExactResume,
    RollbackRestore,
)
from lit_spikes.checkpoints import (
    checkpoint_files,
    load_checkpoint,
)
from lit_spikes.demo.module import TinyGPTModule
from tests.conftest import (
    TINY_DATA,
    TINY_GPT,
    TINY_OPTIM,
    fit,
)
from tests.modules.plain_runs import loader, train
from tests.modules.user_modules import DropoutRegressor


def test_retention_keeps_what_a_rollback_or_resume_needs(tmp_path: Path) -> None:
    optim = replace(TINY_OPTIM, max_steps=30)
    first = fit(tmp_path, "run", 6, checkpoint_every=2, optim=optim)
    directory = first.spec.run_dir / "checkpoints"
    retention = CheckpointRetention(directory, keep_last=2, rollback_distance=5)
    fit(
        tmp_path,
        "run",
        20,
        checkpoint_every=2,
        optim=optim,
        ckpt_path=directory / "step=4.ckpt",
        callbacks=[retention],
    )
    left = sorted(int(p.stem.split("=")[1]) for p in directory.glob("*.ckpt"))
    # resumed-from 4; newest at least 5 behind step 20: 14; within 5 steps: 16, 18, 20
    assert left == [4, 14, 16, 18, 20]
    assert all(load_checkpoint(directory / f"step={s}.ckpt") for s in left)
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointRetention(directory, keep_last=0)


def test_retention_refuses_a_directory_the_run_does_not_write_and_defaults_to_its_own(
    tmp_path: Path,
) -> None:
    """A hand-typed dirpath with a typo deleted another run's files: it is refused before
    any step; left out, it is the run's own checkpoint directory."""
    other = fit(tmp_path, "other", 10, checkpoint_every=2).spec.run_dir / "checkpoints"
    files = sorted(other.iterdir())
    with pytest.raises(ValueError, match=r"dirpath=.*other/checkpoints.*would prune a direct"):
        fit(tmp_path, "run", 10, checkpoint_every=2, callbacks=[CheckpointRetention(other)])
    assert sorted(other.iterdir()) == files  # nothing of the other run's deleted
    retention = CheckpointRetention(keep_last=2, rollback_distance=1)
    run = fit(tmp_path, "own", 10, checkpoint_every=2, callbacks=[retention])
    assert retention.dirpath == (run.spec.run_dir / "checkpoints").resolve()
    assert [s for s, _ in checkpoint_files(retention.dirpath)] == [8, 10]
    with pytest.raises(ValueError, match=r"dirpath=None\) takes the directory .* has 0"):
        fit(tmp_path, "none", 4, callbacks=[CheckpointRetention()])


@pytest.mark.parametrize(
    ("nan_step", "target", "left"), [(None, 14, [14, 16, 18, 20]), (7, 6, [6, 16, 18, 20])]
)
def test_retention_keeps_the_file_a_rollback_from_the_last_step_needs(
    tmp_path: Path, nan_step: int | None, target: int, left: list[int]
) -> None:
    """A spike in the last step trained (19 of 20) rolls back 4 steps: to a file at or
    before step 15 (an even distance once missed it by one); after an update skipped for
    a NaN at step 7, rollbacks refuse every later file, so the one before it must stay."""
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.shared.training import RunSpec
    from tests.conftest import NaNLossModule

    directory = tmp_path / "run" / "checkpoints"
    optim = replace(TINY_OPTIM, max_steps=30)
    module = (
        TinyGPTModule(gpt=TINY_GPT, optim=optim)
        if nan_step is None
        else NaNLossModule(gpt=TINY_GPT, optim=optim, nan_step=nan_step)
    )
    spec = RunSpec(
        tmp_path,
        "run",
        20,
        checkpoint_every=2,
        callbacks=[CheckpointRetention(directory, keep_last=2, rollback_distance=4)],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0},
    )
    skipped = (
        pytest.warns(UserWarning, match=f"non-finite loss at step {nan_step}: its update is")
        if nan_step is not None
        else contextlib.nullcontext()
    )
    with skipped:
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
    rollback = RollbackRestore(directory, spike_step=19, distance=4)
    assert rollback.ckpt_step == target
    assert sorted(int(p.stem.split("=")[1]) for p in directory.glob("*.ckpt")) == left


def test_the_resumed_from_file_is_kept_however_old(tmp_path: Path) -> None:
    """Issue 44's gap (one test): ``keep`` keeps the file a run resumed from, whatever its
    age, alongside the newest and the rollback target; by its resolved path."""
    retention = CheckpointRetention(tmp_path, keep_last=1, rollback_distance=0)
    files = [(s, tmp_path / f"step={s}.ckpt") for s in range(1, 11)]
    kept = retention.keep(files, 10, tmp_path / "." / "step=2.ckpt")
    assert sorted(int(p.stem.split("=")[1]) for p in kept) == [2, 9, 10]
    assert sorted(p.name for p in retention.keep(files, 10, None)) == [
        "step=10.ckpt",
        "step=9.ckpt",
    ]


def test_a_users_run_resumed_from_an_old_file_keeps_it(tmp_path: Path) -> None:
    """A module of the user's kind, a file every step, resumed from step 3 with
    ``keep_last=1``: step 3's file survives every prune of the resumed run."""
    train(tmp_path, DropoutRegressor(), loader(), 6, [ExactResume()])
    retention = CheckpointRetention(tmp_path, keep_last=1, rollback_distance=0)
    resumed = [ExactResume(), retention]
    train(tmp_path, DropoutRegressor(), loader(), 12, resumed, tmp_path / "step=3.ckpt")
    left = sorted(s for s, _ in checkpoint_files(tmp_path))
    assert left == [3, 11, 12], left
