"""recover's runs in TensorBoard share one naming (issue 65): the base run, each branch,
the do-nothing comparison and the accepted (stitched) run log the module's own tags, with
``lr``, ``grad_norm`` and the spike marks of each, so one chart compares them. Run through
the command line on a module written for the tests, which logs ``train_loss`` and
``val_loss``."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from lit_spikes.callbacks import Spike
from lit_spikes.callbacks.spike_marks import mark_run
from lit_spikes.tools.cli import main
from lit_spikes.tools.recover import read_ledger, write_stitched_run
from lit_spikes.tools.recover.outcome import ACCEPTED_RUN
from tests.conftest import tb_marks, tb_scalars

SHARED = {"train_loss", "lr", "grad_norm", "val_loss"}
"""The tags every run of the loop logs (the module's two, and lit-spikes' two)."""


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``lit-spikes recover`` on ``ChartedConv`` with batch 35 poisoned: the base run
    spikes, skipping data is accepted, doing nothing is compared."""
    root = tmp_path_factory.mktemp("recover_tb")
    argv = ["recover", "--model", "tests.modules.tb_modules.ChartedConv", "--data"]
    argv += ["tests.modules.spiky_modules.ValidatedRegressionData"]
    argv += ["--data.init_args.poison", "[35]", "--max_steps", "60", "--checkpoint_every"]
    argv += ["10", "--val_every", "20", "--detector.ratio", "3", "--detector.window", "10"]
    argv += ["--rollback_distance", "5", "--accept_margin", "5", "--compare", "true"]
    main([*argv, "--log_root", str(root)])
    return root


def test_every_run_of_the_loop_logs_the_same_tags(recovered: Path) -> None:
    """Base, branch, do-nothing and accepted runs: the module's ``train_loss`` and
    ``val_loss``, ``lr`` and ``grad_norm``; no run names the loss otherwise (the accepted
    run logged ``train/loss``, the branches no ``lr`` or ``grad_norm``)."""
    ledger = read_ledger(recovered)
    names = [b.name for b in ledger.branches]
    assert names == ["base", "spike1/skip_data", "compare/do_nothing"]
    assert all(b.charts == {"loss": "train_loss"} for b in ledger.branches)
    for name in [*names, ACCEPTED_RUN]:
        tags = set(tb_scalars(recovered / name))
        assert tags >= SHARED, (name, tags)
        assert not tags & {"loss", "train/loss"}, (name, tags)


def test_the_accepted_run_draws_the_same_values_as_its_branches(recovered: Path) -> None:
    """On the steps the base run trained for the accepted lineage (0-29), the accepted
    run's ``train_loss``, ``lr`` and ``grad_norm`` are the base run's, point for point: the
    same curves on one chart."""
    base, accepted = tb_scalars(recovered / "base"), tb_scalars(recovered / ACCEPTED_RUN)
    for tag in ("train_loss", "lr", "grad_norm"):
        assert accepted[tag][:30] == base[tag][:30], tag
    assert [step for step, _ in accepted["train_loss"]] == list(range(60))


def test_each_run_that_flagged_the_spike_marks_it_on_its_loss_chart(recovered: Path) -> None:
    """The base run and doing nothing both flag batch 35: each marks it once, at its
    reference (the mean of its 10 values before); the accepted lineage never met it: no
    mark."""
    curve = dict(tb_scalars(recovered / "base")["train_loss"])  # do-nothing resumes it
    level = statistics.fmean(curve[k] for k in range(25, 35))  # the window's mean
    for name in ("base", "compare/do_nothing"):
        assert tb_marks(recovered / name) == {"train_loss": [(35, float(np.float32(level)))]}
    assert not (recovered / ACCEPTED_RUN / "spikes").exists()


def test_the_stitched_run_marks_each_episode_at_its_reference(tmp_path: Path) -> None:
    """An unrecovered episode of three flags (steps 5-7) and one at 30: the stitched run
    marks each onset once, under the branches' chart of the loss, at its reference."""
    records = [{"step": k, "loss": 1.0 + k / 100, "lr": 0.1, "position": k} for k in range(40)]
    spikes = [Spike(k, "loss", 9.0, 1.0 + k / 1000) for k in (5, 6, 7, 30)]
    write_stitched_run(tmp_path / "run", records, spikes, charts={"loss": "train_loss"})
    expected = [(k, float(np.float32(1.0 + k / 1000))) for k in (5, 30)]
    assert tb_marks(tmp_path / "run") == {"train_loss": expected}
    assert sorted(p.name for p in (tmp_path / "run" / "spikes").iterdir()) == [
        Path(mark_run(k)).name for k in (30, 5)
    ]
    assert [s for s, _ in tb_scalars(tmp_path / "run")["train_loss"]] == list(range(40))
    assert not math.isnan(tb_scalars(tmp_path / "run")["lr"][0][1])
