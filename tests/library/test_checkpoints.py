"""``lit_spikes.checkpoints``: atomic writes that a SIGKILL or a failed write never leaves
half done, broken, foreign or malicious files refused by name, and which file a latest
resume takes."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import lit_spikes.checkpoints as checkpoints
from lit_spikes.callbacks import ExactResume
from lit_spikes.checkpoints import (
    AtomicCheckpointIO,
    CheckpointError,
    CheckpointWriteError,
    atomic_torch_save,
    checkpoint_files,
    load_checkpoint,
    newest_valid_checkpoint,
    record_nonfinite,
    remove_leftovers,
)
from lit_spikes.demo.module import TinyGPTModule
from lit_spikes.shared.training import checkpoint_path
from lit_spikes.tools.cli import main as cli_main
from tests.conftest import (
    TINY_CLI,
    TINY_DATA,
    TINY_GPT,
    TINY_OPTIM,
    fit,
    load_ckpt,
)
from tests.modules.plain_runs import loader, train
from tests.modules.user_modules import DropoutRegressor

N, K, EVERY = 20, 10, 5


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
    # It crosses a process pool (a branch worker's error) as itself, its message the one
    # of the moment it was raised, though the disk has changed since.
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=1))
    copy = pickle.loads(pickle.dumps(error.value))
    monkeypatch.undo()
    assert isinstance(copy, CheckpointWriteError) and copy.path == path
    assert str(copy) == str(error.value)
    broken = pickle.loads(pickle.dumps(CheckpointError(path, "truncated")))
    assert (broken.path, broken.reason) == (path, "truncated")


class _Filling:
    """A file on a disk with ``room`` bytes left: a write past it raises ``ENOSPC``."""

    def __init__(self, handle: Any, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(28, "No space left on device")
        self.room -= size
        return int(self.handle.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> _Filling:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


@pytest.mark.parametrize("room", [0, 100, 5000])
def test_a_disk_filling_inside_torchs_zip_writer_is_the_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    path = tmp_path / "step=5.ckpt"
    atomic_torch_save({"version": 1}, path)

    def filling(name: str, mode: str) -> _Filling:
        return _Filling(open(name, mode), room)

    monkeypatch.setattr(checkpoints, "open", filling, raising=False)  # atomic_write's open
    with pytest.raises(CheckpointWriteError, match="No space left on device") as error:
        AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(10_000)}, path)
    monkeypatch.undo()
    assert str(error.value).startswith(f"cannot write {path}: No space left on device (")
    assert torch.load(path, weights_only=True) == {"version": 1}
    assert not remove_leftovers(tmp_path)


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


def flip_in_smallest_tensor(path: Path) -> str:
    """Flip the bits of the first byte of the smallest tensor record of a torch zip file
    (it still unpickles); returns the record's name."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        tensors = [i for i in archive.infolist() if "/data/" in i.filename and i.file_size]
        smallest = min(tensors, key=lambda info: info.file_size)
    at = smallest.header_offset
    name_length, extra_length = struct.unpack("<HH", data[at + 26 : at + 30])
    data[at + 30 + name_length + extra_length] ^= 0xFF
    path.write_bytes(bytes(data))
    return smallest.filename


def test_a_users_newest_file_with_one_flipped_byte_is_passed_over(tmp_path: Path) -> None:
    """Issue 44's gap (one case of one test): a user's module's file every step; one
    byte of the newest file's smallest tensor flipped (an optimizer step count, a bias)
    fails its record's CRC-32: refused by name, and the rollback target is the file
    before it."""
    train(tmp_path, DropoutRegressor(), loader(), 10, [ExactResume()])
    newest = tmp_path / "step=10.ckpt"
    record = flip_in_smallest_tensor(newest)
    with pytest.raises(CheckpointError, match=f"its record {record} fails its CRC-32"):
        load_checkpoint(newest)
    with pytest.warns(UserWarning, match="step=10.ckpt"):
        step, path, refused = newest_valid_checkpoint(tmp_path)
    assert (step, path.name) == (9, "step=9.ckpt") and "CRC-32" in refused[0]


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
    from lit_spikes.shared.training import RunSpec

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
    assert cli.trainer.global_step == 15  # the recorded run's length, not the schedule's
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
        checkpoint["lit_spikes"]["nonfinite_steps"] = [7]  # the module's own, for its resume
        record_nonfinite(checkpoint, [7])  # the record rollbacks read
        atomic_torch_save(checkpoint, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no file refused
        assert newest_valid_checkpoint(root / "checkpoints", refuse_nonfinite=False)[0] == 15
    cli = cli_main([*args, "--ckpt_path", "latest", "--trainer.max_steps", "20"])  # extended
    assert Path(cli.trainer.ckpt_path).name == "step=15.ckpt"
    assert cli.trainer.global_step == 20
    with pytest.warns(UserWarning, match=r"written after a non-finite loss .* \[7\]"):
        assert newest_valid_checkpoint(root / "checkpoints")[0] == 5  # a rollback target


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
