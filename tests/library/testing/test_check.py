"""check-resume (issue 24): planted resume faults, each named as its component, through the
``resume_check`` fixture as a user's test calls it; the correct module passes; the pure
comparison, the input checks and the command line.

The modules, data and callbacks are module-level: the new-process check passes them to
the resumed half by import path."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader, TensorDataset

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume
from lit_spikes.testing import (
    COMPONENTS,
    CheckInputError,
    Record,
    ResumeNotExact,
    assert_resumes_exactly,
    check_resume,
    compare,
    format_table,
)
from lit_spikes.testing.record import MODULE, SCHEDULER
from lit_spikes.testing.verdict import NOT_REPRODUCIBLE
from lit_spikes.tools.check_resume import main as check_resume_main
from tests.modules.drawing_runs import NoisyRows
from tests.modules.generator_nets import NETS
from tests.modules.val_nets import PlateauNet, ValNet, val_rows

STEPS, RESUME_AT = 12, 5  # 8 batches an epoch: the resume is mid-epoch


# Lightning's warning at the resumed half of a check on a plain DataLoader, which restarts
# its epoch: the check's own finding ("data") is what these tests are about.
NOT_RESUMABLE = "ignore:You're resuming from a checkpoint that ended before the epoch:UserWarning"


def rows() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))


def step_data() -> StepLoader:
    return StepLoader(rows(), batch_size=8, seed=0)


def shuffled_data() -> DataLoader[Any]:
    return DataLoader(rows(), batch_size=8, shuffle=True)


class Net(pl.LightningModule):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(16, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class DropoutNet(Net):
    def __init__(self) -> None:
        super().__init__(dropout=0.5)


class HandScheduledNet(Net):
    """Steps its scheduler itself; configure_optimizers returns only the optimizer."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        self.schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return optimizer

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.schedule.step()


class ResetsOptimizer(Net):
    def on_train_start(self) -> None:
        for optimizer in self.trainer.optimizers:
            optimizer.state.clear()


class CountBatches(Callback):
    """Keeps state (a count) but has no state_dict."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.batches += 1


class StepData(pl.LightningDataModule):
    def train_dataloader(self) -> StepLoader:
        return step_data()


class ShuffledData(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        return shuffled_data()


def exact() -> list[Callback]:
    return [ExactResume()]


def exact_and_counter() -> list[Callback]:
    return [ExactResume(), CountBatches()]


def _first(resume_check: Any, *args: Any, **kwargs: Any) -> Any:
    kwargs = {"steps": STEPS, "resume_at": RESUME_AT, **kwargs}
    with pytest.raises(ResumeNotExact) as caught:
        resume_check(*args, **kwargs)
    return caught.value


def test_dropout_without_exact_resume_is_rng(resume_check: Any) -> None:
    error = _first(resume_check, DropoutNet, step_data)
    first = error.report.first
    assert (first.component, first.step, first.item) == ("RNG", RESUME_AT, "torch CPU")
    assert "add ExactResume" in str(error)


@pytest.mark.filterwarnings(NOT_RESUMABLE)
def test_shuffled_dataloader_is_data(resume_check: Any) -> None:
    with pytest.warns(UserWarning, match="ExactResume: the train loader .* cannot be positioned"):
        error = _first(resume_check, Net, shuffled_data, exact)
    first = error.report.first
    assert (first.component, first.step) == ("data", RESUME_AT)
    assert "use StepLoader or a stateful sampler" in str(error).replace(
        "(from lit_spikes import StepLoader) ", ""
    )


def test_scheduler_stepped_by_hand_is_lr_scheduler(resume_check: Any) -> None:
    error = _first(resume_check, HandScheduledNet, step_data, exact)
    first = error.report.first
    assert (first.component, first.step) == ("LR scheduler", RESUME_AT)
    assert "`self.schedule` (StepLR)" in first.owner and first.item == "last_epoch"
    assert "return the scheduler `self.schedule` from configure_optimizers" in first.fix


def test_callback_without_state_dict_is_callback(resume_check: Any) -> None:
    error = _first(resume_check, Net, step_data, exact_and_counter)
    first = error.report.first
    assert (first.component, first.step, first.item) == ("callbacks", RESUME_AT, "batches")
    assert (first.uninterrupted, first.resumed) == (RESUME_AT, 0)
    assert "the callback CountBatches keeps state but has no state_dict" in str(error)


class LogsLosses(Net):
    """Keeps a log of its losses in a plain attribute (no training state)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def test_module_attribute_is_module_state_unless_ignored(resume_check: Any) -> None:
    error = _first(resume_check, LogsLosses, step_data, exact)
    first = error.report.first
    assert (first.component, first.owner, first.step) == ("module state", "module attributes", 5)
    assert first.item == "losses" and "ignore_attributes" in first.fix
    arguments = {"steps": STEPS, "resume_at": RESUME_AT, "ignore_attributes": ["losses"]}
    assert resume_check(LogsLosses, step_data, exact, **arguments).exact


