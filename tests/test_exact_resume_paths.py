"""ExactResume and check-resume on the paths a Lightning user takes (issue 31, items 1, 2,
3, 9 and 11): two checkpoint callbacks at one step, ExactResume attached from
``configure_callbacks``, ReduceLROnPlateau, a second fit on a trained Trainer, a plain
shuffled loader resumed mid-epoch. Every module here is written for the test.

Module-level, so the command line imports them by class path."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader, TensorDataset

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume
from lit_spikes.testing import assert_resumes_exactly, check_resume
from lit_spikes.testing.record import MODULE, SCHEDULER
from lit_spikes.tools.check_resume import main as check_resume_main

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
# Lightning's own warnings about these small runs: not what these tests are about.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LightningModule.configure_callbacks.*:UserWarning"),
]


def rows(count: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(count, 8, generator=g), torch.randn(count, 1, generator=g))


class ValNet(pl.LightningModule):
    """Dropout, AdamW, validation that logs val_loss; the losses of every step kept."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _two_checkpoints_fit(
    root: Path, shuffle_val: bool, ckpt_path: Path | None = None
) -> tuple[ValNet, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model = ValNet()
    trainer = pl.Trainer(
        **QUIET,
        max_steps=30,
        val_check_interval=10,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[
            ExactResume(),
            ModelCheckpoint(
                dirpath=root / "every", filename="{step}", every_n_train_steps=10, save_top_k=-1
            ),
            ModelCheckpoint(dirpath=root / "best", filename="{step}", monitor="val_loss"),
        ],
    )
    val = DataLoader(rows(32, seed=2), batch_size=8, shuffle=shuffle_val)
    train = StepLoader(rows(), batch_size=4, seed=0)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("shuffle_val", [False, True])
def test_every_file_of_two_checkpoint_callbacks_at_one_step_resumes_exactly(
    tmp_path: Path, shuffle_val: bool
) -> None:
    """Item 1: every/ saves at the step's end, validation draws (a DataLoader iterator's
    seed), best/ saves after it; both files resume to the uninterrupted run bit for bit."""
    reference, _ = _two_checkpoints_fit(tmp_path / "run", shuffle_val)
    assert len(reference.losses) == 30
    for name in ("every", "best"):
        ckpt = tmp_path / "run" / name / "step=10.ckpt"
        assert ckpt.is_file()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*dirpath has changed.*")
            resumed, _ = _two_checkpoints_fit(tmp_path / f"resumed-{name}", shuffle_val, ckpt)
        assert len(resumed.losses) == 20
        pairs = zip(reference.losses[10:], resumed.losses, strict=True)
        for step, (a, b) in enumerate(pairs, start=10):
            assert torch.equal(a, b), f"{name}/step=10.ckpt: the loss of step {step} differs"
        ref_params, res_params = reference.state_dict(), resumed.state_dict()
        assert all(torch.equal(ref_params[k], res_params[k]) for k in ref_params), name


def test_state_dict_calls_at_a_step_boundary_change_nothing() -> None:
    """Item 1: any number of state_dict() calls between two steps return one state, and
    the draws between them do not move it."""
    callback = ExactResume()
    first = callback.state_dict()["rng_by_rank"][0]
    torch.rand(5)  # what a validation between two saves draws
    second = callback.state_dict()["rng_by_rank"][0]
    assert torch.equal(first["torch"], second["torch"])


class DropoutBoring(BoringModel):
    """BoringModel with dropout, attaching ExactResume the Lightning way."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Dropout(0.3), torch.nn.Linear(32, 2))

    def configure_callbacks(self) -> Any:
        return [ExactResume()]


class PlainDropoutBoring(DropoutBoring):
    """The same module with no callbacks of its own (ExactResume comes in callbacks=)."""

    def configure_callbacks(self) -> Any:
        return []


class CountingBoring(DropoutBoring):
    """Broken: a plain attribute that changes the loss and that no checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen += 1
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"] * (1.0 + 0.01 * self.seen)}


def boring_data() -> StepLoader:
    return StepLoader(RandomDataset(32, 256), batch_size=4, seed=0)


class BoringData(pl.LightningDataModule):
    def train_dataloader(self) -> StepLoader:
        return boring_data()


def test_check_resume_passes_exact_resume_from_configure_callbacks() -> None:
    """Item 2: the check passes the module however ExactResume is attached."""
    assert_resumes_exactly(DropoutBoring, boring_data, steps=24, resume_at=9)
    assert_resumes_exactly(
        PlainDropoutBoring, boring_data, lambda: [ExactResume()], steps=24, resume_at=9
    )


def test_check_resume_command_line_passes_configure_callbacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Item 2, through ``lit-spikes check-resume``."""
    argv = ["--model", f"{__name__}.DropoutBoring", "--data", f"{__name__}.BoringData"]
    code = check_resume_main([*argv, "--steps", "24", "--resume_at", "9"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "the resume is exact" in out


def test_check_resume_still_names_a_broken_module_with_configure_callbacks() -> None:
    """Item 2: a module that is really broken still fails, naming what breaks it."""
    report = check_resume(CountingBoring, boring_data, steps=24, resume_at=9)
    assert report.first is not None
    assert report.first.component == MODULE, report.first.describe()
    assert report.first.item == "seen"


class PlateauNet(ValNet):
    """AdamW under ReduceLROnPlateau, returned from configure_optimizers."""

    def __init__(self, interval: str = "step", monitor: str = "train_loss") -> None:
        super().__init__()
        self.interval, self.monitor = interval, monitor

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.9)
        scheduler = {"scheduler": plateau, "interval": self.interval, "monitor": self.monitor}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def plateau_data() -> tuple[StepLoader, DataLoader[Any]]:
    return StepLoader(rows(), batch_size=4, seed=0), DataLoader(rows(32, seed=2), batch_size=8)


@pytest.mark.parametrize(("interval", "monitor"), [("step", "train_loss"), ("epoch", "val_loss")])
def test_exact_resume_warns_of_reduce_lr_on_plateau_before_the_first_step(
    tmp_path: Path, interval: str, monitor: str
) -> None:
    """Item 3: Lightning steps a plateau scheduler after the checkpoint of its step and a
    resume skips that step: ExactResume names it before any step trains."""
    model = PlateauNet(interval, monitor)
    trainer = pl.Trainer(
        **QUIET,
        max_steps=1,
        callbacks=[ExactResume()],
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ExactResume: ReduceLROnPlateau")
        with pytest.raises(UserWarning, match=rf"ReduceLROnPlateau\(interval='{interval}'") as seen:
            trainer.fit(model, train_dataloaders=StepLoader(rows(), batch_size=4, seed=0))
    assert "not resumed exactly by Lightning" in str(seen.value)
    assert "fix:" in str(seen.value)
    assert model.losses == []  # before the first step


@pytest.mark.filterwarnings("ignore:ExactResume. ReduceLROnPlateau")
def test_check_resume_names_reduce_lr_on_plateau_and_its_fix() -> None:
    """Item 3: the check's verdict names ReduceLROnPlateau, not 'return every scheduler
    from configure_optimizers' (the module does)."""
    report = check_resume(PlateauNet, plateau_data, lambda: [ExactResume()], steps=24, resume_at=17)
    assert report.first is not None
    assert report.first.component == SCHEDULER, report.first.describe()
    assert "ReduceLROnPlateau" in report.first.fix
    assert "return every LR scheduler" not in report.first.fix


def test_a_second_fit_on_a_trained_trainer_is_refused(tmp_path: Path) -> None:
    """Item 9: a second fit would go on from step 10 with a fresh optimizer: refused."""
    pl.seed_everything(0, verbose=False)
    model = ValNet()
    trainer = pl.Trainer(
        **QUIET, max_steps=10, callbacks=[ExactResume()], default_root_dir=tmp_path
    )
    trainer.fit(model, train_dataloaders=StepLoader(rows(), batch_size=4, seed=0))
    trainer.fit_loop.epoch_loop.max_steps = 30
    with pytest.raises(RuntimeError, match=r"already trained to step 10.*new Trainer.*ckpt_path"):
        trainer.fit(model, train_dataloaders=StepLoader(rows(), batch_size=4, seed=0))
    assert len(model.losses) == 10  # not one step more


def test_a_second_fit_that_resumes_a_checkpoint_is_not_refused(tmp_path: Path) -> None:
    """Item 9: the refusal is for a fit from the Trainer's leftovers, not a resume."""
    pl.seed_everything(0, verbose=False)
    model = ValNet()
    trainer = pl.Trainer(
        **QUIET, max_steps=10, callbacks=[ExactResume()], default_root_dir=tmp_path
    )
    trainer.fit(model, train_dataloaders=StepLoader(rows(), batch_size=4, seed=0))
    ckpt = tmp_path / "at10.ckpt"
    trainer.save_checkpoint(ckpt)
    trainer.fit_loop.epoch_loop.max_steps = 12
    trainer.fit(model, train_dataloaders=StepLoader(rows(), batch_size=4, seed=0), ckpt_path=ckpt)
    assert len(model.losses) == 12


def _plain_fit(root: Path, loader: Any, steps: int, ckpt_path: Path | None = None) -> ValNet:
    pl.seed_everything(0, verbose=False)
    model = ValNet()
    trainer = pl.Trainer(
        **QUIET,
        max_steps=steps,
        max_epochs=-1,
        callbacks=[
            ExactResume(),
            ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1),
        ],
    )
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return model


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
def test_exact_resume_warns_when_a_shuffled_loader_resumes_mid_epoch(tmp_path: Path) -> None:
    """Item 11: a plain DataLoader(shuffle=True) resumed mid-epoch trains on other batches:
    ExactResume names the loaders that can be positioned."""
    _plain_fit(tmp_path / "a", DataLoader(rows(), batch_size=8, shuffle=True), steps=5)
    with pytest.warns(UserWarning, match="cannot be positioned") as seen:
        _plain_fit(
            tmp_path / "b",
            DataLoader(rows(), batch_size=8, shuffle=True),
            steps=8,
            ckpt_path=tmp_path / "a" / "step=5.ckpt",
        )
    text = next(str(w.message) for w in seen if "cannot be positioned" in str(w.message))
    assert "StepLoader" in text and "StatefulDataLoader" in text


