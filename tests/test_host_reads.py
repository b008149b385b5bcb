"""Host reads made by lit-spikes' own code while training: on a GPU each one stalls the
host until the step's kernels are done, so the callbacks keep what they watch on the
device and read it back at most once every 50 steps in steady state.

Counted with a ``TorchFunctionMode``: ``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool()``, ``float()`` and ``int()`` of a tensor while a frame of the
project's package (``lit_spikes/``, ``callbacks/``) is on the stack; what the user's module
and Lightning itself read is theirs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.overrides import TorchFunctionMode

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, SkipStep, SpikeDetector, _watch
from lit_spikes.tb import RunLogger
from tests.conftest import REPO
from tests.user_modules import LoggingRegressor, regression_data

OURS = (str(REPO / "lit_spikes") + "/", str(REPO / "callbacks") + "/")
READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
}
STEPS, STEADY = 250, 50


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors made while the project's code is on the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.counting = 0, False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counting and func in READS and _from_our_code():
            self.count += 1
        return func(*args, **(kwargs or {}))


def _from_our_code() -> bool:
    frame = sys._getframe(2)  # the one public way to see the stack without building it
    while frame is not None:
        if frame.f_code.co_filename.startswith(OURS):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Steady(Callback):
    """Counts from step STEADY on (after the warm-up windows filled)."""

    def __init__(self, mode: HostReads) -> None:
        self.mode = mode

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.mode.counting = trainer.global_step >= STEADY

    def on_train_end(self, *args: Any) -> None:
        self.mode.counting = False  # the fit's end reads what is pending: no steady step


def our_reads(tmp_path: Path) -> int:
    """Host reads from lit-spikes' code over the steady steps of a run with the
    detector, the skip-step, ExactResume and a TensorBoard logger on."""
    mode = HostReads()
    callbacks = [
        _Steady(mode),
        SpikeDetector(monitor=["loss", "train_loss", "grad_norm"]),
        SkipStep(monitor="loss", window=16),
        ExactResume(),
    ]
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=STEPS,
        accelerator="cpu",
        logger=RunLogger(save_dir=str(tmp_path), name="run", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    loader = StepLoader(regression_data(rows=4096), batch_size=8)
    with mode:
        trainer.fit(LoggingRegressor(), train_dataloaders=loader)
    assert trainer.global_step == STEPS
    return mode.count


def test_our_callbacks_read_the_host_at_most_once_every_50_steps(tmp_path: Path) -> None:
    reads = our_reads(tmp_path)
    assert reads <= (STEPS - STEADY) // 50, f"{reads} host reads in {STEPS - STEADY} steps"


def test_a_read_added_to_a_callbacks_step_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: an ``.item()`` on the watchers' per-step path, written into
    the package's own file (compiled under its name), is seen at every step."""
    original = _watch.note_loss
    source = "def note_loss(trainer, loss):\n    loss.item()\n    original(trainer, loss)\n"
    namespace: dict[str, Any] = {"original": original}
    exec(compile(source, _watch.__file__, "exec"), namespace)
    monkeypatch.setattr(_watch, "note_loss", namespace["note_loss"])
    assert our_reads(tmp_path) >= 2 * (STEPS - STEADY)  # two watchers, one read each a step
