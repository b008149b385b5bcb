"""BranchRunner: branches trained here and in worker processes, started as the
checkpoints they need appear, each computing exactly what it computes alone; a dead
worker named, an error stopping the workers' branches, no orphan left training."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_spikes.demo.branches import Branch, BranchInterrupted, BranchRunner, _ready, run_branch
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import TINY_DATA, TINY_GPT, TINY_OPTIM

N, K = 12, 6


def tiny_branch(name: str, ckpt_path: Path | None = None, **changes: Any) -> Branch:
    settings: dict[str, Any] = {"val_every": None, "trainer_kwargs": {"limit_val_batches": 0}}
    return Branch(
        name,
        N,
        ckpt_path=ckpt_path,
        gpt=TINY_GPT,
        optim=TINY_OPTIM,
        data=TINY_DATA,
        model_seed=0,
        **(settings | changes),
    )


class SlowInAWorker(Callback):
    """Sleeps ``seconds`` at a branch's first step in any process but ``main_pid``."""

    def __init__(self, main_pid: int, seconds: float) -> None:
        self.main_pid, self.seconds = main_pid, seconds

    def on_train_start(self, trainer: Any, *args: Any) -> None:
        if os.getpid() != self.main_pid:
            time.sleep(self.seconds)


@pytest.mark.slow
def test_runner_trains_every_branch_once_and_each_as_alone(tmp_path: Path) -> None:
    root = tmp_path / "runner"
    ckpt = checkpoint_path(root / "reference", K)
    slow = SlowInAWorker(os.getpid(), 3.0)  # the worker still on its first when the reference ends
    children = [tiny_branch(f"child{i}", ckpt, callbacks=[slow]) for i in range(3)]
    reports: list[tuple[str, str, Any]] = []

    def on_report(kind: str, name: str, payload: Any) -> None:
        reports.append((kind, name, payload))
        if (kind, payload) == ("checkpoint", K):
            for child in children:  # one worker: this process takes those waiting
                runner.submit(child)

    with BranchRunner(root, workers=1) as runner:
        runner._starter.join()  # the worker is up: it takes the first child at once
        reference = runner.run_here(tiny_branch("reference", checkpoint_every=K), on_report)
        events = list(runner.events())
    assert ("checkpoint", "reference", K) in reports
    done = [name for kind, name, _ in events if kind == "done"]
    assert sorted(done) == [c.name for c in children]  # each once
    assert set(runner.results) == {"reference", *done}
    # The worker is busy with the first child: this process takes the next one at least.
    here = [runner.results[c.name].pid == os.getpid() for c in children]
    assert here[:2] == [False, True], here
    alone_root = tmp_path / "alone"
    alone = run_branch(tiny_branch("reference", checkpoint_every=K), alone_root, progress_bar=False)
    for key, value in alone.state.items():
        assert torch.equal(value, reference.state[key]), f"reference: {key}"
    for child in children:
        solo = run_branch(
            tiny_branch(child.name, checkpoint_path(alone_root / "reference", K)),
            alone_root,
            progress_bar=False,
        )
        got = runner.results[child.name]
        assert got.losses() == solo.losses(), child.name
        for key, value in solo.state.items():
            assert torch.equal(value, got.state[key]), f"{child.name}: {key}"


def test_checkpoint_is_reported_once_when_written_before_that_steps_validation(
    tmp_path: Path,
) -> None:
    from lightning.pytorch.callbacks import Callback

    order: list[tuple[str, int]] = []
    ckpt_dir = tmp_path / "reference" / "checkpoints"

    class Queue:
        def put(self, item: tuple[str, str, Any]) -> None:
            kind, _, payload = item
            if kind == "checkpoint":
                assert (ckpt_dir / f"step={payload}.ckpt").is_file()  # complete: saved
                order.append((kind, payload))

    class Validated(Callback):
        def on_validation_end(self, trainer: Any, *args: Any) -> None:
            order.append(("validated", trainer.global_step))

    branch = tiny_branch(
        "reference", checkpoint_every=K, val_every=K, callbacks=[Validated()], trainer_kwargs={}
    )
    run_branch(branch, tmp_path, Queue())
    # step K: the file goes out before validation (branches start that much earlier);
    # step N, the last: validation only comes after it, and no batch start follows.
    expected = [("checkpoint", K), ("validated", K), ("checkpoint", N), ("validated", N)]
    assert order == expected


def test_last_checkpoint_is_reported_without_a_validation_after_it(tmp_path: Path) -> None:
    sent: list[int] = []

    class Queue:
        def put(self, item: tuple[str, str, Any]) -> None:
            if item[0] == "checkpoint":
                sent.append(item[2])

    run_branch(tiny_branch("reference", checkpoint_every=K), tmp_path, Queue())  # no val
    assert sent == [K, N]
    resumed = tiny_branch("resumed", checkpoint_path(tmp_path / "reference", K), checkpoint_every=K)
    sent.clear()
    run_branch(resumed, tmp_path, Queue())
    assert sent == [N]  # not step K: that file belongs to the run it resumed from