def test_optimizer_reset_on_train_start_is_optimizer(resume_check: Any) -> None:
    error = _first(resume_check, ResetsOptimizer, step_data, exact)
    first = error.report.first
    assert (first.component, first.step) == ("optimizer state", RESUME_AT)
    assert first.item.startswith("state of `net.0.weight`") and first.resumed == "absent"


@pytest.mark.parametrize("new_process", [False, True], ids=["same-process", "new-process"])
def test_correct_module_resumes_exactly(resume_check: Any, new_process: bool) -> None:
    report = resume_check(
        DropoutNet, step_data, exact, steps=STEPS, resume_at=RESUME_AT, new_process=new_process
    )
    assert report.exact and all(d is None for d in report.per_component.values())


def _record(steps: int, **changes: Any) -> Record:
    """A hand-made record: every step the same batch, RNG and LR; ``changes`` maps
    ``"step:field"`` to another value."""
    record = Record(final_step=steps)
    for step in range(steps):
        record.steps[step] = {"data": "d", "rng.torch CPU": "r", "lr.optimizer 0 group 0": 0.1}
    for key, value in changes.items():
        at, name = key.split(":")
        record.steps[int(at)][name] = value
    snap = {"optimizer state": {"optimizer 0 (AdamW)": {"state of `w`.exp_avg": torch.ones(2)}}}
    record.at_resume = record.final = snap
    return record


def test_compare_same_records_are_exact() -> None:
    report = compare(_record(6), _record(6), steps=6, resume_at=3)
    assert report.exact and list(report.per_component) == list(COMPONENTS)
    assert all(line.endswith("same") for line in format_table(report).splitlines()[1:])


def test_compare_names_the_cause_before_what_follows_at_one_step() -> None:
    resumed = _record(6, **{"4:rng.torch CPU": "x", "4:data": "y", "5:lr.optimizer 0 group 0": 0.2})
    report = compare(_record(6), resumed, steps=6, resume_at=3)
    assert report.first is not None
    assert (report.first.component, report.first.step) == ("data", 4)
    assert report.per_component["RNG"].step == 4  # type: ignore[union-attr]
    assert report.per_component["LR scheduler"].step == 5  # type: ignore[union-attr]


def test_compare_state_at_resume_step_and_bit_exact_tensors() -> None:
    resumed = _record(6)
    resumed.at_resume = {
        "optimizer state": {"optimizer 0 (AdamW)": {"state of `w`.exp_avg": torch.ones(2).double()}}
    }
    report = compare(_record(6), resumed, steps=6, resume_at=3)
    assert report.first is not None
    assert (report.first.component, report.first.step) == ("optimizer state", 3)
    assert report.first.when == "entering step 3"