def test_no_position_warning_for_a_step_loader_mid_epoch(tmp_path: Path) -> None:
    """Item 11: a StepLoader is positioned: a mid-epoch resume is exact, no warning."""
    _plain_fit(tmp_path / "a", StepLoader(rows(), batch_size=8, seed=0), steps=5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _plain_fit(
            tmp_path / "b",
            StepLoader(rows(), batch_size=8, seed=0),
            steps=8,
            ckpt_path=tmp_path / "a" / "step=5.ckpt",
        )
    assert not [w for w in seen if "cannot be positioned" in str(w.message)]


def validated_data() -> tuple[StepLoader, DataLoader[Any]]:
    return StepLoader(rows(), batch_size=4, seed=0), DataLoader(
        rows(32, seed=2), batch_size=8, shuffle=True
    )


def test_check_resume_passes_a_validation_that_draws_at_the_resume_step() -> None:
    """Items 1 and 2: validation at the resume step draws from the global RNG after the
    checkpoint; the resume is exact, and so is the check's verdict."""
    assert_resumes_exactly(
        ValNet,
        validated_data,
        lambda: [ExactResume()],
        steps=24,
        resume_at=10,
        trainer_kwargs={"val_check_interval": 5, "check_val_every_n_epoch": None},
        ignore_attributes=("losses",),
    )


def _shuffled(generator: bool = False) -> DataLoader[Any]:
    own = torch.Generator().manual_seed(3) if generator else None
    return DataLoader(rows(), batch_size=8, shuffle=True, generator=own)


@pytest.mark.parametrize("generator", [False, True])
def test_exact_resume_warns_of_a_shuffled_loader_at_an_epoch_end(
    tmp_path: Path, generator: bool
) -> None:
    """Item 11: at an epoch's end the resumed epoch's order is drawn from the global RNG
    before ExactResume restores it, or from the sampler's own generator, which no
    checkpoint holds: not the uninterrupted run's order, and named."""
    reference = _plain_fit(tmp_path / "a", _shuffled(generator), steps=16)
    with pytest.warns(UserWarning, match="at an epoch's start.*cannot be positioned"):
        resumed = _plain_fit(
            tmp_path / "b", _shuffled(generator), steps=16, ckpt_path=tmp_path / "a" / "step=8.ckpt"
        )
    pairs = zip(reference.losses[8:], resumed.losses, strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)


def test_no_position_warning_for_a_sequential_loader_at_an_epoch_end(tmp_path: Path) -> None:
    """Item 11: an unshuffled plain loader restarts at its first batch, as an epoch does."""
    plain = DataLoader(rows(), batch_size=8)
    reference = _plain_fit(tmp_path / "a", plain, steps=16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = _plain_fit(tmp_path / "b", plain, 16, ckpt_path=tmp_path / "a" / "step=8.ckpt")
    assert not [w for w in seen if "cannot be positioned" in str(w.message)]
    assert all(torch.equal(a, b) for a, b in zip(reference.losses[8:], resumed.losses, strict=True))