@pytest.mark.slow
def test_an_idle_worker_outlives_the_terminals_ctrl_c(tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the terminal's group. An idle worker must not die
    of it (a KeyboardInterrupt traceback, and a pool broken for the branches after): the
    main process decides what an interrupt stops."""
    others = set(multiprocessing.active_children())
    with BranchRunner(tmp_path, workers=1) as runner:
        runner._starter.join()
        runner._pool.submit(_ready).result()  # a worker is up, and idle again
        workers = set(multiprocessing.active_children()) - others  # the pool's
        assert len(workers) == 1
        for worker in workers:
            assert worker.pid is not None
            os.kill(worker.pid, signal.SIGINT)
        for worker in workers:
            worker.join(timeout=1)  # time for the signal to land: ignored, it lives on
            assert worker.is_alive()
        runner.submit(tiny_branch("after"))
        done = [name for kind, name, _ in runner.events() if kind == "done"]
    assert done == ["after"]
    assert runner.results["after"].state


BUSY_WORKERS = """
import multiprocessing, sys, time
from pathlib import Path
from lit_spikes.demo.branches import BranchRunner
runner = BranchRunner(Path(sys.argv[1]), workers=2)
runner.__enter__()
runner._starter.join()
for _ in range(2):  # every worker of the pool busy, as workers training long branches
    runner._pool.submit(time.sleep, 600)
time.sleep(1)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_busy_workers_end_when_the_main_process_is_killed(tmp_path: Path) -> None:
    """SIGKILL (or a crash) of the main job leaves no handler to stop its workers: each
    must notice by itself, not train on as an orphan that then blocks on a dead pipe."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY_WORKERS, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    assert child.stdout is not None
    pids = [int(pid) for pid in child.stdout.readline().split()]
    try:
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        child.kill()
        child.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


class MarksStep(Callback):
    """Creates ``path`` at ``step``: the branch is training."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.path.touch()


@pytest.mark.slow
def test_an_error_stops_the_workers_branches_at_their_next_step(tmp_path: Path) -> None:
    """Leaving the runner on an error must not wait for the running branches to train to
    their end: each stops as on a SIGTERM (its preemption checkpoint written)."""
    marker = tmp_path / "training"
    long = replace(
        tiny_branch("long", checkpoint_every=K, callbacks=[MarksStep(marker, 3)]),
        max_steps=2_000,  # without the stop it trains to its end: a failure, not a hang
    )
    with pytest.raises(KeyError), BranchRunner(tmp_path, workers=1) as runner:
        runner._starter.join()  # the worker takes it at once
        runner.submit(long)
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise KeyError("the caller's error")
    (future,) = runner._futures
    stopped = future.exception()
    assert isinstance(stopped, BranchInterrupted), stopped
    assert stopped.signum == signal.SIGTERM and 3 <= stopped.step < long.max_steps
    assert checkpoint_path(tmp_path / "long", stopped.step).is_file()


class DiesInAWorker(Callback):
    """SIGKILLs the process training the branch at ``step``, unless it is ``main_pid``
    (as the kernel's out-of-memory killer would)."""

    def __init__(self, main_pid: int, step: int) -> None:
        self.main_pid, self.step = main_pid, step

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step and os.getpid() != self.main_pid:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_worker_killed_mid_branch_is_named_once_this_process_run_ends(tmp_path: Path) -> None:
    """The pool breaks when a worker dies: a branch this process trains meanwhile, which
    queues another at its checkpoint, must train on (it was aborted from its own callback
    with a nameless BrokenProcessPool), and the error then names the lost branch."""
    from lit_spikes.demo.branches import WorkerDied

    with (
        pytest.raises(WorkerDied, match="while training doomed") as died,
        BranchRunner(tmp_path, workers=1) as runner,
    ):
        runner._starter.join()
        runner.submit(tiny_branch("doomed", callbacks=[DiesInAWorker(os.getpid(), 2)]))
        deadline = time.monotonic() + 60
        while not all(f.done() for f in runner._futures) and time.monotonic() < deadline:
            time.sleep(0.05)

        def queue_one(kind: str, name: str, payload: Any) -> None:
            if kind == "checkpoint" and payload == K:
                runner.submit(tiny_branch("after"))

        runner.run_here(tiny_branch("reference", checkpoint_every=K), queue_one)
    assert died.value.names == ["doomed"]
    assert checkpoint_path(tmp_path / "reference", N).is_file()  # trained to its end


def test_worker_died_names_its_branches_after_a_round_trip_through_pickle() -> None:
    import pickle

    from lit_spikes.demo.branches import WorkerDied

    again = pickle.loads(pickle.dumps(WorkerDied(["demo2/scale_lr"])))
    assert again.names == ["demo2/scale_lr"]
    assert "died while training demo2/scale_lr (" in str(again)
    assert "died (killed" in str(WorkerDied([]))  # an idle worker: no branch lost
