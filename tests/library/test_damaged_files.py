"""A damaged checkpoint is refused by name, never loaded with other values (issue 61, item
3): every byte of a small checkpoint of a module written for the test is flipped in turn,
and each copy either loads as the very file that was saved (a byte torch never reads: a
timestamp, a padding byte) or is refused with a ``CheckpointError`` naming it; no other
exception, and through ``fit --ckpt_path`` one line and exit 2 (lit_spikes/file_digest.py).
"""

from __future__ import annotations

import shutil
import warnings
import zipfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from lit_spikes.checkpoints import AtomicCheckpointIO, CheckpointError, load_checkpoint
from lit_spikes.file_digest import misread
from lit_spikes.tools.cli import main

NET = "tests.modules.fit_modules.DropoutNet"
DATA = "tests.modules.fit_modules.StepData"
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of a 2-unit MLP through ``lit-spikes fit``: its step=2.ckpt is ~9 KB."""
    root = tmp_path_factory.mktemp("small") / "run"
    main(["fit", "--model", NET, "--model.hidden", "2", "--data", DATA,
          "--trainer.max_steps", "2", "--checkpoint_every", "2", *QUIET,
          "--trainer.default_root_dir", str(root)])  # fmt: skip
    return root


def identical(a: Any, b: Any) -> bool:
    """Bit for bit the same value, tensors by ``torch.equal`` with their dtype and shape."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(identical(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and bool(a == b)


def small_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint of the keys a resume needs, of a 1-layer net after one AdamW step
    (8 tensor records, ~4 KB), saved by ``AtomicCheckpointIO``; returns what it holds."""
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    checkpoint = {"epoch": 0, "global_step": 1, "state_dict": net.state_dict(), "loops": {},
                  "optimizer_states": [optimizer.state_dict()], "lr_schedulers": []}  # fmt: skip
    AtomicCheckpointIO().save_checkpoint(checkpoint, path)
    return checkpoint


def flipped(data: bytes, position: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 0xFF
    return bytes(changed)


def outcome(path: Path, original: dict[str, Any]) -> str:
    """``"as saved"``, or the refusal's text; anything else fails the test."""
    with warnings.catch_warnings():  # a damaged pickle may make torch warn on its way
        warnings.simplefilter("ignore")
        try:
            loaded = load_checkpoint(path)
        except CheckpointError as error:
            assert str(error).startswith(f"checkpoint {path}: "), error
            return str(error)
    assert identical(loaded, original), f"{path} loads with other values"
    return "as saved"


def test_every_byte_flipped_is_refused_by_name_or_loads_as_saved(tmp_path: Path) -> None:
    source, damaged = tmp_path / "small.ckpt", tmp_path / "damaged.ckpt"
    original = small_checkpoint(source)
    data = source.read_bytes()
    kinds: Counter[str] = Counter()
    for position in range(len(data)):
        damaged.write_bytes(flipped(data, position))
        found = outcome(damaged, original)
        kinds["as saved" if found == "as saved" else "refused"] += 1
    # Most bytes are read (the padding torch aligns its records with is not)
    assert kinds["refused"] > len(data) // 3 and kinds["as saved"] > 0, kinds


def test_what_torch_reads_otherwise_than_it_was_saved_is_refused(small_run: Path) -> None:
    # What a damaged header led torch's reader to (AdamW's step 4.0 read as 2.9e-38, every
    # CRC of the archive intact), given to the check as torch's result
    path = small_run / "checkpoints" / "step=2.ckpt"
    assert misread(torch.load(path, weights_only=True), zipfile.ZipFile(path)) is None
    loaded = torch.load(path, weights_only=True)
    loaded["optimizer_states"][0]["state"][0]["step"] = torch.tensor(2.9e-38)
    assert misread(loaded, zipfile.ZipFile(path)) == (
        "1 tensor(s) as torch read them match no record of the file (CRC-32 "
        f"{zlib.crc32(torch.tensor(2.9e-38).numpy().tobytes()):08x})"
    )
    loaded = torch.load(path, weights_only=True)
    loaded["global_step"] += 1  # the pickle read otherwise
    assert misread(loaded, zipfile.ZipFile(path)) == (
        "its contents as torch read them are not what was saved (their digest differs)"
    )


@pytest.mark.parametrize("share", [0.004, 0.2, 0.4, 0.6, 0.8, 0.97])
def test_a_damaged_file_of_a_run_through_fit_is_one_line_and_exit_2(
    small_run: Path, tmp_path: Path, share: float, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    path = run / "checkpoints" / "step=2.ckpt"
    original = load_checkpoint(path)
    data = path.read_bytes()
    position = int(share * len(data))
    while True:  # the first byte from there whose flip the loader refuses
        path.write_bytes(flipped(data, position))
        if outcome(path, original) != "as saved":
            break
        position += 1
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--ckpt_path", str(path), "--trainer.max_steps", "4", *QUIET,
              "--trainer.default_root_dir", str(run)])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert f"--ckpt_path: checkpoint {path}: " in err.strip().splitlines()[-1]
    assert sorted(p.name for p in run.rglob("*")) == sorted(p.name for p in small_run.rglob("*"))
