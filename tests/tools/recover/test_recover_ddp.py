"""``lit-spikes recover --devices 2 --strategy ddp``: the recovery loop with every branch
trained by 2 DDP processes (gloo, one thread each). Rank 0 plans and writes; both ranks
train each branch and stop it at the same spike. Interrupted by SIGTERM (a scheduler's
preemption, sent to rank 0 only) and run again, it ends bit-equal to the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from lit_spikes.callbacks.exact_resume import STATE_KEY
from lit_spikes.tools.recover import HISTORY_NAME, Ledger, RecoverConfig, read_history, read_ledger
from tests.conftest import REPO, assert_states_equal, ddp_env, load_ckpt, wait_for
from tests.modules.recover_setup import tiny_config

TIMEOUT_S = 240


def command(tmp_path: Path, name: str) -> tuple[list[str], Path]:
    """The CLI command of the tiny recover run under 2 processes, and its log root."""
    spec = tiny_config(tmp_path / name).to_dict()
    spec.pop("log_root")
    config_file = tmp_path / f"{name}.json"
    config_file.write_text(json.dumps(spec))
    root = tmp_path / name
    argv = [sys.executable, "-m", "lit_spikes.tools.cli", "recover", "--config", str(config_file)]
    return [*argv, "--log_root", str(root), "--devices", "2", "--strategy", "ddp"], root


def steps_written(history: Path) -> list[int]:
    return [int(r["step"]) for r in read_history(history) if "step" in r]


def decisions(ledger: Ledger) -> list[tuple[Any, ...]]:
    return [
        (i.spike["step"], i.ckpt_step, i.tried, i.accepted, i.outcomes)
        for i in ledger.interventions
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    argv, root = command(tmp_path_factory.mktemp("recover_ddp"), "full")
    done = subprocess.run(
        argv, cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return root, done.stdout


def test_config_refuses_a_batch_that_does_not_divide_and_ddp_spawn(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data.batch_size=4 must divide by the world size .* 3"):
        tiny_config(tmp_path, devices=3)
    with pytest.raises(ValueError, match=r"strategy='ddp_spawn' must be 'auto' or 'ddp'"):
        tiny_config(tmp_path, devices=2, strategy="ddp_spawn")
    with pytest.raises(ValueError, match=r"num_nodes=0 must be an integer >= 1"):
        tiny_config(tmp_path, num_nodes=0)
    assert tiny_config(tmp_path, devices=2).trainer_kwargs() == {
        "devices": 2,
        "num_nodes": 1,
        "strategy": "ddp",
    }
    assert RecoverConfig().trainer_kwargs() == {}


@pytest.mark.slow
def test_recover_under_ddp_decides_once_and_trains_on_both_ranks(
    uninterrupted: tuple[Path, str],
) -> None:
    root, stdout = uninterrupted
    ledger = read_ledger(root)
    assert ledger.status == "done" and ledger.config["devices"] == 2
    # The spikes and choices test_recover asserts for the single-process loop (a poisoned
    # batch spikes both shards): rank 0 decided, rank 1 followed.
    first, second = ledger.interventions
    assert (first.spike["step"], first.ckpt_step, second.spike["step"]) == (28, 20, 41)
    assert first.accepted == "spike1/skip_data"
    assert stdout.count("Spike recovery ledger") == 1  # printed by rank 0 alone
    # Every branch's records are the global values of both ranks, written once.
    for branch in ledger.branches:
        steps = [r for r in read_history(root / branch.name / HISTORY_NAME) if "step" in r]
        assert steps and all(len(r["rank_loss"]) == 2 for r in steps), branch.name
        assert len({r["step"] for r in steps}) == len(steps), branch.name
        # each rank trained its own rows: their losses differ
        assert all(r["rank_loss"][0] != r["rank_loss"][1] for r in steps), branch.name
    # The detector judged the same global value the history holds.
    base = {r["step"]: r for r in read_history(root / "base" / HISTORY_NAME) if "step" in r}
    assert base[28]["loss"] == first.spike["value"]
    assert first.spike["rank_values"] == base[28]["rank_loss"]
    final = load_ckpt(ledger.totals.final_ckpt if ledger.totals else "")
    assert final["global_step"] == tiny_config(root).steps
    assert final["callbacks"][STATE_KEY]["fingerprint"]["world_size"] == 2


@pytest.mark.slow
def test_sigterm_to_rank_0_then_the_same_command_ends_bit_equal(
    tmp_path: Path, uninterrupted: tuple[Path, str]
) -> None:
    argv, root = command(tmp_path, "preempted")
    log = tmp_path / "preempted.log"
    child = subprocess.Popen(
        argv,
        cwd=REPO,
        env=ddp_env(),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # rank 1 joins its group: one killpg ends both if it fails
    )
    # Preempted mid-branch: the second remedy, after the first was rejected, has trained
    # a few steps from its step-20 checkpoint (outside a branch a SIGTERM kills at once,
    # like the SIGKILL of test_recover, and the ledger carries on as well).
    history = root / "spike1" / "skip_data" / HISTORY_NAME
    try:
        wait_for(
            child,
            lambda: history.is_file() and len(steps_written(history)) >= 5,
            "the second remedy trained 5 steps",
            TIMEOUT_S,
        )
        child.send_signal(signal.SIGTERM)  # rank 0 only
        child.wait(timeout=TIMEOUT_S)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    assert child.returncode == 128 + signal.SIGTERM, log.read_text()[-4000:]
    stopped = read_ledger(root)
    assert stopped.status == "running" and stopped.events[-1]["event"] == "interrupted"
    saved = Path(stopped.events[-1]["checkpoint"])  # both ranks agreed on the step
    assert saved.is_file() and steps_written(history)[-1] == load_ckpt(saved)["global_step"] - 1
    done = subprocess.run(
        argv, cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    resumed, reference = read_ledger(root), read_ledger(uninterrupted[0])
    assert resumed.sessions == 2 and decisions(resumed) == decisions(reference)
    branch = resumed.branch("spike1/skip_data")
    assert (branch.restarts, branch.steps_repeated) == (1, 0)  # resumed from ``saved``
    assert resumed.totals is not None and reference.totals is not None
    for name in ("lineage", "steps_trained", "steps_recomputed", "batches_skipped", "val"):
        assert getattr(resumed.totals, name) == getattr(reference.totals, name), name
    assert_states_equal(
        load_ckpt(resumed.totals.final_ckpt), load_ckpt(reference.totals.final_ckpt)
    )


@pytest.mark.slow
def test_a_ledger_of_other_arguments_stops_both_ranks_with_rank_0s_error(
    tmp_path: Path, uninterrupted: tuple[Path, str]
) -> None:
    root, _ = uninterrupted
    before = (root / "ledger.json").read_text()
    argv, _ = command(tmp_path, "other")
    argv[argv.index("--log_root") + 1] = str(root)
    argv += ["--accept_margin", "4"]
    done = subprocess.run(
        argv, cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 2, done.stderr[-4000:]  # the parser's error, from rank 0
    assert done.stderr.count("was written with other arguments (accept_margin") == 1
    assert (root / "ledger.json").read_text() == before
