"""``PreemptionCheckpoint``: a signal (SIGTERM, SLURM's requeue, Ctrl-C) writes a checkpoint of the
step it stops at, once, and the resume is exact; what it validates, keeps and saves beside
the other callbacks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import (
    LRScaler,
    PreemptionCheckpoint,
    SpikeDetector,
)
from lit_spikes.demo.module import TinyGPTModule
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import (
    TINY_DATA,
    TINY_GPT,
    TINY_OPTIM,
    assert_states_equal,
    fit,
    load_ckpt,
)

N, K, EVERY = 20, 10, 5


ROOT = Path(__file__).resolve().parents[3]


PREEMPTED_RUN = """
import sys
from dataclasses import replace
from pathlib import Path
from lightning.pytorch.callbacks import Callback
from tests.conftest import TINY_OPTIM, fit

class Announce(Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 5:
            print("training", flush=True)

fit(Path(sys.argv[1]), "preempted", 400, checkpoint_every=1000,
    optim=replace(TINY_OPTIM, max_steps=400), callbacks=[Announce()])
"""


def start_script(script: str, tmp_path: Path, says: str) -> subprocess.Popen[str]:
    """``script`` in a child process (argument: ``tmp_path``), once it printed ``says``."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == says
    return child


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_run_writes_a_checkpoint_and_resume_is_exact(
    tmp_path: Path, signum: signal.Signals
) -> None:
    optim = replace(TINY_OPTIM, max_steps=400)
    child = start_script(PREEMPTED_RUN, tmp_path, "training")  # step 5 of 400: mid-run
    child.send_signal(signum)
    events = tmp_path / "preempted"
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]
    saved = sorted((events / "checkpoints").glob("step=*.ckpt"))
    assert len(saved) == 1, err[-2000:]
    assert f"Received {signum.name}" in err
    step = load_ckpt(saved[0])["global_step"]
    assert 0 < step < 400
    end = step + 7
    resumed = fit(tmp_path, "resumed", end, ckpt_path=saved[0], optim=optim)
    straight = fit(tmp_path, "straight", end, optim=optim)
    for key, value in straight.module.state_dict().items():
        assert torch.equal(value, resumed.module.state_dict()[key]), key


class SignalAt(Callback):
    """Sets the preemption flag after step ``step``, as the signal handler does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            preemption = next(c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint))
            preemption.received = signal.SIGTERM


class Validations(Callback):
    def __init__(self) -> None:
        self.at: list[int] = []

    def on_validation_start(self, trainer: Any, *args: Any) -> None:
        self.at.append(trainer.global_step)


def test_a_signal_at_a_step_of_the_interval_writes_that_step_once(tmp_path: Path) -> None:
    """The preemption save and the regular ModelCheckpoint fall on one step: one file."""
    run = fit(tmp_path, "run", N, checkpoint_every=EVERY, callbacks=[SignalAt(10)])
    assert run.trainer.global_step == 10
    names = sorted(p.name for p in (run.spec.run_dir / "checkpoints").glob("*.ckpt"))
    assert names == ["step=10.ckpt", "step=5.ckpt"]


def test_a_signal_stops_at_once_without_validating_or_training_to_min_steps(
    tmp_path: Path,
) -> None:
    """Lightning validates once more when a callback stops it, and trains on to
    min_steps: after a preemption's checkpoint both only spend the grace period."""
    validations = Validations()
    run = fit(
        tmp_path,
        "run",
        N,
        checkpoint_every=EVERY,
        val_every=4,
        callbacks=[SignalAt(7), validations],
        min_steps=N,
    )
    assert run.trainer.global_step == 7
    assert validations.at == [4]
    assert sorted(p.name for p in (run.spec.run_dir / "checkpoints").glob("*.ckpt")) == [
        "step=5.ckpt",
        "step=7.ckpt",
    ]
    # The Trainer's settings come back for a later validate or test.
    assert run.trainer.limit_val_batches == 1.0
    assert run.trainer.fit_loop.min_steps == N


def test_a_signal_at_a_validation_step_keeps_that_validation(tmp_path: Path) -> None:
    """The validation due at the signal's step runs in the grace period (a plateau
    scheduler of that step reads its metric), and the resumed run replays it from the
    file (ExactResume: the file holds none of its updates). Skipped on both sides, it
    would be missing from the curve for good."""
    preempted, resumed, straight = Validations(), Validations(), Validations()
    fit(tmp_path, "a", 12, checkpoint_every=EVERY, val_every=4, callbacks=[SignalAt(8), preempted])
    ckpt = tmp_path / "a" / "checkpoints" / "step=8.ckpt"
    fit(tmp_path, "b", 12, val_every=4, ckpt_path=ckpt, callbacks=[resumed])
    fit(tmp_path, "c", 12, val_every=4, callbacks=[straight])
    assert (preempted.at, resumed.at, straight.at) == ([4, 8], [8, 12], [4, 8, 12])


