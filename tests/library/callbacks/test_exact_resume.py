"""``ExactResume``: a resume from a real ``.ckpt`` equals the uninterrupted run (RNGs,
dropout, a crash checkpoint, every CPU precision, CUDA), on modules written for the tests,
and its warnings on the paths a Lightning user takes (two checkpoint callbacks,
ReduceLROnPlateau, a second fit, shuffled loaders, another precision or clipping)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, SkipStep
from lit_spikes.callbacks.fingerprint import fingerprint
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import (
    REPO,
    fit,
)
from tests.modules.guarantee_modules import (
    DrawingRegressor,
    MomentumRegressor,
    seed_all,
)
from tests.modules.guarantee_runs import (
    GUARANTEE_STEPS,
    guarantee_differences,
    same_inputs,
    train_guarded,
)
from tests.modules.plain_runs import (
    BATCH,
    RESUME_AT,
    STEPS,
    loader,
    resume_pair,
    states_equal,
    train,
)
from tests.modules.user_modules import (
    DropoutRegressor,
    LoggingRegressor,
    regression_data,
)
from tests.modules.val_nets import ValNet, val_rows

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


# Lightning's own warnings about these small runs: not what these tests are about.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    # ValNet and PlateauNet validate where a test gives them a loader; most train only
    pytest.mark.filterwarnings(
        "ignore:You defined a `validation_step` but have no `val_dataloader`:UserWarning"
    ),
    pytest.mark.filterwarnings("ignore:.*LightningModule.configure_callbacks.*:UserWarning"),
]


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
    val = DataLoader(val_rows(32, seed=2), batch_size=8, shuffle=shuffle_val)
    train = StepLoader(val_rows(), batch_size=4, seed=0)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.filterwarnings(
    "ignore:Your `val_dataloader`'s sampler has shuffling enabled:UserWarning"
)  # what it tests
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
    """Item 1: any number of state_dict() calls between two steps return one state (the
    run's seed, by rank), and neither draws nor a reseeding between them move it."""
    torch.manual_seed(7)
    callback = ExactResume()
    first = callback.state_dict()["seed_by_rank"]
    torch.rand(5)  # what a validation between two saves draws
    torch.manual_seed(8)  # a hook that seeds
    assert callback.state_dict()["seed_by_rank"] == first == [7]


def test_a_second_fit_on_a_trained_trainer_is_refused(tmp_path: Path) -> None:
    """Item 9: a second fit would go on from step 10 with a fresh optimizer: refused."""
    pl.seed_everything(0, verbose=False)
    model = ValNet()
    trainer = pl.Trainer(
        **QUIET, max_steps=10, callbacks=[ExactResume()], default_root_dir=tmp_path
    )
    trainer.fit(model, train_dataloaders=StepLoader(val_rows(), batch_size=4, seed=0))
    trainer.fit_loop.epoch_loop.max_steps = 30
    with pytest.raises(RuntimeError, match=r"already trained to step 10.*new Trainer.*ckpt_path"):
        trainer.fit(model, train_dataloaders=StepLoader(val_rows(), batch_size=4, seed=0))
    assert len(model.losses) == 10  # not one step more


def test_a_second_fit_that_resumes_a_checkpoint_is_not_refused(tmp_path: Path) -> None:
    """Item 9: the refusal is for a fit from the Trainer's leftovers, not a resume."""
    pl.seed_everything(0, verbose=False)
    model = ValNet()
    trainer = pl.Trainer(
        **QUIET, max_steps=10, callbacks=[ExactResume()], default_root_dir=tmp_path
    )
    trainer.fit(model, train_dataloaders=StepLoader(val_rows(), batch_size=4, seed=0))
    ckpt = tmp_path / "at10.ckpt"
    trainer.save_checkpoint(ckpt)
    trainer.fit_loop.epoch_loop.max_steps = 12
    trainer.fit(
        model, train_dataloaders=StepLoader(val_rows(), batch_size=4, seed=0), ckpt_path=ckpt
    )
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
    _plain_fit(tmp_path / "a", DataLoader(val_rows(), batch_size=8, shuffle=True), steps=5)
    with pytest.warns(UserWarning, match="cannot be positioned") as seen:
        _plain_fit(
            tmp_path / "b",
            DataLoader(val_rows(), batch_size=8, shuffle=True),
            steps=8,
            ckpt_path=tmp_path / "a" / "step=5.ckpt",
        )
    text = next(str(w.message) for w in seen if "cannot be positioned" in str(w.message))
    assert "StepLoader" in text and "StatefulDataLoader" in text


def test_no_position_warning_for_a_step_loader_mid_epoch(tmp_path: Path) -> None:
    """Item 11: a StepLoader is positioned: a mid-epoch resume is exact, no warning."""
    _plain_fit(tmp_path / "a", StepLoader(val_rows(), batch_size=8, seed=0), steps=5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _plain_fit(
            tmp_path / "b",
            StepLoader(val_rows(), batch_size=8, seed=0),
            steps=8,
            ckpt_path=tmp_path / "a" / "step=5.ckpt",
        )
    assert not [w for w in seen if "cannot be positioned" in str(w.message)]


def _shuffled(generator: bool = False) -> DataLoader[Any]:
    own = torch.Generator().manual_seed(3) if generator else None
    return DataLoader(val_rows(), batch_size=8, shuffle=True, generator=own)


@pytest.mark.parametrize("generator", [False, True])
def test_a_shuffled_loader_at_an_epoch_end_resumes_exactly(tmp_path: Path, generator: bool) -> None:
    """Item 11, issue 62: the resumed epoch's iterator is built anew after the epoch's
    keying, as the run built it, so its order is the run's (drawn from the global RNG, or
    from the loader's own generator, keyed from its seed), unwarned."""
    reference = _plain_fit(tmp_path / "a", _shuffled(generator), steps=16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = _plain_fit(
            tmp_path / "b", _shuffled(generator), steps=16, ckpt_path=tmp_path / "a" / "step=8.ckpt"
        )
    assert not [w for w in seen if "ExactResume" in str(w.message)]
    pairs = zip(reference.losses[8:], resumed.losses, strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_no_position_warning_for_a_sequential_loader_at_an_epoch_end(tmp_path: Path) -> None:
    """Item 11: an unshuffled plain loader restarts at its first batch, as an epoch does."""
    plain = DataLoader(val_rows(), batch_size=8)
    reference = _plain_fit(tmp_path / "a", plain, steps=16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = _plain_fit(tmp_path / "b", plain, 16, ckpt_path=tmp_path / "a" / "step=8.ckpt")
    assert not [w for w in seen if "cannot be positioned" in str(w.message)]
    assert all(torch.equal(a, b) for a, b in zip(reference.losses[8:], resumed.losses, strict=True))


@pytest.mark.parametrize("module", [DropoutRegressor, LoggingRegressor])
def test_a_resume_from_a_ckpt_equals_the_uninterrupted_run(
    tmp_path: Path, module: type[pl.LightningModule]
) -> None:
    whole, resumed = resume_pair(tmp_path, module, loader)
    assert states_equal(whole, resumed) == []
    assert whole.lightning_module.losses[RESUME_AT:] == resumed.lightning_module.losses


def test_a_file_holding_rng_states_of_an_earlier_version_resumes_with_a_warning(
    tmp_path: Path,
) -> None:
    """Files written before the per-step seeds hold RNG states: they still resume (the
    weights, the optimizer, the step), saying that the draws are not the old run's."""
    train(tmp_path / "b", DropoutRegressor(), loader(), RESUME_AT, [ExactResume()])
    path = tmp_path / "b" / f"step={RESUME_AT}.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["callbacks"]["ExactResume{}"]
    for key in ("seed_by_rank", "generator_seeds_by_rank"):
        del state[key]
    state["rng_by_rank"] = [{"torch": torch.get_rng_state()}]
    torch.save(checkpoint, path)
    with pytest.warns(UserWarning, match="RNG states of an earlier lit-spikes"):
        resumed = train(tmp_path / "c", DropoutRegressor(), loader(), STEPS, [ExactResume()], path)
    assert resumed.global_step == STEPS


class ValidationDraws(DropoutRegressor):
    """Validates on a shuffled loader and draws in validation_step (as a VAE does)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        noise = 0.01 * torch.randn_like(x)
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x + noise), y))

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(regression_data(seed=1), BATCH, shuffle=True)


class StartDraws(DropoutRegressor):
    def on_train_start(self) -> None:
        torch.rand(3)  # after ExactResume's own on_train_start


class FailsOnce(DropoutRegressor):
    """Raises in the training step of step 12, once: OnExceptionCheckpoint saves there."""

    failed = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 12 and not FailsOnce.failed:
            FailsOnce.failed = True
            torch.rand(5)  # a draw of the failing step before it fails
            raise RuntimeError("planted")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("module", "resume_at", "kwargs"),
    [
        pytest.param(
            ValidationDraws,
            10,
            {"val_check_interval": 5, "check_val_every_n_epoch": None},
            # the shuffled validation loader, whose order draws from the RNG, is the point
            marks=pytest.mark.filterwarnings(
                "ignore:Your `val_dataloader`'s sampler has shuf:UserWarning"
            ),
        ),
        (StartDraws, RESUME_AT, {}),
    ],
)
def test_draws_between_a_checkpoint_and_the_next_step_do_not_break_the_resume(
    tmp_path: Path, module: type[pl.LightningModule], resume_at: int, kwargs: dict[str, Any]
) -> None:
    """A validation at the checkpoint's step (Lightning's resume skips it) or a hook at the
    fit's start drew from the RNG the resumed run restored: it trained on other masks."""
    whole, resumed = resume_pair(tmp_path, module, loader, resume_at=resume_at, **kwargs)
    assert states_equal(whole, resumed) == []


# With an OnExceptionCheckpoint, Lightning takes a fresh fit's ckpt_path=None for "last" (of
# which the failing run has none yet): two warnings about what is here a first fit.
@pytest.mark.filterwarnings(
    "ignore:`.fit\\(ckpt_path=None\\)` was called without a model:UserWarning"
)
@pytest.mark.filterwarnings(
    'ignore:.fit\\(ckpt_path="last"\\) is set, but there is no last:UserWarning'
)
def test_a_checkpoint_saved_inside_a_failing_step_resumes_that_step(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    whole = train(tmp_path / "a", DropoutRegressor(), loader(), 20, [ExactResume()])
    saver = OnExceptionCheckpoint(tmp_path / "b", filename="failed")
    with pytest.raises(RuntimeError, match="planted"):
        train(tmp_path / "b", FailsOnce(), loader(), 20, [ExactResume(), saver])
    ckpt = tmp_path / "b" / "failed.ckpt"
    resumed = train(tmp_path / "c", DropoutRegressor(), loader(), 20, [ExactResume()], ckpt)
    assert states_equal(whole, resumed) == []


def test_without_exact_resume_dropout_resumes_otherwise(tmp_path: Path) -> None:
    """The negative control: the same pair without ExactResume draws other dropout masks."""
    whole, resumed = resume_pair(tmp_path, DropoutRegressor, loader, callbacks=lambda: [])
    assert states_equal(whole, resumed) != []


def test_a_resume_in_a_new_process_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    whole = train(tmp_path / "a", DropoutRegressor(), loader(), STEPS, [ExactResume()])
    train(tmp_path / "b", DropoutRegressor(), loader(), RESUME_AT, [ExactResume()])
    out = tmp_path / "resumed.pt"
    script = f"""
import torch
torch.set_num_threads({torch.get_num_threads()})
from tests.modules.plain_runs import loader, train
from tests.modules.user_modules import DropoutRegressor
from lit_spikes.callbacks import ExactResume
from pathlib import Path
run = train(Path({str(tmp_path / "c")!r}), DropoutRegressor(), loader(), {STEPS}, [ExactResume()],
            Path({str(tmp_path / "b" / f"step={RESUME_AT}.ckpt")!r}))
torch.save({{"state": run.lightning_module.state_dict(), "losses": run.lightning_module.losses}},
           {str(out)!r})
"""
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=120)
    saved = torch.load(out, weights_only=True)
    module = whole.lightning_module
    assert all(torch.equal(v, saved["state"][k]) for k, v in module.state_dict().items())
    assert saved["losses"] == module.losses[RESUME_AT:]


PRECISIONS = [
    ("64-true", DropoutRegressor),
    ("32-true", DropoutRegressor),
    ("bf16-mixed", DropoutRegressor),
    ("bf16-true", DropoutRegressor),
    ("16-true", LoggingRegressor),  # AdamW's eps underflows in float16: SGD instead
]


@pytest.mark.parametrize(("precision", "module"), PRECISIONS)
def test_every_cpu_precision_resumes_bit_exactly(
    tmp_path: Path, precision: str, module: type[pl.LightningModule]
) -> None:
    """A 64-true resume rounded the weights to float32 (Lightning loads them before its
    precision plugin converts the module): 159 of 212 tensors differed."""
    whole, resumed = resume_pair(tmp_path, module, loader, precision=precision)
    assert states_equal(whole, resumed) == []
    assert (
        next(resumed.lightning_module.parameters()).dtype
        == next(whole.lightning_module.parameters()).dtype
    )


def test_a_resume_draws_from_random_numpy_and_torch_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    seed_all(1)
    whole = train_guarded(tmp_path / "a", DrawingRegressor(), GUARANTEE_STEPS, [ExactResume()])
    seed_all(1)
    train_guarded(tmp_path / "b", DrawingRegressor(), 7, [ExactResume()])
    seed_all(99)  # this process's RNGs are elsewhere now: only the checkpoint's count
    resumed = train_guarded(
        tmp_path / "c",
        DrawingRegressor(),
        GUARANTEE_STEPS,
        [ExactResume()],
        tmp_path / "b" / "step=7.ckpt",
    )
    drawn, again = whole.lightning_module.draws, resumed.lightning_module.draws
    assert [drawn[s] for s in range(7, GUARANTEE_STEPS)] == [
        again[s] for s in range(7, GUARANTEE_STEPS)
    ]
    assert guarantee_differences(whole, resumed) == []


RESUME_IN_A_NEW_PROCESS = """
import sys, torch
from pathlib import Path
torch.set_num_threads({threads})
from lit_spikes.callbacks import ExactResume
from tests.modules.guarantee_modules import DrawingRegressor
from tests.modules.guarantee_runs import train_guarded as train
run = train(Path(sys.argv[1]), DrawingRegressor(), {steps}, [ExactResume()], Path(sys.argv[2]))
state = dict(run.lightning_module.state_dict())
state.update({{f"draw.{{s}}": torch.tensor(d) for s, d in run.lightning_module.draws.items()}})
torch.save(state, sys.argv[3])
"""


def test_a_resume_in_a_new_process_draws_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """A new process seeds Python's and NumPy's RNGs from the OS: only the checkpoint's
    states make its draws the uninterrupted run's."""
    seed_all(2)
    whole = train_guarded(tmp_path / "a", DrawingRegressor(), GUARANTEE_STEPS, [ExactResume()])
    seed_all(2)
    train_guarded(tmp_path / "b", DrawingRegressor(), 9, [ExactResume()])
    script = RESUME_IN_A_NEW_PROCESS.format(threads=torch.get_num_threads(), steps=GUARANTEE_STEPS)
    out = tmp_path / "resumed.pt"
    args = [str(tmp_path / "c"), str(tmp_path / "b" / "step=9.ckpt"), str(out)]
    subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, check=True, timeout=300)
    saved = torch.load(out, weights_only=True)
    module = whole.lightning_module
    for step in range(9, GUARANTEE_STEPS):
        assert torch.equal(saved[f"draw.{step}"], torch.tensor(module.draws[step])), step
    assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())


class _FailsOnce(MomentumRegressor):
    failed = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 9 and not _FailsOnce.failed:
            _FailsOnce.failed = True
            raise RuntimeError("planted")
        return super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore:`.fit\\(ckpt_path=None\\)` was called without:UserWarning")
@pytest.mark.filterwarnings('ignore:.fit\\(ckpt_path="last"\\) is set, but there is no:UserWarning')
def test_a_crash_checkpoint_resumes_the_step_that_failed(tmp_path: Path) -> None:
    """A checkpoint written inside a failing step holds a loader one batch ahead of the
    global step: the resume must train_guarded that step on its own batch."""
    whole = train_guarded(tmp_path / "a", MomentumRegressor(), GUARANTEE_STEPS, [ExactResume()])
    saver = OnExceptionCheckpoint(tmp_path / "b", filename="failed")
    with pytest.raises(RuntimeError, match="planted"):
        train_guarded(tmp_path / "b", _FailsOnce(), GUARANTEE_STEPS, [ExactResume(), saver])
    resumed = train_guarded(
        tmp_path / "c",
        MomentumRegressor(),
        GUARANTEE_STEPS,
        [ExactResume()],
        tmp_path / "b" / "failed.ckpt",
    )
    assert same_inputs(whole.lightning_module, resumed.lightning_module, range(9, GUARANTEE_STEPS))
    assert guarantee_differences(whole, resumed) == []


NO_CUDA = "no CUDA device: the CUDA RNG, GradScaler and 16-mixed paths need a GPU"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_cuda_resume_draws_and_scales_as_the_uninterrupted_run(
    tmp_path: Path, precision: str
) -> None:
    """torch's draws come from the CUDA generator here; 16-mixed adds a GradScaler, whose
    scale Lightning checkpoints, and SkipStep's decision on the device."""
    cuda = {"accelerator": "cuda", "precision": precision}

    def run(name: str, steps: int, ckpt: Path | None = None) -> pl.Trainer:
        callbacks = [ExactResume(), SkipStep(window=8, warmup=4)]
        return train_guarded(
            tmp_path / name, DrawingRegressor(spike=[11]), steps, callbacks, ckpt, **cuda
        )

    seed_all(5)
    whole = run("a", GUARANTEE_STEPS)
    seed_all(5)
    run("b", 7)
    seed_all(6)
    resumed = run("c", GUARANTEE_STEPS, tmp_path / "b" / "step=7.ckpt")
    assert torch.cuda.is_initialized()
    drawn, again = whole.lightning_module.draws, resumed.lightning_module.draws
    assert [drawn[s] for s in range(7, GUARANTEE_STEPS)] == [
        again[s] for s in range(7, GUARANTEE_STEPS)
    ]
    assert guarantee_differences(whole, resumed) == []
    skip = next(c for c in resumed.callbacks if isinstance(c, SkipStep))
    assert list(skip.skipped_steps) == [11]
    if precision == "16-mixed":
        scalers = [getattr(t.precision_plugin, "scaler", None) for t in (whole, resumed)]
        assert all(s is not None for s in scalers)
        assert scalers[0].get_scale() == scalers[1].get_scale()  # type: ignore[union-attr]


N, K, EVERY = 20, 10, 5


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


@pytest.mark.parametrize(
    ("setting", "named"),
    [("threads", "num_threads: checkpoint 1, now 2"), ("flush", "flush_denormal: checkpoint")],
)
def test_a_users_resume_under_other_threads_or_subnormal_flushing_warns(
    tmp_path: Path, setting: str, named: str
) -> None:
    """Issue 44's gap: the process settings a user's resume may differ in (CPU threads,
    subnormal flushing) are named too, on a module of the user's kind."""
    threads, flushing = torch.get_num_threads(), fingerprint(None)["flush_denormal"]
    torch.set_num_threads(1)
    train(tmp_path / "b", DropoutRegressor(), loader(), RESUME_AT, [ExactResume()])
    try:
        if setting == "threads":
            torch.set_num_threads(2)
        else:
            torch.set_flush_denormal(not flushing)
        with pytest.warns(UserWarning, match=re.escape(named)):
            ckpt = tmp_path / "b" / f"step={RESUME_AT}.ckpt"
            train(tmp_path / "c", DropoutRegressor(), loader(), STEPS, [ExactResume()], ckpt)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flushing)


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