def test_compare_a_tensor_of_the_same_shape_and_dtype_differing_in_one_value() -> None:
    """Only the values differ: the comparison is torch.equal, not the shape or the dtype
    (the mutation audit found nothing else guarding it)."""
    resumed = _record(6)
    moment = torch.ones(2)
    moment[1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))  # one ulp away
    resumed.final = {"optimizer state": {"optimizer 0 (AdamW)": {"state of `w`.exp_avg": moment}}}
    report = compare(_record(6), resumed, steps=6, resume_at=3)
    assert report.first is not None and report.first.component == "optimizer state"
    assert (report.first.item, report.first.when) == ("state of `w`.exp_avg", "at the end (step 6)")


class ResetsItsAverage(Net):
    """Keeps an average of its weights in a buffer (saved with the weights) that it starts
    afresh in ``on_train_start``, as if every fit were a new run: the losses of a resumed
    run are the uninterrupted one's (the average is never used in a step), the average
    is not."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("average", torch.zeros_like(self.net[0].weight))

    def on_train_start(self) -> None:
        self.average.copy_(self.net[0].weight.detach())

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)  # (before the step's files: in them)
        self.average.mul_(0.9).add_(self.net[0].weight.detach(), alpha=0.1)


def test_a_buffer_started_afresh_at_the_resume_is_named_though_every_loss_is_equal(
    resume_check: Any,
) -> None:
    error = _first(resume_check, ResetsItsAverage, step_data, exact)
    first = error.report.first
    assert (first.component, first.item, first.step) == ("parameters", "average", RESUME_AT)
    assert error.report.per_component["data"] is None  # the losses were equal throughout


def test_compare_a_step_only_one_run_ran_is_loop_counters() -> None:
    resumed = _record(6)
    del resumed.steps[5]
    report = compare(_record(6), resumed, steps=6, resume_at=3)
    assert report.first is not None
    assert (report.first.component, report.first.step) == ("loop counters", 5)


def test_compare_divergence_without_resume_says_not_reproducible() -> None:
    first_half = _record(3, **{"1:data": "other"})
    report = compare(_record(6), _record(6), steps=6, resume_at=3, first_half=first_half)
    assert report.first is not None
    assert (report.first.component, report.first.step) == ("data", 1)
    assert report.first.fix.startswith(NOT_REPRODUCIBLE)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 5, "resume_at": 5}, "resume_at=5 must be after step 0 and before steps=5"),
        ({"steps": 5, "resume_at": 0}, "resume_at=0 must be after step 0"),
        ({"steps": 5.0, "resume_at": 2}, "must be whole numbers"),
        ({"trainer_kwargs": {"max_steps": 3}}, "trainer_kwargs may not set max_steps"),
        ({"new_process": True, "data": lambda: step_data()}, "define it at module level"),
        ({"callbacks": [ExactResume()]}, "callbacks=[<"),
        ({"ignore_attributes": "history"}, "ignore_attributes='history' must be attribute names"),
        ({"data": None}, "Net has no train_dataloader and no data was given"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    from lit_spikes.testing import assert_resumes_exactly

    arguments: dict[str, Any] = {"data": step_data, "steps": STEPS, "resume_at": RESUME_AT}
    with pytest.raises(CheckInputError) as caught:
        assert_resumes_exactly(Net, **{**arguments, **kwargs}, workdir=tmp_path)
    assert message in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def _cli(*args: str) -> list[str]:
    common = ["--steps", str(STEPS), "--resume_at", str(RESUME_AT)]
    return [*args, *common, "--trainer.accelerator", "cpu"]


def test_cli_exact_resume_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    argv = _cli("--model", f"{__name__}.DropoutNet", "--data", f"{__name__}.StepData")
    status = check_resume_main([*argv, "--trainer.callbacks+=lit_spikes.callbacks.ExactResume"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "the resume is exact" in out and "RNG" in out


@pytest.mark.filterwarnings(NOT_RESUMABLE)
def test_cli_inexact_resume_exits_1_naming_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    # The ExactResume the command adds, as fit does, says the plain loader cannot be positioned
    with pytest.warns(UserWarning, match=r"ExactResume: the train loader .* cannot be positioned"):
        status = check_resume_main(
            _cli("--model", f"{__name__}.Net", "--data", f"{__name__}.ShuffledData")
        )
    out = capsys.readouterr().out
    assert status == 1
    assert "first divergence: data" in out and "likely fix:" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "12", "--resume_at", "5"],  # no --model
        ["--model", "no.such.Module", "--steps", "12", "--resume_at", "5"],
        ["--model", f"{__name__}.Net", "--steps", "5", "--resume_at", "5"],
    ],
    ids=["no-model", "unknown-class", "resume-at-not-before-steps"],
)
def test_cli_usage_error_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert check_resume_main(argv) == 2
    assert "error" in capsys.readouterr().err


SHARED_LOADER = step_data()


def shared_loader() -> StepLoader:
    return SHARED_LOADER


def test_a_factory_that_shares_its_object_between_runs_is_refused(tmp_path: Path) -> None:
    from lit_spikes.testing import assert_resumes_exactly

    with pytest.raises(CheckInputError, match=r"data\(\) returned the same StepLoader object"):
        assert_resumes_exactly(Net, shared_loader, steps=STEPS, resume_at=RESUME_AT)


def test_fixture_comes_from_the_pytest11_entry_point(request: pytest.FixtureRequest) -> None:
    import lit_spikes.testing.plugin

    assert request.config.pluginmanager.get_plugin("lit_spikes") is lit_spikes.testing.plugin


def test_cli_reads_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "check.yaml"
    config.write_text(
        f"model:\n  class_path: {__name__}.DropoutNet\n"
        f"data:\n  class_path: {__name__}.StepData\n"
        "trainer:\n  callbacks:\n    - class_path: lit_spikes.callbacks.ExactResume\n"
    )
    status = check_resume_main(["--config", str(config), "--steps", "12", "--resume_at", "5"])
    assert status == 0, capsys.readouterr().out


def _examples(resume_check: Any, **data: Any) -> Any:
    """The docs' command: 40 steps, resumed at 17 (8 batches an epoch: in the third)."""
    from lit_spikes.testing.examples import Regressor, ShuffledData

    return _first(resume_check, Regressor, _Build(ShuffledData, data), steps=40, resume_at=17)