def test_a_run_validates_its_final_model_off_its_validation_interval(tmp_path: Path) -> None:
    validations = Validations()
    fit(tmp_path, "run", 10, val_every=4, callbacks=[validations])
    assert validations.at == [4, 8, 10]


def test_a_signal_in_the_last_step_ends_the_run_as_finished(tmp_path: Path) -> None:
    """Not as a preempted run (exit 143, 'resume with ...') that has nothing to resume."""
    run = fit(tmp_path, "run", N, checkpoint_every=EVERY, callbacks=[SignalAt(N)])
    (preemption,) = [c for c in run.trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    assert preemption.saved_path is None
    assert run.trainer.global_step == N
    names = sorted(p.name for p in (run.spec.run_dir / "checkpoints").glob("*.ckpt"))
    assert names == [f"step={k}.ckpt" for k in sorted(map(str, range(EVERY, N + 1, EVERY)))]


@pytest.mark.parametrize(("signal_step", "preempted"), [(6, False), (3, True)])
def test_a_signal_in_the_last_step_of_a_run_of_epochs_ends_it_as_finished(
    tmp_path: Path, signal_step: int, preempted: bool
) -> None:
    """A run that max_epochs ends (int limit_train_batches) ends at its last batch as
    finished too: it was reported preempted, with a file and nothing to resume."""
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.shared.training import RunSpec

    epochs = {"max_steps": -1, "max_epochs": 1, "limit_train_batches": 6, "limit_val_batches": 0}
    spec = RunSpec(tmp_path, "run", 6, checkpoint_every=100, callbacks=[SignalAt(signal_step)])
    spec.progress_bar, spec.trainer_kwargs = False, epochs
    trainer = spec.trainer()
    trainer.fit(TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM), datamodule=StepDataModule(TINY_DATA))
    (preemption,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    assert (preemption.saved_path is not None) == preempted
    assert preemption.ended_by_signal == (not preempted)
    assert trainer.global_step == signal_step


def test_a_preemption_listed_first_still_saves_the_other_callbacks_state_of_its_step(
    tmp_path: Path,
) -> None:
    """A Trainer built by hand may list PreemptionCheckpoint before a SpikeDetector: its
    file must still hold the detector's judgement of the step it was written at (it
    moves itself after the other callbacks, the checkpoint callbacks too)."""
    import lightning.pytorch as pl

    from lit_spikes.demo.data import StepDataModule

    def run(name: str, signal_at: int | None, ckpt: Path | None = None) -> SpikeDetector:
        preemption = PreemptionCheckpoint(tmp_path / name / "checkpoints")
        detector = SpikeDetector(ratio=1.01, window=3, warmup=4)
        extra = [] if signal_at is None else [SignalAt(signal_at)]
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=N,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[*extra, preemption, detector],
        )
        module = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM, model_seed=0)
        trainer.fit(module, datamodule=StepDataModule(TINY_DATA), ckpt_path=ckpt)
        return detector

    straight = run("straight", None)
    assert straight.spikes, "the test needs a flagged step after the preemption"
    run("preempted", K)
    saved = tmp_path / "preempted" / "checkpoints" / f"step={K}.ckpt"
    state = next(v for k, v in load_ckpt(saved)["callbacks"].items() if "SpikeDetector" in k)
    assert state["seen"] == K  # steps 0..K-1 judged, the last one included
    resumed = run("resumed", None, saved)
    assert [s["step"] for s in resumed.spikes] == [s["step"] for s in straight.spikes]
    assert resumed.state_dict() == straight.state_dict()


