"""``RollbackRestore``: it picks the newest valid checkpoint before the spike, resumes from
it (with a StepLoader too), and refuses a checkpoint beyond the run or too long a rollback."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_spikes.callbacks import (
    ExactResume,
    RollbackRestore,
)
from lit_spikes.shared.training import checkpoint_path
from lit_spikes.tools.cli import main as cli_main
from tests.conftest import (
    TINY_CLI,
    assert_states_equal,
    fit,
    load_ckpt,
)
from tests.modules.plain_runs import loader, train, trainer
from tests.modules.user_modules import (
    LoggingRegressor,
)


def test_a_rollback_with_a_step_loader_resumes_the_earlier_file(tmp_path: Path) -> None:
    whole = train(tmp_path / "a", LoggingRegressor(), loader(), 12, [ExactResume()])
    rollback = RollbackRestore(tmp_path / "a", spike_step=9, distance=3)
    run = trainer(tmp_path / "b", 12, [rollback, ExactResume()])
    module = LoggingRegressor()
    rollback.fit(run, module, train_dataloaders=loader())
    assert rollback.ckpt_step == 6
    assert module.losses == whole.lightning_module.losses[6:]  # the same batches again


N, K, EVERY = 20, 10, 5


def test_rollback_picks_newest_checkpoint_before_the_spike_and_skips_corrupt(
    tmp_path: Path,
) -> None:
    reference = fit(tmp_path, "ref", N, checkpoint_every=EVERY)
    ckpt_dir = reference.spec.run_dir / "checkpoints"
    assert RollbackRestore(ckpt_dir, spike_step=17, distance=2).ckpt_step == 15
    assert RollbackRestore(ckpt_dir, spike_step=17, distance=3).ckpt_step == 10
    (ckpt_dir / "step=10.ckpt").write_bytes(b"")  # an interrupted save
    truncated = (ckpt_dir / "step=5.ckpt").read_bytes()
    rollback = RollbackRestore(ckpt_dir, spike_step=17, distance=3)
    with pytest.warns(UserWarning, match=r"step=10.ckpt: the file is empty"):
        assert rollback.ckpt_step == 5
    assert len(rollback.refused) == 1
    (ckpt_dir / "step=5.ckpt").write_bytes(truncated[: len(truncated) // 2])
    with pytest.warns(UserWarning), pytest.raises(FileNotFoundError, match="no valid checkpoint"):
        _ = RollbackRestore(ckpt_dir, spike_step=17, distance=3).ckpt_path


def test_rollback_restore_resumes_from_the_chosen_checkpoint(tmp_path: Path) -> None:
    reference = fit(tmp_path, "ref", N, checkpoint_every=EVERY)
    rollback = RollbackRestore(reference.spec.run_dir / "checkpoints", spike_step=13, distance=3)
    branch = fit(
        tmp_path,
        "branch",
        N,
        ckpt_path=rollback.ckpt_path,
        callbacks=[rollback],
        checkpoint_every=EVERY,
    )
    assert min(branch.losses) == 10
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(branch.spec.run_dir, N)),
    )
    with pytest.raises(ValueError, match="RollbackRestore chose"):
        fit(tmp_path, "wrong", N, callbacks=[rollback])
    # Preempted at step 15 and rerun from its own file with the same callbacks (as the
    # README's example would be), the branch goes on: the same as the one never stopped.
    first = RollbackRestore(reference.spec.run_dir / "checkpoints", spike_step=13, distance=3)
    stopped = fit(
        tmp_path,
        "stopped",
        15,
        ckpt_path=first.ckpt_path,
        callbacks=[first],
        checkpoint_every=EVERY,
    )
    again = RollbackRestore(reference.spec.run_dir / "checkpoints", spike_step=13, distance=3)
    own_file = checkpoint_path(stopped.spec.run_dir, 15)
    fit(tmp_path, "stopped", N, ckpt_path=own_file, callbacks=[again], checkpoint_every=EVERY)
    assert again.ckpt_step == 10  # the rollback it continues, not chosen again
    final = load_ckpt(checkpoint_path(stopped.spec.run_dir, N))
    assert final["callbacks"][again.state_key]["ckpt_step"] == 10
    assert_states_equal(load_ckpt(checkpoint_path(branch.spec.run_dir, N)), final)


def test_checkpoint_beyond_the_run_and_too_long_rollback_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = fit(tmp_path, "ref", N, checkpoint_every=EVERY)
    root = tmp_path / "again"
    with pytest.raises(SystemExit):
        cli_main(
            [
                "fit",
                *TINY_CLI,
                "--trainer.default_root_dir",
                str(root),
                "--trainer.max_steps",
                "15",
                "--ckpt_path",
                str(checkpoint_path(reference.spec.run_dir, N)),
            ]
        )
    assert "is at step 20, not before --trainer.max_steps=15" in capsys.readouterr().err
    assert not root.exists()
    with pytest.raises(ValueError, match="distance=30 reaches back past step 0"):
        RollbackRestore(reference.spec.run_dir / "checkpoints", spike_step=12, distance=30)
