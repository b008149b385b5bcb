"""What survives what: crashes while saving, broken files, mismatches, NaNs, preemption,
pruning, malicious files, TensorBoard after resume, bad input."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import pickle
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lit_spikes.checkpoints as checkpoints_module
from lit_spikes.callbacks import (
    CheckpointRetention,
    LRScaler,
    PreemptionCheckpoint,
    RollbackRestore,
    RunDirectoryBusy,
    RunDirectoryLock,
    SpikeDetector,
)
from lit_spikes.callbacks.run_lock import LOCK_NAME
from lit_spikes.checkpoints import (
    AtomicCheckpointIO,
    CheckpointError,
    CheckpointWriteError,
    atomic_torch_save,
    checkpoint_files,
    load_checkpoint,
    newest_valid_checkpoint,
    remove_leftovers,
)
from lit_spikes.demo.module import TinyGPTModule
from lit_spikes.tools.cli import main as cli_main
from lit_spikes.tools.training import checkpoint_path, unwritable_directory
from tests.conftest import (
    TINY_CLI,
    TINY_DATA,
    TINY_GPT,
    TINY_OPTIM,
    assert_states_equal,
    fit,
    load_ckpt,
    lock_probe,
    tb_scalars,
)

N, K, EVERY = 20, 10, 5
ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ 1. atomic saves


def _save_forever(target: Path, template: dict, ready: Any) -> None:  # type: ignore[type-arg]
    version = 0
    while True:
        version += 1
        template["version"] = version
        atomic_torch_save(template, target)
        ready.set()


def test_sigkill_while_saving_never_leaves_a_partial_checkpoint(tmp_path: Path) -> None:
    """30 savers (forked: no import cost) killed at random moments, mid-save most often."""
    reference = fit(tmp_path, "ref", K, checkpoint_every=K)
    template = load_ckpt(checkpoint_path(reference.spec.run_dir, K))
    target = tmp_path / "live" / "step=10.ckpt"
    context = multiprocessing.get_context("fork")
    rng = random.Random(0)
    seen, mid_save = set(), 0
    for _ in range(30):
        ready = context.Event()
        child = context.Process(target=_save_forever, args=(target, template, ready))
        child.start()
        assert ready.wait(timeout=30)  # at least one complete save exists
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join()
        checkpoint = load_checkpoint(target)  # always the last complete version
        assert checkpoint["version"] >= 1
        seen.add(checkpoint["version"])
        assert [p.name for p in target.parent.glob("*.ckpt")] == ["step=10.ckpt"]
        mid_save += bool(remove_leftovers(target.parent))  # a temp file: killed mid-write
        assert sorted(p.name for p in target.parent.iterdir()) == ["step=10.ckpt"]
    assert len(seen) > 1 and mid_save > 0  # kills landed at many points, some mid-write


def test_a_failed_write_is_raised_naming_the_file_and_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step=5.ckpt"
    atomic_torch_save({"version": 1}, path)

    def full_disk(fd: int) -> None:  # the new file's data cannot reach the disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    io_plugin = AtomicCheckpointIO()
    with pytest.raises(CheckpointWriteError, match="No space left") as error:
        io_plugin.save_checkpoint({"version": 2}, path)
    monkeypatch.undo()
    assert str(path) in str(error.value)
    assert torch.load(path, weights_only=True) == {"version": 1}
    assert not remove_leftovers(tmp_path)  # no temporary file left either
    # It crosses a process pool (a branch worker's error) as itself.
    copy = pickle.loads(pickle.dumps(error.value))
    assert isinstance(copy, CheckpointWriteError) and copy.path == path
    assert str(copy) == str(error.value)
    broken = pickle.loads(pickle.dumps(CheckpointError(path, "truncated")))
    assert (broken.path, broken.reason) == (path, "truncated")


def test_a_save_in_on_fit_end_is_on_disk_before_the_directory_is_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning tears its checkpoint plugin down before on_fit_end: a save there is on
    disk (or its error raised) before another run may take the directory."""

    class SaveAtFitEnd(Callback):
        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "final.ckpt")

    run = fit(tmp_path, "run", 2, callbacks=[SaveAtFitEnd()])
    assert (run.spec.run_dir / "final.ckpt").exists()
    assert not (run.spec.run_dir / LOCK_NAME).exists()

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"final\.ckpt.*No space left"):
        fit(tmp_path, "full", 2, callbacks=[SaveAtFitEnd()])
    assert not (tmp_path / "full" / LOCK_NAME).exists()