def test_slurms_requeue_signal_saves_at_the_steps_end_and_the_requeued_run_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under SLURM, Lightning's auto-requeue handler saves hpc_ckpt_<n>.ckpt the moment
    SIGUSR1 arrives, which may be mid-step (here during the backward of a step whose
    dropout is drawn): PreemptionCheckpoint holds it to the step's end, so the requeued
    job (same command, no ckpt_path: Lightning picks the hpc file) is bit-exact."""
    calls = tmp_path / "scontrol.calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name, value in {
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }.items():
        monkeypatch.setenv(name, value)

    class RequeueSignalInBackward(Callback):
        def on_before_backward(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == K:
                os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler right here

    gpt = replace(TINY_GPT, dropout=0.1)
    straight = fit(tmp_path, "straight", N, gpt=gpt, checkpoint_every=EVERY)
    signalled = fit(
        tmp_path,
        "signalled",
        N,
        gpt=gpt,
        checkpoint_every=EVERY,
        callbacks=[RequeueSignalInBackward()],
    )
    assert calls.read_text().split() == ["requeue", "4242"]
    hpc = signalled.spec.run_dir / "hpc_ckpt_1.ckpt"
    assert load_ckpt(hpc)["global_step"] == K + 1  # step K's end, not its middle
    requeued_dir = tmp_path / "requeued"
    requeued_dir.mkdir()
    shutil.copy(hpc, requeued_dir / hpc.name)
    requeued = fit(tmp_path, "requeued", N, gpt=gpt, checkpoint_every=EVERY)
    assert min(requeued.losses) == K + 1
    assert_states_equal(
        load_ckpt(checkpoint_path(straight.spec.run_dir, N)),
        load_ckpt(checkpoint_path(requeued.spec.run_dir, N)),
    )


def test_a_preemption_keeps_another_histories_file_of_its_step(tmp_path: Path) -> None:
    """As ModelCheckpoint does: step=<k>-v1.ckpt beside it, not over it."""
    first = fit(tmp_path, "run", 2 * EVERY, checkpoint_every=EVERY)
    files = first.spec.run_dir / "checkpoints"
    theirs = (files / f"step={2 * EVERY}.ckpt").read_bytes()
    branch = fit(
        tmp_path,
        "run",
        N,
        ckpt_path=files / f"step={EVERY}.ckpt",
        checkpoint_every=EVERY,
        callbacks=[SignalAt(2 * EVERY), LRScaler(0.5, start_step=EVERY)],
    )
    assert branch.trainer.global_step == 2 * EVERY
    assert (files / f"step={2 * EVERY}.ckpt").read_bytes() == theirs
    mine = load_ckpt(files / f"step={2 * EVERY}-v1.ckpt")
    assert torch.equal(mine["state_dict"]["model.head.weight"], branch.module.model.head.weight)


def test_a_second_sigterm_in_one_step_is_the_same_stop(tmp_path: Path) -> None:
    """A scheduler signals the process group and a launcher forwards it too: the second
    SIGTERM must not reach Lightning's handler, whose SystemExit(None) exits with 0."""

    class TwoSigterms(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGTERM)

    run = fit(tmp_path, "run", N, checkpoint_every=EVERY, callbacks=[TwoSigterms()])
    assert run.trainer.global_step == 4
    (preemption,) = [c for c in run.trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    assert preemption.saved_path == run.spec.run_dir / "checkpoints" / "step=4.ckpt"


def test_preemption_skips_the_stop_time_validation_under_lightnings_default_schedule(
    tmp_path: Path,
) -> None:
    """check_val_every_n_epoch=1 (Lightning's default) with a step interval: the same
    rule as with None."""
    validations = Validations()
    fit(
        tmp_path,
        "run",
        N,
        checkpoint_every=EVERY,
        val_every=4,
        callbacks=[SignalAt(7), validations],
        check_val_every_n_epoch=1,
    )
    assert validations.at == [4]


HANGING_RUN = """
import signal, sys, time
from pathlib import Path
# Ctrl-C as in a terminal, even under a suite started with SIGINT ignored (a background job)
signal.signal(signal.SIGINT, signal.default_int_handler)
from lightning.pytorch.callbacks import Callback
from tests.conftest import fit

class Hang(Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 2:
            print("hanging", flush=True)
            time.sleep(60)  # a stuck collective, a slow read

fit(Path(sys.argv[1]), "hang", 10, checkpoint_every=5, callbacks=[Hang()])
"""


def test_a_second_ctrl_c_stops_a_step_that_hangs(tmp_path: Path) -> None:
    """The first signal waits for the step's end; a second one goes to the handlers from
    before (Lightning's KeyboardInterrupt shutdown), not to the same flag."""
    child = start_script(HANGING_RUN, tmp_path, "hanging")
    child.send_signal(signal.SIGINT)
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    try:
        _, err = child.communicate(timeout=30)  # the hang lasts 60 s
    finally:
        child.kill()  # no-op once it exited
    assert child.returncode != 0
    assert "KeyboardInterrupt" in err, err[-2000:]


def test_fit_off_the_main_thread_trains_on_without_signal_handlers(tmp_path: Path) -> None:
    """Python installs signal handlers from the main thread only: a run started in
    another thread (a GUI, a service, a benchmark) must train, not die in on_train_start."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["run"] = fit(tmp_path, "threaded", 4, checkpoint_every=2)
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=train, name="trainer-thread")
        thread.start()
        thread.join(timeout=120)
    assert "error" not in outcome, repr(outcome.get("error"))
    assert outcome["run"].trainer.global_step == 4
    assert (outcome["run"].spec.run_dir / "checkpoints" / "step=4.ckpt").is_file()
    messages = [str(w.message) for w in caught]
    assert any("'trainer-thread'" in m and "SIGTERM" in m for m in messages), messages
    assert {s: signal.getsignal(s) for s in handlers} == handlers
