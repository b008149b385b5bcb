"""The recovery loop's rungs and rows one at a time on the tiny model: skip-step, rollback
targets, skip windows, a ladder that gives up, the comparison rows, the default config."""

from __future__ import annotations

import shutil
import signal
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from lit_spikes.checkpoints import load_checkpoint
from lit_spikes.tools.recover import (
    HISTORY_NAME,
    BranchRecord,
    RecoverConfig,
    RecoverInterrupted,
    RecoverResult,
    RecoveryLoop,
    read_history,
    recover,
)
from tests.conftest import (
    TINY_DATA,
    TINY_OPTIM,
)
from tests.modules.recover_setup import (
    SKIP_LENGTH,
    SignalSelf,
    assert_same_outcome,
    steps_of,
    tiny_config,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_skip_step_absorbs_a_bad_batch(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path / "skip_step",
        optim=replace(TINY_OPTIM, max_steps=40, warmup_steps=4),
        data=replace(TINY_DATA, poison=(28,)),
        names=("skip_step",),
        rung_options={"skip_step_window": 10},
    )
    result = recover(config)
    (intervention,) = result.ledger.interventions
    assert intervention.accepted == "spike1/skip_step"
    branch = result.ledger.branch("spike1/skip_step")
    assert branch.skip_stepped == [28]
    assert [s["step"] for s in branch.absorbed] == [28]  # flagged, but never in the weights
    totals = result.ledger.totals
    assert totals is not None
    assert totals.skip_stepped == [28] and totals.unrecovered == []
    assert totals.batches_skipped == 0
    assert 28 in [r["position"] for r in steps_of(result.lineage)]


def test_a_rollback_past_a_refused_file_passes_over_a_ctrl_c_file_too(tmp_path: Path) -> None:
    """Rollback targets are scheduled files, so that an interrupted loop decides as the
    uninterrupted one: when the scheduled file is refused (broken), the next one back
    must be scheduled too, not the extra file a Ctrl-C wrote between them."""
    from lit_spikes.tools.recover.rollback import choose_rollback
    from tests.conftest import fit

    source = fit(tmp_path, "source", 20, checkpoint_every=1).spec.run_dir / "checkpoints"
    loop = RecoveryLoop(tiny_config(tmp_path / "loop", checkpoint_every=10, rollback_distance=5))
    try:
        base = BranchRecord(name="base", kind="base", start_step=0, ckpt_path=None, parent=None)
        loop.ledger.branches.append(base)
        directory = tmp_path / "loop" / "base" / "checkpoints"
        directory.mkdir(parents=True)
        for step in (10, 13, 20):  # scheduled, a Ctrl-C's, scheduled
            shutil.copy(source / f"step={step}.ckpt", directory / f"step={step}.ckpt")
        broken = directory / "step=20.ckpt"
        broken.write_bytes(broken.read_bytes()[:1000])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step, path, owner, refused = choose_rollback(
                loop.ledger, loop.root, base, onset=27, distance=5, every=10
            )
        assert (step, owner) == (10, "base") and path == str(directory / "step=10.ckpt")
        assert any("step=20.ckpt" in reason for reason in refused)
    finally:
        loop.close()


def test_a_skip_window_from_the_branchs_first_step_counts_its_batches(tmp_path: Path) -> None:
    """A spike close after the checkpoint clamps the skip window to the checkpoint's own
    position: the branch's first step already trains past it, and the skipped batches
    still count (they read 0)."""
    config = tiny_config(
        tmp_path / "clamped",
        optim=replace(TINY_OPTIM, max_steps=40, warmup_steps=4),
        data=replace(TINY_DATA, poison=(28,)),
        checkpoint_every=4,
        rollback_distance=1,  # step=24.ckpt, 4 steps before the spike
        names=("skip_data",),
        rung_options={"skip_before": 5},  # from position 23: clamped to the checkpoint's 24
    )
    result = recover(config)
    (intervention,) = result.ledger.interventions
    assert intervention.accepted == "spike1/skip_data"
    branch = result.ledger.branch("spike1/skip_data")
    assert branch.start_step == 24
    first = steps_of(read_history(tmp_path / "clamped" / branch.name / HISTORY_NAME))[0]
    assert (first["step"], first["position"]) == (24, 24 + SKIP_LENGTH)
    assert branch.batches_skipped == SKIP_LENGTH
    totals = result.ledger.totals
    assert totals is not None and totals.batches_skipped == SKIP_LENGTH


@pytest.mark.slow
def test_an_exhausted_ladder_gives_up_and_trains_on(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path / "give_up",
        optim=replace(TINY_OPTIM, max_steps=40, warmup_steps=4),
        data=replace(TINY_DATA, poison=(28,)),
        names=("clip",),  # clipping cannot make random characters predictable
    )
    result = recover(config)
    (intervention,) = result.ledger.interventions
    assert intervention.status == "gave_up"
    assert intervention.reason == "every remedy of the ladder spiked"
    assert intervention.outcomes["spike1/clip"].startswith("rejected: spike at step 28")
    cont = result.ledger.branch("spike1/continue")
    assert (cont.kind, cont.gate, cont.start_step, cont.parent) == ("continue", "log", 20, "base")
    totals = result.ledger.totals
    assert totals is not None
    assert totals.lineage == ["base", "spike1/continue"]
    assert [s["step"] for s in totals.unrecovered] == [28]
    assert totals.steps_trained == 29 + 9 + 20 and totals.steps_recomputed == 18
    assert load_checkpoint(result.final_ckpt)["global_step"] == 40


@pytest.mark.slow
def test_comparison_rows_do_nothing_and_qk_norm(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path / "compare",
        optim=replace(TINY_OPTIM, max_steps=40, warmup_steps=4),
        data=replace(TINY_DATA, poison=(28,)),
        names=("skip_data",),
        compare=True,
    )
    console = Console(record=True, width=200)
    result = recover(config, console)
    printed = " ".join(console.export_text().split())
    assert "What the loop bought" in printed
    rows = {row["run"]: row for row in result.ledger.comparison}
    recovered = rows["recovered (accepted lineage)"]
    nothing = rows["do nothing (continue through the spike)"]
    qk = rows["QK-norm at the same LR (from scratch)"]
    assert (recovered["spikes"], nothing["spikes"]) == (0, 1)  # the planted batch, once
    assert recovered["cells"][0] == ["val bits/char", result.val, 3]  # the module's metric
    # One measure of every row, named under the table: the last validation all rows ran
    assert all(row["measure"] == row["cells"][0][1] for row in rows.values())
    assert "compared by val/bpc at step 40 (the last validation of every run)" in printed
    assert all(row["cells"][0][1] is not None for row in (nothing, qk))
    assert not any("val_bpc" in row or "max_logit_after" in row for row in rows.values())
    do_nothing = result.ledger.branch("compare/do_nothing")
    assert (do_nothing.parent, do_nothing.start_step, do_nothing.gate) == ("base", 20, "log")
    qk_branch = result.ledger.branch("compare/qk_norm")
    assert (qk_branch.parent, qk_branch.model_changes) == (None, {"gpt": {"qk_norm": True}})
    final = load_checkpoint(config.log_root / "compare/qk_norm/checkpoints/step=40.ckpt")
    assert final["hyper_parameters"]["gpt"]["qk_norm"] is True
    assert result.ledger.totals is not None
    assert result.ledger.totals.lineage == ["base", "spike1/skip_data"]  # rows stay out of it


@pytest.mark.slow
def test_recover_on_the_default_reference_config(tmp_path: Path) -> None:
    """The issue's end-to-end claim at full size: the default run's spike is found, the loop
    rolls back to a real checkpoint, accepts a remedy, ends with no unrecovered spike and
    better validation bits/char than doing nothing; the ledger's counts are its runs'.
    How much better depends on the CPU (its kernels round differently, and the remedy
    that wins differs): 0.714 against 1.083 on AMD EPYC, 1.395 against 1.421 on Intel."""
    # The do-nothing row only: the QK-norm row (a whole run more) has its own test above.
    result = recover(RecoverConfig(log_root=tmp_path / "recover", compare="do_nothing"))
    ledger, root = result.ledger, tmp_path / "recover"
    assert ledger.status == "done" and ledger.totals is not None
    (intervention,) = ledger.interventions
    assert intervention.spike["branch"] == "base" and intervention.spike["step"] > 100
    assert load_checkpoint(intervention.ckpt_path)["global_step"] == intervention.ckpt_step
    assert intervention.ckpt_step <= intervention.spike["step"] - 20
    assert intervention.status == "accepted" and intervention.accepted in intervention.tried
    assert ledger.totals.unrecovered == []
    lineage = steps_of(result.lineage)
    assert [r["step"] for r in lineage] == list(range(400))
    rows = {row["run"]: row for row in ledger.comparison}
    assert "QK-norm at the same LR (from scratch)" not in rows
    assert not any(b.name == "compare/qk_norm" for b in ledger.branches)
    assert result.val is not None
    assert result.val < rows["do nothing (continue through the spike)"]["cells"][0][1]
    main = [b for b in ledger.branches if b.kind != "compare"]
    trained = {b.name: len(steps_of(read_history(root / b.name / HISTORY_NAME))) for b in main}
    assert ledger.totals.steps_trained == sum(trained.values())
    assert ledger.totals.steps_recomputed == ledger.totals.steps_trained - 400
    assert ledger.totals.batches_skipped == int(lineage[-1]["position"]) - 399


@pytest.mark.slow
def test_branches_that_give_up_or_compare_start_where_the_uninterrupted_loop_starts_them(
    tmp_path: Path,
) -> None:
    """A Ctrl-C's checkpoint (off the schedule) in the base run is never where a later
    'continue' or 'do nothing' branch starts: the loop decides as the uninterrupted one."""

    def config(name: str) -> RecoverConfig:
        return tiny_config(
            tmp_path / name,
            optim=replace(TINY_OPTIM, max_steps=40, warmup_steps=4),
            data=replace(TINY_DATA, poison=(28,)),
            names=("clip",),
            compare=True,
        )

    straight = recover(config("straight"))
    signal_at_24 = lambda record: [SignalSelf(24, signal.SIGTERM)] if record.name == "base" else []  # noqa: E731
    with pytest.raises(RecoverInterrupted):
        recover(config("interrupted"), extra_callbacks=signal_at_24)
    assert (tmp_path / "interrupted" / "base" / "checkpoints" / "step=25.ckpt").is_file()
    resumed = recover(config("interrupted"))

    def starts(result: RecoverResult) -> list[tuple[str, int]]:
        return [(b.name, b.start_step) for b in result.ledger.branches if b.name != "base"]

    assert starts(resumed) == starts(straight)
    assert any(kind == "compare" for kind in (b.kind for b in straight.ledger.branches))
    assert_same_outcome(resumed, straight)