class _Build:
    """A factory with arguments (picklable, unlike a lambda)."""

    def __init__(self, cls: Any, kwargs: dict[str, Any]) -> None:
        self.cls, self.kwargs = cls, kwargs

    def __call__(self) -> Any:
        return self.cls(**self.kwargs)


@pytest.mark.filterwarnings(NOT_RESUMABLE)
def test_finding_plain_dataloader_with_workers_restarts_the_epoch(resume_check: Any) -> None:
    error = _examples(resume_check, num_workers=2)
    assert (error.report.first.component, error.report.first.step) == ("data", 17)


def test_finding_stateful_dataloader_keeps_the_data_not_the_rng(resume_check: Any) -> None:
    """torchdata is in the dev extra: the README's finding is checked, not skipped."""
    import torchdata.stateful_dataloader  # noqa: F401

    error = _examples(resume_check, num_workers=2, stateful=True)
    differs = [c for c, d in error.report.per_component.items() if d is not None]
    assert differs == ["RNG"] and error.report.first.item == "torch CPU"


def test_the_plugin_imports_no_torch() -> None:
    """pytest imports the plugin in every session of the environment: it must stay light."""
    import subprocess
    import sys

    code = "import sys, lit_spikes.testing.plugin; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# Lightning's own warnings about these small runs: not what these tests are about.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LightningModule.configure_callbacks.*:UserWarning"),
]


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


