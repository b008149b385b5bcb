"""Host reads made by lit-spikes' own code while training: on a GPU each one stalls the
host until the step's kernels are done, so the callbacks keep what they watch on the
device and read it back at most once every 50 steps in steady state.

Counted with a ``TorchFunctionMode``: ``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool()``, ``float()`` and ``int()`` of a tensor while a frame of the
project's package (``lit_spikes/``, ``callbacks/``) is on the stack; what the user's module
and Lightning itself read is theirs. The project's own ``TinyGPTModule`` is ours: its
records, its non-finite guard and its logging keep to the same budget.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, SkipStep, SpikeDetector, watch
from lit_spikes.demo import module
from lit_spikes.demo.data import StepDataModule
from lit_spikes.demo.model import TinyGPT
from lit_spikes.demo.module import TinyGPTModule
from lit_spikes.shared.tb import RunLogger
from tests.conftest import REPO, TINY_DATA, TINY_GPT, TINY_OPTIM, tb_scalars
from tests.modules.user_modules import LoggingRegressor, regression_data

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
    """Counts host reads of tensors made while the project's code is on the stack (or
    anywhere: ``everywhere``, Lightning's too)."""

    def __init__(self, everywhere: bool = False) -> None:
        super().__init__()
        self.count, self.counting, self.everywhere = 0, False, everywhere

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counting and func in READS and (self.everywhere or _from_our_code()):
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


def our_reads(tmp_path: Path, tiny_gpt: bool = False) -> int:
    """Host reads from lit-spikes' code over the steady steps of a run with the
    detector, the skip-step, ExactResume and a TensorBoard logger on: of a user's
    module, or of ``TinyGPTModule`` (its own callbacks too, from configure_callbacks)."""
    mode = HostReads()
    # Not TinyGPTModule's train/loss: it is on the progress bar, and Lightning turns every
    # progress-bar value into a float whenever callback_metrics is read (one read a step).
    monitor = ["loss", "grad_norm"] if tiny_gpt else ["loss", "train_loss", "grad_norm"]
    callbacks = [
        _Steady(mode),
        SpikeDetector(monitor=monitor),
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
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    with mode:
        if tiny_gpt:
            gpt = TinyGPTModule(gpt=TINY_GPT, optim=replace(TINY_OPTIM, max_steps=STEPS))
            gpt.nonfinite_guard = "device"  # as on an accelerator ("auto" reads on a CPU)
            trainer.fit(gpt, datamodule=StepDataModule(TINY_DATA))
        else:
            loader = StepLoader(regression_data(rows=4096), batch_size=8)
            trainer.fit(LoggingRegressor(), train_dataloaders=loader)
    assert trainer.global_step == STEPS
    return mode.count


def test_our_callbacks_read_the_host_at_most_once_every_50_steps(tmp_path: Path) -> None:
    reads = our_reads(tmp_path)
    assert reads <= (STEPS - STEADY) // 50, f"{reads} host reads in {STEPS - STEADY} steps"


def test_tiny_gpt_module_reads_the_host_at_most_once_every_50_steps(tmp_path: Path) -> None:
    """Its records, non-finite guard and logging too; the loggers still get every step's
    scalars, at its step."""
    reads = our_reads(tmp_path, tiny_gpt=True)
    assert reads <= (STEPS - STEADY) // 50, f"{reads} host reads in {STEPS - STEADY} steps"
    scalars = tb_scalars(tmp_path / "run")
    for tag in ("train/loss", "train/max_logit", "lr", "grad_norm", "data/position"):
        assert [step for step, _ in scalars[tag]] == list(range(STEPS)), tag


def test_a_read_added_to_the_modules_step_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control for the module: an ``.item()`` of the loss in its
    ``_record``, compiled under module.py's name, is seen at every step."""
    original = TinyGPTModule._record
    source = "def _record(self, loss, *args):\n    loss.item()\n    original(self, loss, *args)\n"
    namespace: dict[str, Any] = {"original": original}
    exec(compile(source, module.__file__, "exec"), namespace)
    monkeypatch.setattr(TinyGPTModule, "_record", namespace["_record"])
    assert our_reads(tmp_path, tiny_gpt=True) >= STEPS - STEADY


def test_a_read_added_to_a_callbacks_step_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: an ``.item()`` on the watchers' per-step path, written into
    the package's own file (compiled under its name), is seen at every step."""
    original = watch.note_loss
    source = "def note_loss(trainer, loss):\n    loss.item()\n    original(trainer, loss)\n"
    namespace: dict[str, Any] = {"original": original}
    exec(compile(source, watch.__file__, "exec"), namespace)
    monkeypatch.setattr(watch, "note_loss", namespace["note_loss"])
    assert our_reads(tmp_path) >= 2 * (STEPS - STEADY)  # two watchers, one read each a step


@pytest.mark.parametrize("fault", ["nan_loss", "nan_grad"])
def test_the_device_guard_drops_a_non_finite_update_as_the_host_guard_does(
    tmp_path: Path, fault: str
) -> None:
    """The masked step (no read, as on an accelerator) ends with the same weights, AdamW
    state and skipped steps as dropping the gradients after a read (a CPU's default)."""
    from lit_spikes.shared.training import RunSpec
    from tests.conftest import (
        NaNAtStepModule,  # finite forward, NaN backward at step 12
        NaNLossModule,
    )

    runs = {}
    for guard in ("host", "device"):
        if fault == "nan_loss":
            module: TinyGPTModule = NaNLossModule(gpt=TINY_GPT, optim=TINY_OPTIM, nan_step=5)
        else:
            module = NaNAtStepModule(gpt=TINY_GPT, optim=TINY_OPTIM)
        module.nonfinite_guard = guard
        spec = RunSpec(
            tmp_path, guard, 14, progress_bar=False, trainer_kwargs={"limit_val_batches": 0}
        )
        trainer = spec.trainer()
        with pytest.warns(UserWarning, match="its update is skipped"):
            trainer.fit(module, datamodule=StepDataModule(TINY_DATA))
        optimizer = trainer.optimizers[0].state_dict()["state"]
        runs[guard] = (module.state_dict(), optimizer, module.nonfinite_steps)
    (weights, state, skipped), (weights_d, state_d, skipped_d) = runs["host"], runs["device"]
    assert skipped == skipped_d and len(skipped) == 1
    for key, value in weights.items():
        assert torch.equal(value, weights_d[key]), key
    for index, entry in state.items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_d[index][name])), name


