"""A user's module and DataModule that raise where ``$LIT_SPIKES_TEST_FAIL_AT`` says, as
a module with a bug, a missing file or a refused setting does at fit start
(tests/tools/test_fit_start.py). Without the variable they train as ``DropoutNet`` on
``StepData``; the variable is not an argument, so the run's record is the same either way."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from tests.modules.fit_modules import DropoutNet, StepData

FAIL_AT = "LIT_SPIKES_TEST_FAIL_AT"
"""``<hook>`` or ``<hook>:<global step>`` (the hook raises at that step only)."""
OTHERS_WRITE = "LIT_SPIKES_TEST_OTHERS_WRITE"
"""Set: before the module's ``setup`` fails, another process writes in the run directory
(a note, a TensorBoard folder of its own, an append to ``notes.md``), as a user's notebook
or a second tool may while a requeue starts."""
ANOTHER_PROCESS = """
import pathlib, sys
root = pathlib.Path(sys.argv[1])
(root / "note.txt").write_text("written by another process")
(root / "tb" / "other").mkdir(parents=True)
(root / "tb" / "other" / "events.out.tfevents.1.other.1.0").write_bytes(b"theirs")
with open(root / "notes.md", "a") as notes:
    notes.write("appended by another process\\n")
"""


def fail_at(hook: str, step: int | None = None) -> None:
    where, _, at = os.environ.get(FAIL_AT, "").partition(":")
    if where == hook and (not at or step == int(at)):
        raise RuntimeError(f"planted failure in {hook}")


class FailingNet(DropoutNet):
    def setup(self, stage: str) -> None:
        if os.environ.get(OTHERS_WRITE):
            root = str(self.trainer.default_root_dir)
            subprocess.run([sys.executable, "-c", ANOTHER_PROCESS, root], check=True)
        fail_at("setup")

    def configure_optimizers(self) -> Any:
        fail_at("configure_optimizers")
        return super().configure_optimizers()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        fail_at("on_load_checkpoint")

    def on_train_start(self) -> None:
        fail_at("on_train_start")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        fail_at("training_step", self.global_step)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        fail_at("validation_step")
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))


class FailingData(StepData):
    def setup(self, stage: str) -> None:
        fail_at("data_setup")

    def train_dataloader(self) -> Any:
        fail_at("train_dataloader")
        return super().train_dataloader()

    def val_dataloader(self) -> Any:
        return super().train_dataloader()


class FailingCallback(Callback):
    """A callback of the run's (recorded, so its requeue has it too) refusing at fit start."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        fail_at("callback_setup")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        fail_at("callback_on_train_start")