@pytest.mark.filterwarnings(  # BoringModel's validation_step, trained only
    "ignore:You defined a `validation_step` but have no `val_dataloader`:UserWarning"
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


def plateau_data() -> tuple[StepLoader, DataLoader[Any]]:
    return StepLoader(val_rows(), batch_size=4, seed=0), DataLoader(
        val_rows(32, seed=2), batch_size=8
    )


def quiet_plateau_net() -> PlateauNet:
    model = PlateauNet("epoch", "val_loss")
    model.net[2].p = 0.0  # no dropout: the RNG is not the first difference without ExactResume
    return model


def test_check_resume_names_reduce_lr_on_plateau_and_its_fix() -> None:
    """Item 3: the check's verdict names ReduceLROnPlateau, not 'return every scheduler
    from configure_optimizers' (the module does), and the fix is ExactResume: Lightning
    alone skips the epoch one's update at the end of the first epoch after a resume (16
    batches an epoch)."""
    report = check_resume(
        quiet_plateau_net, plateau_data, list, steps=24, resume_at=8,
        ignore_attributes=("losses",),
    )  # fmt: skip
    assert report.first is not None
    assert report.first.component == SCHEDULER, report.first.describe()
    assert "ReduceLROnPlateau" in report.first.fix and "add ExactResume" in report.first.fix
    assert "return every LR scheduler" not in report.first.fix


@pytest.mark.parametrize(
    ("interval", "resume_at"),
    [("step", 8), ("step", 17), ("epoch", 8), ("epoch", 16), ("epoch", 17)],
)  # validating and not; mid-epoch, an epoch's last batch, the next epoch
def test_reduce_lr_on_plateau_resumes_exactly(interval: str, resume_at: int) -> None:
    """Issue 54: Lightning steps it after the step's files, and a resume skipped that
    update (an epoch one also at the end of the resumed fit's first epoch), with no
    logged metric saved: ExactResume replays it on the metrics its file holds (after the
    step's validation: every 4 steps)."""
    monitor = "train_loss" if interval == "step" else "val_loss"
    assert_resumes_exactly(
        lambda: PlateauNet(interval, monitor), plateau_data, lambda: [ExactResume()],
        steps=24, resume_at=resume_at, ignore_attributes=("losses",),
        trainer_kwargs={"val_check_interval": 4, "check_val_every_n_epoch": None},
    )  # fmt: skip


def validated_data() -> tuple[StepLoader, DataLoader[Any]]:
    return StepLoader(val_rows(), batch_size=4, seed=0), DataLoader(
        val_rows(32, seed=2), batch_size=8, shuffle=True
    )


@pytest.mark.filterwarnings(
    "ignore:Your `val_dataloader`'s sampler has shuffling enabled:UserWarning"
)  # what it tests
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


class GeneratorOwner(Net):
    """Noise from a torch.Generator of its own (issue 53: check-resume said "training_step's
    output" and never named it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return super().training_step((x + torch.randn(x.shape, generator=self.gen), y), batch_idx)


class AugmentedRows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``rows()`` with noise drawn at each read (a flip or crop's kind)."""

    def __init__(self) -> None:
        self.rows = rows()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.rows[i]
        return x + 0.1 * torch.randn(x.shape), y


def augmented_data() -> StepLoader:
    return StepLoader(AugmentedRows(), batch_size=8, seed=0)


def test_a_modules_generator_is_named_and_exact_resume_keys_it() -> None:
    report = check_resume(GeneratorOwner, step_data, steps=STEPS, resume_at=RESUME_AT)
    assert report.first is not None and report.first.component == "RNG"
    assert "torch.Generator 'gen' of the module" in report.first.item
    exact_report = check_resume(GeneratorOwner, step_data, exact, steps=STEPS, resume_at=RESUME_AT)
    assert exact_report.exact, exact_report.first


LOGS = ("losses", "validations", "hook_draws")
"""What a DrawingNet keeps of the steps it trained (no training state)."""


def drawing_rows() -> StepLoader:
    return StepLoader(NoisyRows(augment=False), batch_size=8, seed=5)


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
@pytest.mark.parametrize("holding", ["a numpy Generator", "a torch.Generator in a list"])
def test_any_generator_of_the_modules_is_named_with_its_fix(holding: str) -> None:
    """Issue 62: a NumPy Generator attribute, a torch.Generator in a list: check-resume
    said "module state: training_step's output" and advised deterministic=True. It names
    the generator and the fix (ExactResume, the generator made in __init__), and with
    ExactResume the resume is exact."""
    net = functools.partial(NETS[holding], frozenset())  # its generator alone draws
    report = check_resume(net, drawing_rows, steps=STEPS, resume_at=RESUME_AT)
    assert report.first is not None and report.first.component == "RNG"
    path = "'rng' of the module" if "numpy" in holding else "'rngs[0]' of the module"
    assert report.first.item.endswith(path), report.first.item
    assert "add ExactResume" in report.first.fix and "__init__ or setup" in report.first.fix
    assert "deterministic=True" not in report.first.fix
    exact_report = check_resume(
        net, drawing_rows, exact, steps=STEPS, resume_at=RESUME_AT, ignore_attributes=LOGS
    )
    assert exact_report.exact, exact_report.first


def test_augmentation_in_a_step_loaders_dataset_resumes_exactly() -> None:
    """Issue 53: check-resume said "data differs" and advised StepLoader, which the
    module used: the rows are now read with keyed RNGs."""
    assert_resumes_exactly(DropoutNet, augmented_data, exact, steps=STEPS, resume_at=RESUME_AT)


def test_the_command_names_a_numpy_generator_and_its_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 62, from the command line: without ExactResume the first divergence is the
    module's NumPy Generator, with the fix; with it (added, as fit adds it) the resume is
    exact."""
    model = "tests.modules.generator_nets.QuietNumpyNet"
    data = "tests.modules.drawing_runs.DrawingData"
    argv = _cli("--model", model, "--data", data, "--ignore_attributes", f"[{', '.join(LOGS)}]")
    before = torch.get_num_threads()
    try:
        assert check_resume_main([*argv, "--exact_resume", "false"]) == 1
        out = capsys.readouterr().out
        assert "first divergence: RNG: RNG streams, numpy Generator 'rng' of the module" in out
        assert "likely fix: the module's numpy Generator 'rng' draws otherwise" in out
        assert check_resume_main(argv) == 0
        assert "the resume is exact" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)  # the command sets the process's threads


def test_the_command_sets_a_module_up_as_fit_does(capsys: pytest.CaptureFixture[str]) -> None:
    """A user's module with dropout and no ExactResume of its own: ``lit-spikes fit`` adds
    one and resumes it exactly (tools/test_fit_own_module.py), so the check passes it too,
    on one thread, saying both; ``--exact_resume false`` checks it as a plain Trainer runs
    it, and its dropout then draws otherwise after the resume."""
    from tests.modules.fit_modules import DropoutNet as FitNet  # fit's own test module

    argv = _cli("--model", f"{FitNet.__module__}.DropoutNet", "--data", f"{__name__}.StepData")
    before = torch.get_num_threads()
    try:
        _check_as_fit(argv, capsys)
    finally:
        torch.set_num_threads(before)  # the command sets the process's threads


def _check_as_fit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(2)
    assert check_resume_main(argv) == 0, capsys.readouterr().out
    captured = capsys.readouterr()
    assert "the resume is exact" in captured.out
    assert "1 torch thread(s) (--num_threads); ExactResume added" in captured.err
    assert torch.get_num_threads() == 1
    assert check_resume_main([*argv, "--exact_resume", "false", "--num_threads", "2"]) == 1
    captured = capsys.readouterr()
    assert "2 torch thread(s) (--num_threads); no ExactResume added" in captured.err
    assert "first divergence" in captured.out
    assert check_resume_main([*argv, "--num_threads", "0"]) == 2
    assert "--num_threads=0 must be >= 1" in capsys.readouterr().err