class MinimalGPT(pl.LightningModule):
    """The same model, trained by the least a user would write: no logging at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(TINY_GPT)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(batch["x"], batch["y"]).loss
        assert loss is not None
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def all_reads(tmp_path: Path, module: pl.LightningModule, steps: int) -> int:
    """Every host read (Lightning's too) over the steady steps of a plain Trainer."""
    mode = HostReads(everywhere=True)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Steady(mode)],
        limit_val_batches=0,
    )
    with mode:
        trainer.fit(module, datamodule=StepDataModule(TINY_DATA))
    return mode.count


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore:You passed in a `val_dataloader` but have no `validation_step`:UserWarning"
)  # a bare module beside the demo's
def test_tiny_gpt_module_adds_no_per_step_read_to_lightnings_own(tmp_path: Path) -> None:
    """Counted everywhere, against a minimal module on the same model: Lightning turns every
    progress-bar tensor into a float at every step, so the module's loss reaches the bar
    as the float read back with its records (every 50 steps), not as a logged tensor."""
    steps = STEADY + 100
    gpt = TinyGPTModule(gpt=TINY_GPT, optim=replace(TINY_OPTIM, max_steps=steps))
    gpt.nonfinite_guard = "device"  # as on an accelerator ("auto" reads on a CPU)
    extra = all_reads(tmp_path / "gpt", gpt, steps)
    extra -= all_reads(tmp_path / "minimal", MinimalGPT(), steps)
    assert extra <= (steps - STEADY) // 50, f"{extra} more host reads in {steps - STEADY} steps"
    shown = gpt.trainer.progress_bar_metrics["train/loss"]
    assert shown == gpt.history[-1]["loss"]  # the last step's loss, as a plain float


@pytest.mark.filterwarnings("ignore:The number of training batches:UserWarning")  # (12 < 50)
def test_training_curves_read_the_host_once_per_logging_step(tmp_path: Path) -> None:
    """``lr`` and ``grad_norm`` of a user's module: one read per ``log_every_n_steps``,
    none in between (the norm stays on the device until its logging step)."""
    from lit_spikes.callbacks import TrainingCurves

    mode, steps = HostReads(), STEADY + 100
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        accelerator="cpu",
        logger=RunLogger(save_dir=str(tmp_path), name="run", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Steady(mode), TrainingCurves()],
        log_every_n_steps=50,
    )
    with mode:
        # A plain DataLoader: StepLoader's own reads (its permutation, once an epoch) aside
        trainer.fit(LoggingRegressor(), train_dataloaders=DataLoader(regression_data(), 8))
    assert 1 <= mode.count <= (steps - STEADY) // 50, mode.count
    assert [step for step, _ in tb_scalars(tmp_path / "run")["grad_norm"]] == [49, 99, 149]