def test_a_failing_run_holds_its_directory_while_a_checkpoint_saves_on_exception(
    tmp_path: Path,
) -> None:
    """ModelCheckpoint(save_on_exception=True) writes in its on_exception, which runs after
    the lock's (checkpoint callbacks come last): the directory is let go only after it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    held: list[bool] = []
    real = checkpoints_module.atomic_write

    def watched(path: Path, write: Any) -> None:
        held.append((path.parent.parent / LOCK_NAME).exists())
        real(path, write)

    class Boom(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                raise RuntimeError("boom at step 3")

    emergency = ModelCheckpoint(
        dirpath=tmp_path / "run" / "checkpoints",
        filename="crash-{step}",
        save_on_exception=True,
        every_n_train_steps=99,  # not the run's own (100): another state key
    )
    checkpoints_module.atomic_write = watched  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="boom at step 3"):
            fit(tmp_path, "run", 10, checkpoint_every=100, callbacks=[Boom(), emergency])
    finally:
        checkpoints_module.atomic_write = real
    assert held == [True]
    assert (tmp_path / "run" / "checkpoints" / "crash-step=3.ckpt").exists()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_failing_save_on_exception_still_lets_go_of_the_directory(tmp_path: Path) -> None:
    """A save in ModelCheckpoint's on_exception that fails (a full disk, written at once as
    under DDP) makes Lightning skip teardown, where the directory was to be released: it
    stayed locked until the process exited (a notebook's kernel, a retrying service)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    real = checkpoints_module.atomic_write

    def full_disk_for_crash_files(path: Path, write: Any) -> None:
        if Path(path).name.startswith("crash-"):
            raise OSError(28, "No space left on device")
        real(path, write)

    class Boom(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                raise RuntimeError("boom at step 3")

    emergency = ModelCheckpoint(
        dirpath=tmp_path / "run" / "checkpoints",
        filename="crash-{step}",
        save_on_exception=True,
        every_n_train_steps=99,
    )
    checkpoints_module.atomic_write = full_disk_for_crash_files  # type: ignore[assignment]
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(OSError, match="No space left"):
            fit(
                tmp_path,
                "run",
                10,
                checkpoint_every=100,
                callbacks=[Boom(), emergency],
            )
    finally:
        checkpoints_module.atomic_write = real
        # The skipped teardown left Lightning's SIGTERM handler too: not into the next
        # tests' processes (a forked lock holder would outlive its terminate()).
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert lock_probe(tmp_path / "run") == "free"


def test_other_plugins_keep_the_atomic_checkpoint_writes(tmp_path: Path) -> None:
    """A cluster environment or a precision plugin is no reason to write checkpoints
    with Lightning's plain torch.save (no fsync, no atomic rename, no clear errors)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    for plugins in ([LightningEnvironment()], LightningEnvironment()):
        run = fit(tmp_path, f"run{type(plugins).__name__}", 2, plugins=plugins)
        assert isinstance(run.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    mine = AtomicCheckpointIO()
    run = fit(tmp_path, "own", 2, plugins=[mine])
    assert run.trainer.strategy.checkpoint_io is mine


# Lightning's note that ckpt_path="last" finds no last.ckpt, as the docstring says.
@pytest.mark.filterwarnings(
    'ignore:.fit\\(ckpt_path="last"\\) is set, but there is no last:UserWarning'
)
def test_a_new_run_into_another_runs_checkpoints_is_refused_from_python_too(
    tmp_path: Path,
) -> None:
    """What lit-spikes fit refuses: RunSpec (and Lightning's ckpt_path="last", which finds
    no last.ckpt here and would start from step 0) mixed step=<k>-v1.ckpt files and
    duplicate TensorBoard steps into the first run's directory."""
    from lit_spikes.callbacks import AnotherHistory

    first = fit(tmp_path, "run", N, checkpoint_every=EVERY)
    files = sorted(p.name for p in (first.spec.run_dir / "checkpoints").iterdir())
    before = tb_scalars(first.spec.run_dir)
    for ckpt_path in (None, "last"):
        with pytest.raises(AnotherHistory, match=r"holds the checkpoints of a run \(step=5 to "):
            fit(tmp_path, "run", N, checkpoint_every=EVERY, ckpt_path=ckpt_path)
        assert sorted(p.name for p in (first.spec.run_dir / "checkpoints").iterdir()) == files
        assert tb_scalars(first.spec.run_dir) == before
        assert not (first.spec.run_dir / LOCK_NAME).exists()
    # Resuming it goes on, into the same directory
    resumed = fit(
        tmp_path,
        "run",
        N + 5,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(first.spec.run_dir, N),
    )
    assert min(resumed.losses) == N


def test_runspec_refuses_callbacks_that_would_replace_the_runs_own(tmp_path: Path) -> None:
    from lit_spikes.tools.training import RunSpec

    with pytest.raises(ValueError, match=r"trainer_kwargs\['callbacks'\].*RunSpec\(callbacks="):
        RunSpec(tmp_path, "run", 4, trainer_kwargs={"callbacks": [SpikeDetector(ratio=1.4)]})


def test_a_failed_cleanup_after_the_lock_is_taken_releases_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lit_spikes.tools import training

    def unreadable(directory: Path) -> list[Path]:
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(training, "remove_leftovers", unreadable)
    with pytest.raises(PermissionError):
        training.RunSpec(tmp_path, "run", 4, checkpoint_every=2).trainer()
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released: no fit will release it


# ------------------------------------------------------------------ 2. broken files


def _broken_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    reference = fit(tmp_path, "ref", K, checkpoint_every=K)
    good = checkpoint_path(reference.spec.run_dir, K)
    data = good.read_bytes()
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    # 64 bits flipped in the middle of the largest tensor's bytes: it still unpickles
    flipped = bytearray(data)
    with zipfile.ZipFile(good) as archive:
        tensors = [info for info in archive.infolist() if "/data/" in info.filename]
        largest = max(tensors, key=lambda info: info.file_size)
    at = largest.header_offset  # its data follows its local header (30 bytes, name, extra)
    name_length, extra_length = struct.unpack("<HH", data[at + 26 : at + 30])
    middle = at + 30 + name_length + extra_length + largest.file_size // 2
    flipped[middle : middle + 8] = bytes(b ^ 0xFF for b in flipped[middle : middle + 8])
    (tmp_path / "flipped.ckpt").write_bytes(bytes(flipped))
    (tmp_path / "notes.ckpt").write_text("these are my notes, not a checkpoint\n")
    (tmp_path / "config.ckpt").write_text("config: a text torch.load reads as a pickle\n")
    (tmp_path / "run.ckpt").mkdir()
    weights = load_ckpt(good)
    torch.save({"state_dict": weights["state_dict"]}, tmp_path / "weights.ckpt")
    return {
        "missing": (tmp_path / "missing.ckpt", "no such file"),
        "empty": (tmp_path / "empty.ckpt", "the file is empty"),
        "truncated": (tmp_path / "truncated.ckpt", "truncated or corrupt"),
        "bits flipped": (tmp_path / "flipped.ckpt", r"corrupt: its record .* fails its CRC-32"),
        "not a checkpoint": (tmp_path / "notes.ckpt", "not a torch checkpoint"),
        "text as pickle": (tmp_path / "config.ckpt", r"not a torch checkpoint \(those are zip"),
        "a directory": (tmp_path / "run.ckpt", "a directory, not a checkpoint file"),
        "weights only": (tmp_path / "weights.ckpt", "holds weights only"),
    }


def test_a_file_saved_without_checksums_is_no_corrupt_one(tmp_path: Path) -> None:
    """torch.serialization.set_crc32_options(False) writes zeros where the CRCs go: such
    a file loads in torch, and is not refused as corrupt."""
    run = fit(tmp_path, "ref", K, checkpoint_every=K)
    checkpoint = load_ckpt(checkpoint_path(run.spec.run_dir, K))
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(checkpoint, tmp_path / "no_crc.ckpt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert load_checkpoint(tmp_path / "no_crc.ckpt")["global_step"] == K


def test_bad_checkpoints_give_errors_naming_the_file_and_the_fault(tmp_path: Path) -> None:
    for path, reason in _broken_files(tmp_path).values():
        with pytest.raises(CheckpointError, match=reason) as error:
            fit(tmp_path, "resume", N, ckpt_path=path)
        assert str(path) in str(error.value)
        assert not (tmp_path / "resume" / "checkpoints").exists()


def test_a_weights_only_file_serves_validation_but_not_a_resume(tmp_path: Path) -> None:
    """Lightning's own save_checkpoint(weights_only=True): enough to evaluate a model or
    start a new run from its weights, not to resume one bit-exactly."""
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.tools.training import RunSpec

    run = fit(tmp_path, "ref", K, val_every=K)
    weights, full = tmp_path / "weights.ckpt", checkpoint_path(run.spec.run_dir, K)
    run.trainer.save_checkpoint(weights, weights_only=True)
    run.trainer.save_checkpoint(full)

    def val_bpc(path: Path) -> float:
        spec = RunSpec(tmp_path, f"val-{path.stem}", K, progress_bar=False)
        module = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM)
        results = spec.trainer().validate(module, StepDataModule(TINY_DATA), ckpt_path=path)
        return float(results[0]["val/bpc"])

    assert val_bpc(weights) == val_bpc(full)
    loaded = TinyGPTModule.load_from_checkpoint(weights)
    for key, value in run.module.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    with pytest.raises(CheckpointError, match=r"weights.ckpt: holds weights only"):
        fit(tmp_path, "resume", N, ckpt_path=weights)


def test_latest_resume_skips_invalid_files_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cli"
    args = ["fit", *TINY_CLI, "--trainer.default_root_dir", str(root), "--checkpoint_every", "5"]
    cli_main([*args, "--trainer.max_steps", "15"])
    (root / "checkpoints" / "step=15.ckpt").write_bytes(b"")  # the newest is broken
    with pytest.warns(UserWarning, match=r"step=15.ckpt: the file is empty.*previous"):
        cli = cli_main([*args, "--ckpt_path", "latest"])
    assert Path(cli.trainer.ckpt_path).name == "step=10.ckpt"
    assert cli.trainer.global_step == 20
    with pytest.raises(SystemExit):
        cli_main([*args, "--ckpt_path", str(tmp_path / "nowhere.ckpt")])
    assert "no such file" in capsys.readouterr().err


def test_of_two_files_of_one_step_the_newest_written_is_the_newest(tmp_path: Path) -> None:
    """A run resumed into its own directory writes ``step=10-v1.ckpt`` beside the old
    lineage's ``step=10.ckpt``: ``latest`` and rollbacks take the one written last."""
    run = fit(tmp_path, "run", K, checkpoint_every=EVERY)
    directory = run.spec.run_dir / "checkpoints"
    old, new = directory / f"step={K}.ckpt", directory / f"step={K}-v1.ckpt"
    new.write_bytes(old.read_bytes())
    for first, second in ((old, new), (new, old)):
        os.utime(first, ns=(1_000_000_000, 1_000_000_000))
        os.utime(second, ns=(2_000_000_000, 2_000_000_000))
        assert checkpoint_files(directory)[-1] == (K, second)
        assert newest_valid_checkpoint(directory)[1] == second
    for path in (old, new):  # the same time (a coarse clock): the version decides
        os.utime(path, ns=(3_000_000_000, 3_000_000_000))
    assert checkpoint_files(directory)[-1] == (K, new)


def test_latest_resume_takes_the_newest_file_after_a_skipped_non_finite_step(
    tmp_path: Path,
) -> None:
    """A skipped NaN step bars later files as rollback targets, not as the place an
    interrupted run goes on from: that would throw away every step since."""
    root = tmp_path / "cli"
    args = ["fit", *TINY_CLI, "--trainer.default_root_dir", str(root), "--checkpoint_every", "5"]
    cli_main([*args, "--trainer.max_steps", "15"])
    for step in (10, 15):  # as if step 7's update had been skipped for a NaN loss
        path = root / "checkpoints" / f"step={step}.ckpt"
        checkpoint = load_checkpoint(path)
        checkpoint["lit_spikes"]["nonfinite_steps"] = [7]
        atomic_torch_save(checkpoint, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no file refused
        assert newest_valid_checkpoint(root / "checkpoints", refuse_nonfinite=False)[0] == 15
    cli = cli_main([*args, "--ckpt_path", "latest"])
    assert Path(cli.trainer.ckpt_path).name == "step=15.ckpt"
    assert cli.trainer.global_step == 20
    with pytest.warns(UserWarning, match=r"written after a non-finite loss .* \[7\]"):
        assert newest_valid_checkpoint(root / "checkpoints")[0] == 5  # a rollback target


# ------------------------------------------------------------------ 3. mismatches


def test_mismatched_optimizer_count_and_shapes_are_refused(tmp_path: Path) -> None:
    reference = fit(tmp_path, "ref", K, checkpoint_every=K)
    checkpoint = load_ckpt(checkpoint_path(reference.spec.run_dir, K))
    two = dict(checkpoint, optimizer_states=checkpoint["optimizer_states"] * 2)
    torch.save(two, tmp_path / "two.ckpt")
    with pytest.raises(ValueError, match="holds 2 optimizers, TinyGPTModule configures 1"):
        fit(tmp_path, "two", N, ckpt_path=tmp_path / "two.ckpt")
    reshaped = dict(checkpoint)
    reshaped["state_dict"] = dict(checkpoint["state_dict"])
    reshaped["state_dict"]["model.head.weight"] = torch.zeros(3, 3)
    torch.save(reshaped, tmp_path / "reshaped.ckpt")
    with pytest.raises(ValueError, match=r"model.head.weight: checkpoint \(3, 3\), now \(41, 16\)"):
        fit(tmp_path, "reshaped", N, ckpt_path=tmp_path / "reshaped.ckpt")


# ------------------------------------------------------------------ 4. non-finite loss


def test_nan_loss_skips_the_update_counts_as_spike_and_is_never_a_rollback_target(
    tmp_path: Path,
) -> None:
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.tools.training import RunSpec
    from tests.conftest import NaNLossModule

    detector = SpikeDetector(ratio=1.4)
    module = NaNLossModule(gpt=TINY_GPT, optim=TINY_OPTIM, nan_step=12)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Snap(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if trainer.global_step in (12, 13):
                state = {k: v.clone() for k, v in pl_module.state_dict().items()}
                opt = trainer.optimizers[0].state_dict()["state"]
                state.update({f"exp_avg.{i}": s["exp_avg"].clone() for i, s in opt.items()})
                seen[trainer.global_step] = state

    spec = RunSpec(
        tmp_path,
        "nan",
        N,
        checkpoint_every=EVERY,
        callbacks=[detector, Snap()],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0},
    )
    with pytest.warns(UserWarning, match="non-finite loss at step 12: its update is skipped"):
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
    for key, value in seen[12].items():  # the NaN step changed no weight and no moment
        assert torch.equal(value, seen[13][key]), key
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())
    assert [s["step"] for s in detector.spikes] == [12]
    assert module.nonfinite_steps == [12]
    with pytest.warns(UserWarning, match=r"written after a non-finite loss .* \[12\]"):
        rollback = RollbackRestore(spec.run_dir / "checkpoints", spike_step=N, distance=0)
        assert rollback.ckpt_step == 10


# ------------------------------------------------------------------ 5. preemption

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
    """A resumed run counts the validation of its first step as done: skipped before the
    stop, it would be missing from the curve for good."""
    preempted, resumed, straight = Validations(), Validations(), Validations()
    fit(tmp_path, "a", 12, checkpoint_every=EVERY, val_every=4, callbacks=[SignalAt(8), preempted])
    ckpt = tmp_path / "a" / "checkpoints" / "step=8.ckpt"
    fit(tmp_path, "b", 12, val_every=4, ckpt_path=ckpt, callbacks=[resumed])
    fit(tmp_path, "c", 12, val_every=4, callbacks=[straight])
    assert preempted.at + resumed.at == straight.at == [4, 8, 12]


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
    from lit_spikes.tools.training import RunSpec

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


def test_a_failing_on_exception_of_another_callback_still_lets_the_directory_go(
    tmp_path: Path,
) -> None:
    """Lightning skips its teardown when an on_exception raises: the lock is let go in
    its own on_exception (no checkpoint is saved on exception after it)."""

    class Boom(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("boom")

    class FailingOnException(Callback):
        def on_exception(self, *args: Any) -> None:
            raise OSError(28, "No space left on device")

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(OSError, match="No space left"):
            callbacks = [Boom(), FailingOnException()]
            fit(tmp_path, "run", N, checkpoint_every=EVERY, callbacks=callbacks)
        assert not (tmp_path / "run" / LOCK_NAME).exists()
        # PreemptionCheckpoint's on_exception never ran (nor Lightning's teardown): its
        # handler is still installed, and must hand a signal on now, not keep it as a
        # flag no fit reads (here in a fork, which has the same handlers).
        child = multiprocessing.get_context("fork").Process(target=_sigterm_self)
        child.start()
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:  # Lightning's own handler stays too: not into the next tests' processes
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    handler = signal.getsignal(signal.SIGTERM)
    sys.exit(3 if isinstance(getattr(handler, "__self__", None), PreemptionCheckpoint) else 0)


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


# ------------------------------------------------------------------ 6. retention


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
    from lit_spikes.tools.training import RunSpec
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


# ------------------------------------------------------------------ 7. malicious files


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


# torch's note on the payload's protocol (not torch.save's default), before it refuses it.
@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4 in the checkpoint:UserWarning")
def test_checkpoint_with_a_pickle_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    reference = fit(tmp_path, "ref", K, checkpoint_every=K)
    checkpoint = load_ckpt(checkpoint_path(reference.spec.run_dir, K))
    marker = tmp_path / "pwned"
    checkpoint["evil"] = _Payload(marker)
    torch.save(checkpoint, tmp_path / "evil.ckpt", pickle_protocol=pickle.DEFAULT_PROTOCOL)
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        fit(tmp_path, "resume", N, ckpt_path=tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        load_checkpoint(tmp_path / "evil.ckpt")
    assert not marker.exists()


# ------------------------------------------------------------------ 8. TensorBoard


def test_resuming_into_the_same_run_purges_stale_steps(tmp_path: Path) -> None:
    first = fit(tmp_path, "run", N, checkpoint_every=EVERY)
    ckpt = checkpoint_path(first.spec.run_dir, K)
    # A crash after step 20 is replayed from step 10 with other data: steps 10-19 of the
    # first attempt are stale and must not show.
    with pytest.warns(UserWarning, match="data seed"):
        again = fit(tmp_path, "run", N, ckpt_path=ckpt, data=replace(TINY_DATA, seed=9))
    losses = tb_scalars(first.spec.run_dir)["train/loss"]
    assert [step for step, _ in losses] == list(range(N))
    logged = dict(losses)
    for step in range(K, N):
        # TensorBoard stores float32; the loss is a float32 value too: equal exactly
        assert logged[step] == again.losses[step]
        assert again.losses[step] != first.losses[step]


def test_nan_gradient_with_finite_loss_skips_the_update(tmp_path: Path) -> None:
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.tools.training import RunSpec
    from tests.test_callbacks import _NaNAtStep  # finite forward, NaN backward at step 12

    module = _NaNAtStep(gpt=TINY_GPT, optim=TINY_OPTIM)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Snap(Callback):  # the weights and all of AdamW's state at a step's start
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if trainer.global_step in (11, 12, 13):
                state = {k: v.clone() for k, v in pl_module.state_dict().items()}
                for i, s in trainer.optimizers[0].state_dict()["state"].items():
                    state.update({f"{name}.{i}": v.clone() for name, v in s.items()})
                seen[trainer.global_step] = state

    spec = RunSpec(
        tmp_path,
        "nan_grad",
        14,
        callbacks=[Snap()],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0},
    )
    with pytest.warns(UserWarning, match="non-finite gradient norm at step 12"):
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
    assert module.nonfinite_steps == [12]
    # Zeroed gradients would pass a finiteness check: AdamW's weight decay and moment decay
    # would still move them. The step must leave every tensor as it was.
    assert any(k.startswith("exp_avg_sq.") for k in seen[12])
    for key, value in seen[12].items():
        assert torch.equal(value, seen[13][key]), key
    assert any(not torch.equal(v, seen[12][k]) for k, v in seen[11].items())  # step 11 moved


# ------------------------------------------------------------------ 9. bad input


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


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: replace(TINY_OPTIM, peak_lr=math.inf), "peak_lr=inf must be finite and positive"),
        (lambda: replace(TINY_OPTIM, lr_scale=math.nan), "scale=nan must be finite and positive"),
        (lambda: replace(TINY_OPTIM, weight_decay=math.inf), "weight_decay=inf must be finite"),
        (lambda: replace(TINY_GPT, init_std=math.nan), "init_std=nan must be finite and positive"),
    ],
)
def test_configs_refuse_non_finite_numbers(build: Any, message: str) -> None:
    """An inf or NaN passes a "> 0" check, and then every step of the run is NaN."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


@pytest.mark.parametrize("seed", [-1, 2**31])
def test_a_train_seed_numpy_cannot_take_is_refused_when_built(seed: int) -> None:
    """Not a NumPy error at the first step (rank r seeds with train_seed + r)."""
    from lit_spikes.demo.module import TinyGPTModule

    with pytest.raises(ValueError, match=re.escape(f"train_seed={seed} must be in [0, 2**31)")):
        TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM, train_seed=seed)


def test_a_text_too_short_for_a_row_is_refused_before_any_step(tmp_path: Path) -> None:
    """Not a torch.randint error inside the first step; nor a validation that logs nothing."""
    short = replace(TINY_DATA, world=replace(TINY_DATA.world, num_chars=1000), block_size=256)
    with pytest.raises(ValueError, match=r"the validation text has \d+ characters, fewer than"):
        fit(tmp_path, "short", 3, gpt=replace(TINY_GPT, block_size=256), data=short)


def test_a_setup_that_would_fail_at_its_first_step_is_refused_in_setup(tmp_path: Path) -> None:
    """From Python too: named, before any step, not an IndexError inside the embedding."""
    with pytest.raises(ValueError, match=r"block_size=16 exceeds .*block_size=8.*vocab_size=10"):
        fit(tmp_path, "both", 5, gpt=replace(TINY_GPT, block_size=8, vocab_size=10))
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=3"):
        fit(tmp_path, "accumulate", 5, accumulate_grad_batches=3)
    # Lightning's overfitting mode would train on fresh batches: no batch comes again
    with pytest.raises(ValueError, match=r"overfit_batches=0.5.*no batch comes again"):
        fit(tmp_path, "overfit", 5, overfit_batches=0.5)


@pytest.mark.parametrize(
    ("first", "then", "named"),
    [
        ({"precision": "bf16-mixed"}, {}, "precision: checkpoint 'bf16-mixed', now '32-true'"),
        ({}, {"precision": "bf16-true"}, "precision: checkpoint '32-true', now 'bf16-true'"),
        ({"gradient_clip_val": 0.05}, {}, "gradient_clip: checkpoint {'value': 0.05"),
        (
            {"gradient_clip_val": 0.05},
            {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"},
            "'algorithm': 'norm'}, now {'value': 0.05, 'algorithm': 'value'}",
        ),
    ],
)
def test_a_resume_under_another_precision_or_clipping_warns(
    tmp_path: Path, first: dict[str, Any], then: dict[str, Any], named: str
) -> None:
    """Another precision, or clipping dropped or changed, is another trajectory: said, as
    for another world size. (Clipping added is the remedy: see the next test.)"""
    fit(tmp_path, "first", K, checkpoint_every=K, **first)
    with pytest.warns(UserWarning, match=re.escape(named)):
        fit(tmp_path, "then", N, ckpt_path=checkpoint_path(tmp_path / "first", K), **then)


def test_clipping_added_at_a_resume_is_the_remedy_and_not_warned(tmp_path: Path) -> None:
    fit(tmp_path, "first", K, checkpoint_every=K)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*different setup.*")
        fit(
            tmp_path,
            "clip",
            N,
            ckpt_path=checkpoint_path(tmp_path / "first", K),
            gradient_clip_val=1.0,
        )


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


# ------------------------------------------------------------------ 10. one run per directory


def test_a_second_run_into_a_busy_directory_stops_before_writing_anything(
    tmp_path: Path, directory_holder: Any
) -> None:
    run_dir = tmp_path / "busy"
    holder = directory_holder(run_dir)
    with pytest.raises(RunDirectoryBusy, match=rf"in use by another run \(pid {holder.pid} on "):
        fit(tmp_path, "busy", N, checkpoint_every=EVERY)
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # no events, no checkpoints
    holder.terminate()
    holder.join()
    run = fit(tmp_path, "busy", N, checkpoint_every=EVERY)  # free again: the kernel released it
    assert run.trainer.global_step == N
    assert not (run_dir / LOCK_NAME).exists()  # removed as the run ended


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


def test_a_failing_run_lets_go_of_its_directory_after_its_last_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run let in before the last file is on disk could choose where to resume while a
    step file is still landing."""
    on_disk_at_release: list[list[str]] = []
    real_release = RunDirectoryLock.release

    def release(self: RunDirectoryLock) -> None:
        if self.held:
            files = (tmp_path / "failing" / "checkpoints").glob("*.ckpt")
            on_disk_at_release.append(sorted(p.name for p in files))
        real_release(self)

    monkeypatch.setattr(RunDirectoryLock, "release", release)

    class FailRightAfterASave(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == EVERY:  # step=5.ckpt was just saved
                raise RuntimeError("failed right after a save")

    with pytest.raises(RuntimeError, match="failed right after a save"):
        fit(tmp_path, "failing", N, checkpoint_every=EVERY, callbacks=[FailRightAfterASave()])
    assert on_disk_at_release == [[f"step={EVERY}.ckpt"]]
    assert lock_probe(tmp_path / "failing") == "free"


def test_a_run_never_removes_the_lock_file_of_another(
    tmp_path: Path, directory_holder: Any
) -> None:
    """A run directory removed under a run (recover --fresh) and locked again by another."""
    first = RunDirectoryLock(tmp_path / "run")
    first.acquire()
    shutil.rmtree(tmp_path / "run")
    holder = directory_holder(tmp_path / "run")
    first.release()
    with pytest.raises(RunDirectoryBusy, match=rf"\(pid {holder.pid} on "):
        RunDirectoryLock(tmp_path / "run").acquire()


def test_locks_of_one_process_on_one_directory_share_it(tmp_path: Path) -> None:
    """A run resumed in the same process, or a Trainer built and never fitted, goes on."""
    first, second = RunDirectoryLock(tmp_path), RunDirectoryLock(tmp_path)
    first.acquire()
    second.acquire()
    first.release()
    assert second.held and lock_probe(tmp_path) == "busy"
    second.release()
    assert not (tmp_path / LOCK_NAME).exists() and lock_probe(tmp_path) == "free"


def test_a_copy_in_another_process_holds_nothing_and_releases_nothing(tmp_path: Path) -> None:
    """A spawned DDP worker gets a pickled copy, a forked one the parent's memory: neither
    may release the parent's lock (nor close what its descriptor number is there)."""
    lock = RunDirectoryLock(tmp_path)
    lock.acquire()
    copy = pickle.loads(pickle.dumps(lock))
    assert not copy.held
    copy.release()
    child = multiprocessing.get_context("fork").Process(target=lock.release)
    child.start()
    child.join()
    assert child.exitcode == 0 and lock.held and lock_probe(tmp_path) == "busy"
    lock.release()
    assert lock_probe(tmp_path) == "free"


def test_a_dangling_symlink_root_is_refused_up_front(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing")
    assert unwritable_directory(link / "run") == (
        f"cannot be created ({link} is a dangling symbolic link)"
    )
    assert unwritable_directory(tmp_path / "new" / "run") is None


def test_leftovers_of_a_live_writer_are_kept_and_of_a_dead_one_removed(tmp_path: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".step=5.ckpt.tmp-{writer.pid}"
        live.write_bytes(b"half a checkpoint")
        assert remove_leftovers(tmp_path) == [] and live.exists()
    finally:
        writer.kill()
        writer.wait()
    assert remove_leftovers(tmp_path) == [live] and not live.exists()
