"""The recovery loop (``lit-spikes recover``) on the tiny model with planted bad batches:
detect, roll back to a real checkpoint, try remedies, accept one, train on; its ledger's
counts against the runs it made; interrupted and restarted, it ends bit-equal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback
from rich.console import Console

from lit_spikes.callbacks import RunDirectoryBusy, SpikeDetector
from lit_spikes.callbacks.run_lock import LOCK_NAME
from lit_spikes.checkpoints import load_checkpoint
from lit_spikes.tools.recover import (
    ACCEPTED_RUN,
    HISTORY_NAME,
    BranchRecord,
    RecoverInterrupted,
    RecoverResult,
    RecoveryLoop,
    read_history,
    read_ledger,
    recover,
)
from tests.conftest import (
    tb_marks,
    tb_scalars,
    wait_for,
)
from tests.modules.recover_setup import (
    POISON,
    RUNGS,
    Crash,
    N,
    SignalSelf,
    assert_same_outcome,
    steps_of,
    tiny_config,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> RecoverResult:
    console = Console(record=True, width=200)
    result = recover(tiny_config(tmp_path_factory.mktemp("recover") / "full"), console)
    text = console.export_text()
    for heading in ("Spike recovery ledger", "rejected: spike at step 28", "Accepted lineage"):
        assert heading in text, heading
    return result


@pytest.mark.slow
def test_recover_rolls_back_tries_remedies_accepts_and_finishes(
    uninterrupted: RecoverResult,
) -> None:
    ledger, root = uninterrupted.ledger, Path(uninterrupted.ledger.config["log_root"])
    assert ledger.status == "done"
    first, second = ledger.interventions
    # Each spike is found where the planted batch is trained ...
    assert (first.spike["step"], first.spike["position"], first.spike["branch"]) == (28, 28, "base")
    assert (second.spike["step"], second.spike["position"]) == (41, 47)
    assert second.spike["branch"] == "spike1/skip_data"  # ... the second in the accepted branch
    # ... rolled back to a real checkpoint at least 5 steps before it, in the lineage's runs
    for intervention, owner in ((first, "base"), (second, "spike1/skip_data")):
        assert intervention.ckpt_path == str(
            root / owner / "checkpoints" / f"step={intervention.ckpt_step}.ckpt"
        )
        assert load_checkpoint(intervention.ckpt_path)["global_step"] == intervention.ckpt_step
    assert (first.ckpt_step, second.ckpt_step) == (20, 30)
    # ... where scaling the LR fails (random characters spike at any LR) and skipping works.
    assert first.tried == ["spike1/scale_lr", "spike1/skip_data"]
    assert second.tried == ["spike2/scale_lr", "spike2/skip_data"]
    for intervention in (first, second):
        rejected, accepted = intervention.tried
        assert intervention.outcomes[rejected].startswith(
            f"rejected: spike at step {intervention.spike['step']}"
        )
        assert intervention.outcomes[accepted].startswith("accepted")
        assert (intervention.status, intervention.accepted) == ("accepted", accepted)
        for name in intervention.tried:  # every branch resumed from that very file
            records = steps_of(read_history(root / name / HISTORY_NAME))
            assert records[0]["step"] == intervention.ckpt_step
            first_line = (root / name / HISTORY_NAME).read_text().splitlines()[0]
            assert first_line == '{"history_version": 3}'  # its format, first
            assert ledger.branch(name).ckpt_path == intervention.ckpt_path
    assert ledger.branch("spike2/skip_data").remedies == [
        {"class_path": RUNGS["skip_data"], "init_args": {"ranges": [[26, 32]]}},  # stays on
        {"class_path": RUNGS["skip_data"], "init_args": {"ranges": [[45, 51]]}},
    ]
    # The finished run: every step once, no spike left, no planted batch trained on.
    totals = ledger.totals
    assert totals is not None
    assert totals.lineage == ["base", "spike1/skip_data", "spike2/skip_data"]
    assert totals.unrecovered == []
    lineage = steps_of(uninterrupted.lineage)
    assert [r["step"] for r in lineage] == list(range(N))
    positions = [int(r["position"]) for r in lineage]
    assert not set(positions) & {*POISON, *range(26, 32), *range(45, 51)}
    detector = SpikeDetector(min_step=4, ratio=1.4)
    for record in lineage:
        detector.check(int(record["step"]), record)
    assert list(detector.spikes) == []  # a deque
    final = load_checkpoint(uninterrupted.final_ckpt)
    assert final["global_step"] == N
    assert uninterrupted.final_ckpt == root / "spike2/skip_data/checkpoints" / f"step={N}.ckpt"
    # The ledger's counts are those of the runs it made.
    main = [b for b in ledger.branches if b.kind != "compare"]
    trained = {b.name: len(steps_of(read_history(root / b.name / HISTORY_NAME))) for b in main}
    assert {b.name: b.steps_trained for b in main} == trained
    assert trained == {
        "base": 29,  # steps 0-28, stopped at the spike
        "spike1/scale_lr": 9,  # 20-28
        "spike1/skip_data": 22,  # 20-41
        "spike2/scale_lr": 12,  # 30-41
        "spike2/skip_data": 30,  # 30-59
    }
    assert totals.steps_trained == sum(trained.values()) == 102
    assert totals.steps_final == N
    assert totals.steps_recomputed == totals.steps_trained - N == 42
    assert totals.steps_recomputed == sum(
        i.steps_rolled_back + sum(ledger.branch(n).steps_trained for n in i.tried[:-1])
        for i in ledger.interventions
    )
    assert totals.batches_skipped == positions[-1] - (N - 1) == 12
    assert ledger.branch("spike1/skip_data").batches_skipped == 6
    assert totals.steps_repeated == 0 and ledger.sessions == 1
    assert read_ledger(root).to_dict() == ledger.to_dict()  # the file is the whole story


@pytest.mark.slow
def test_tensorboard_has_every_branch_and_the_stitched_lineage(
    uninterrupted: RecoverResult,
) -> None:
    root = Path(uninterrupted.ledger.config["log_root"])
    runs = sorted(str(p.parent.relative_to(root)) for p in root.glob("**/events.out.tfevents.*"))
    # A branch that flagged a spike has its marks in one-point runs under it (SpikeMarks:
    # spikes/step_<k>) on the loss's own tag, drawn on that branch's loss chart.
    marked = sorted({run.split("/spikes/")[0] for run in runs if "/spikes/step_" in run})
    assert [run for run in runs if "/spikes/" not in run] == [
        ACCEPTED_RUN,
        "base",
        "spike1/scale_lr",
        "spike1/skip_data",
        "spike2/scale_lr",
        "spike2/skip_data",
    ]
    assert marked == ["base", "spike1/scale_lr", "spike1/skip_data", "spike2/scale_lr"]
    for name in marked:
        assert tb_marks(root / name).get("train/loss"), name
    starts = {"base": 0, "spike1/scale_lr": 20, "spike1/skip_data": 20, "spike2/scale_lr": 30}
    for name, first in starts.items():  # each on the shared step axis, from its checkpoint
        assert tb_scalars(root / name)["train/loss"][0][0] == first, name
    stitched = tb_scalars(root / ACCEPTED_RUN)
    lineage = steps_of(uninterrupted.lineage)
    assert stitched["train/loss"] == [(r["step"], r["loss"]) for r in lineage]  # float32 both
    assert [s for s, _ in stitched["data/position"]] == list(range(N))
    assert [s for s, _ in stitched["val/bpc"]] == [19, 39, 59]
    assert stitched["val/bpc"][-1][1] == pytest.approx(uninterrupted.val, rel=1e-6)


@pytest.mark.slow
def test_a_crash_mid_branch_continues_from_the_ledger(
    tmp_path: Path, uninterrupted: RecoverResult
) -> None:
    config = tiny_config(tmp_path / "crash")

    def crash(record: BranchRecord) -> list[Callback]:
        return [Crash(45)] if record.name == "spike2/skip_data" else []

    with pytest.raises(RuntimeError, match="injected crash at step 45"):
        recover(config, extra_callbacks=crash)
    ledger = read_ledger(config.log_root)
    assert ledger.status == "running"
    assert ledger.branch("spike2/skip_data").status == "running"
    assert ledger.interventions[1].status == "open"  # it would be accepted at step 46
    result = recover(config)  # the same arguments: continue
    assert_same_outcome(result, uninterrupted)
    ledger = result.ledger
    assert ledger.sessions == 2
    branch = ledger.branch("spike2/skip_data")
    assert branch.restarts == 1 and branch.steps_repeated == 5  # steps 40-44, from step=40
    starts = [
        (e["event"], e.get("branch"), e.get("from_step"))
        for e in ledger.events
        if e["event"] in ("branch_start", "branch_resume")
    ]
    assert starts[-1] == ("branch_resume", "spike2/skip_data", 40)
    assert len(starts) == 6  # five branches started once, one resumed: nothing else re-ran


@pytest.mark.slow
def test_sigkill_at_a_random_point_of_the_cli_and_restart_ends_bit_equal(
    tmp_path: Path, uninterrupted: RecoverResult
) -> None:
    config = tiny_config(tmp_path / "killed")
    spec = config.to_dict()
    spec.pop("log_root")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lit_spikes.tools.cli", "recover"]
    command += ["--config", str(config_file), "--log_root", str(config.log_root)]
    child = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ledger_file = config.log_root / "ledger.json"
    try:  # kill once the first remedy has been rejected
        wait_for(
            child,
            lambda: ledger_file.is_file() and '"event": "rejected"' in ledger_file.read_text(),
            "the first remedy was rejected",
            120,
        )
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    killed = read_ledger(config.log_root)
    assert killed.status == "running"
    result = recover(config)
    assert result.ledger.sessions == 2
    assert_same_outcome(result, uninterrupted)


@pytest.mark.slow
def test_a_signal_in_the_step_that_spikes_still_rolls_back(
    tmp_path: Path, uninterrupted: RecoverResult
) -> None:
    """SIGTERM during step 28, the one that spikes: the branch checkpoints step 29 and
    stops before the ledger hears of the spike. Run again, it must not go on from step
    29 as if nothing happened (the restored detector holds the spike): it is spiked."""
    config = tiny_config(tmp_path / "term")

    def send(record: BranchRecord) -> list[Callback]:
        return [SignalSelf(28, signal.SIGTERM)] if record.name == "base" else []

    with pytest.raises(RecoverInterrupted):
        recover(config, extra_callbacks=send)
    base = read_ledger(config.log_root).branch("base")
    assert (base.status, base.spike) == ("running", None)
    result = recover(config)  # the same arguments: continue
    assert_same_outcome(result, uninterrupted)
    assert result.ledger.branch("base").spike == uninterrupted.ledger.branch("base").spike


def _signalled_worker(log_root: str, signal_name: str) -> None:
    """Body of ``python -m tests.tools.recover.test_recover <log_root> <SIGNAL>``: ``lit-spikes
    recover`` on the tiny config, sent the signal at step 35 of its third branch (after that
    branch's step-30 checkpoint and its acceptance at step 33). SIGKILL: no handler, no cleanup,
    no last ledger write, as when a node dies. SIGINT (Ctrl-C): the branch writes a checkpoint,
    the command exits with 130."""
    import functools

    import lit_spikes.tools.recover.cli as recover_cli

    signum = signal.Signals[signal_name]

    def send(record: BranchRecord) -> list[Callback]:
        return [SignalSelf(35, signum)] if record.name == "spike1/skip_data" else []

    config = tiny_config(Path(log_root))
    spec = config.to_dict()
    spec.pop("log_root")
    config_file = Path(log_root).with_suffix(".json")
    config_file.write_text(json.dumps(spec))
    # main calls the recover its own module imported
    recover_cli.recover = functools.partial(recover_cli.recover, extra_callbacks=send)
    recover_cli.main(["--config", str(config_file), "--log_root", log_root])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signal_name", "returncode", "resume_step"),
    [("SIGKILL", -signal.SIGKILL, 30), ("SIGINT", 128 + signal.SIGINT, 36)],
)
def test_a_signal_mid_branch_resumes_it_from_its_own_checkpoint(
    tmp_path: Path,
    uninterrupted: RecoverResult,
    signal_name: str,
    returncode: int,
    resume_step: int,
) -> None:
    config = tiny_config(tmp_path / signal_name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "tests.tools.recover.test_recover",
        str(config.log_root),
        signal_name,
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert done.returncode == returncode, done.stderr.decode()[-2000:]
    killed = read_ledger(config.log_root)
    branch = killed.branch("spike1/skip_data")
    assert (branch.status, branch.accepted_at) == ("running", 33)
    history = steps_of(read_history(config.log_root / branch.name / HISTORY_NAME))
    assert [r["step"] for r in history] == list(range(20, 36 if signal_name == "SIGINT" else 35))
    if signal_name == "SIGINT":  # Ctrl-C: the step-36 checkpoint is written, then the exit
        assert killed.events[-1]["event"] == "interrupted"
        assert (config.log_root / branch.name / "checkpoints" / "step=36.ckpt").is_file()
        # one line of words: the console wraps at 160 columns, and xdist's paths are longer
        output = " ".join((done.stdout + done.stderr).decode().split())
        assert "run the same command to continue" in output
        assert "--ckpt_path" not in output  # recover goes on from its ledger, by itself
    result = recover(config)  # the same arguments: continue
    assert_same_outcome(result, uninterrupted)
    branch = result.ledger.branch("spike1/skip_data")
    repeated = 35 - resume_step if signal_name == "SIGKILL" else 0  # SIGINT loses nothing
    assert (branch.restarts, branch.steps_repeated, branch.steps_trained) == (1, repeated, 22)
    resumed = [e for e in result.ledger.events if e["event"] == "branch_resume"]
    assert [(e["branch"], e["from_step"]) for e in resumed] == [("spike1/skip_data", resume_step)]


def test_a_second_recover_into_a_busy_log_root_stops_before_touching_it(
    tmp_path: Path, directory_holder: Any
) -> None:
    """Another recover there could be mid-branch: this one must not read, restart (delete)
    or write anything of it; the console command exits 75 (EX_TEMPFAIL: retry later)."""
    config = tiny_config(tmp_path / "busy")
    holder = directory_holder(config.log_root)
    with pytest.raises(RunDirectoryBusy, match=rf"\(pid {holder.pid} on "):
        recover(config)
    with pytest.raises(RunDirectoryBusy):
        recover(config, fresh=True)
    assert sorted(p.name for p in config.log_root.iterdir()) == [LOCK_NAME]


def test_restart_with_other_arguments_is_refused(
    tmp_path: Path, uninterrupted: RecoverResult
) -> None:
    root = Path(uninterrupted.ledger.config["log_root"])
    before = (root / "ledger.json").read_text()
    with pytest.raises(
        ValueError, match=r"ladder: ledger .*'factor': 0.5.*'factor': 0.25.*--fresh"
    ):
        RecoveryLoop(tiny_config(root, rung_options={"lr_factor": 0.25}))
    assert (root / "ledger.json").read_text() == before


if __name__ == "__main__":
    _signalled_worker(sys.argv[1], sys.argv[2])


@pytest.mark.slow
def test_a_ledger_of_a_relative_log_root_goes_on_from_another_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: RecoverResult
) -> None:
    """The checkpoints a ledger names are found wherever the command runs from."""
    (tmp_path / "job").mkdir()
    monkeypatch.chdir(tmp_path / "job")
    crash = lambda record: [Crash(22)] if record.name == "spike1/skip_data" else []  # noqa: E731
    with pytest.raises(RuntimeError, match="injected crash at step 22"):
        recover(tiny_config(Path("root")), extra_callbacks=crash)
    monkeypatch.chdir(tmp_path)  # the same log root, named from its parent now
    assert_same_outcome(recover(tiny_config(Path("job/root"))), uninterrupted)


class SignalAtTheEnd(Callback):
    """SIGTERM to its own process in the last step of the first branch it runs in."""

    fired = False

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if not SignalAtTheEnd.fired and trainer.global_step == trainer.max_steps:
            SignalAtTheEnd.fired = True
            signal.raise_signal(signal.SIGTERM)


@pytest.mark.slow
def test_a_signal_in_a_branchs_last_step_stops_the_loop_after_concluding_it(
    tmp_path: Path, uninterrupted: RecoverResult
) -> None:
    """Not a loop that goes on planning and training branches until the scheduler's
    SIGKILL: the branch is complete, then the loop stops; the same command goes on."""
    config = tiny_config(tmp_path / "root")
    SignalAtTheEnd.fired = False
    with pytest.raises(RecoverInterrupted):
        recover(config, extra_callbacks=lambda record: [SignalAtTheEnd()])
    events = read_ledger(config.log_root).events
    assert [e["event"] for e in events][-1] == "interrupted"
    assert events[-1]["checkpoint"] is None  # nothing of the preemption's: the run was done
    assert_same_outcome(recover(config), uninterrupted)
