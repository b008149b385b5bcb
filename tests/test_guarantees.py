"""Each guarantee checked directly, on plain modules written for these tests (AdamW, SGD
with momentum; tests/guarantee_modules.py), through real ``.ckpt`` files: the RNGs a resume
restores, the step a StepLoader resumes at, what SkipStep puts back, the detector's rules,
BatchSkipper and LRScaler resumes. scripts/mutations.py breaks each guarantee in a copy of
the code and checks that these tests fail."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint

from lit_spikes.callbacks import BatchSkipper, ExactResume, LRScaler, SkipStep, SpikeDetector
from tests.conftest import REPO
from tests.guarantee_modules import (
    AdamWRegressor,
    DrawingRegressor,
    MomentumRegressor,
    PlantedMetric,
    seed_all,
    step_loader,
)

STEPS = 16
NO_EXACT_RESUME = "ignore:Be aware that when using `ckpt_path`.*'ExactResume\\{}':UserWarning"


def train(
    root: Path,
    module: pl.LightningModule,
    steps: int,
    callbacks: Sequence[Callback] = (),
    ckpt: Path | None = None,
    loader: Any = None,
    **kwargs: Any,
) -> pl.Trainer:
    """A plain Trainer as a user builds one, writing ``step=<k>.ckpt`` every step."""
    saver = ModelCheckpoint(root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    kwargs.setdefault("accelerator", "cpu")
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver, *callbacks],
        **kwargs,
    )
    data = {"train_dataloaders": step_loader() if loader is None else loader}
    if isinstance(loader, pl.LightningDataModule):
        data = {"datamodule": loader}
    trainer.fit(module, ckpt_path=ckpt, **data)
    return trainer


def differences(a: pl.Trainer, b: pl.Trainer) -> list[str]:
    """The parameters and optimizer state tensors that are not ``torch.equal``."""
    differ = [
        name
        for (name, x), (_, y) in zip(
            a.lightning_module.state_dict().items(),
            b.lightning_module.state_dict().items(),
            strict=True,
        )
        if not torch.equal(x, y)
    ]
    for sa, sb in zip(a.optimizers[0].state.values(), b.optimizers[0].state.values(), strict=True):
        differ += [f"optimizer.{n}" for n in sa if not torch.equal(sa[n], sb[n])]
    return differ


def same_inputs(a: pl.LightningModule, b: pl.LightningModule, steps: range) -> bool:
    return all(torch.equal(a.inputs[s], b.inputs[s]) for s in steps)  # type: ignore[index]


# --------------------------------------------------- ExactResume: Python, NumPy and torch RNG


def test_a_resume_draws_from_random_numpy_and_torch_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    seed_all(1)
    whole = train(tmp_path / "a", DrawingRegressor(), STEPS, [ExactResume()])
    seed_all(1)
    train(tmp_path / "b", DrawingRegressor(), 7, [ExactResume()])
    seed_all(99)  # this process's RNGs are elsewhere now: only the checkpoint's count
    resumed = train(
        tmp_path / "c", DrawingRegressor(), STEPS, [ExactResume()], tmp_path / "b" / "step=7.ckpt"
    )
    drawn, again = whole.lightning_module.draws, resumed.lightning_module.draws
    assert [drawn[s] for s in range(7, STEPS)] == [again[s] for s in range(7, STEPS)]
    assert differences(whole, resumed) == []


RESUME_IN_A_NEW_PROCESS = """
import sys, torch
from pathlib import Path
torch.set_num_threads({threads})
from lit_spikes.callbacks import ExactResume
from tests.guarantee_modules import DrawingRegressor
from tests.test_guarantees import train
run = train(Path(sys.argv[1]), DrawingRegressor(), {steps}, [ExactResume()], Path(sys.argv[2]))
state = dict(run.lightning_module.state_dict())
state.update({{f"draw.{{s}}": torch.tensor(d) for s, d in run.lightning_module.draws.items()}})
torch.save(state, sys.argv[3])
"""


def test_a_resume_in_a_new_process_draws_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """A new process seeds Python's and NumPy's RNGs from the OS: only the checkpoint's
    states make its draws the uninterrupted run's."""
    seed_all(2)
    whole = train(tmp_path / "a", DrawingRegressor(), STEPS, [ExactResume()])
    seed_all(2)
    train(tmp_path / "b", DrawingRegressor(), 9, [ExactResume()])
    script = RESUME_IN_A_NEW_PROCESS.format(threads=torch.get_num_threads(), steps=STEPS)
    out = tmp_path / "resumed.pt"
    args = [str(tmp_path / "c"), str(tmp_path / "b" / "step=9.ckpt"), str(out)]
    subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, check=True, timeout=300)
    saved = torch.load(out, weights_only=True)
    module = whole.lightning_module
    for step in range(9, STEPS):
        assert torch.equal(saved[f"draw.{step}"], torch.tensor(module.draws[step])), step
    assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())


# ------------------------------------------------------------- StepLoader: the step it resumes


@pytest.mark.filterwarnings(NO_EXACT_RESUME)
def test_a_step_loader_resumes_at_the_saved_step_without_exact_resume(tmp_path: Path) -> None:
    """Lightning restores the loader's state through the fit loop: no ExactResume needed
    for the data of a module that draws nothing."""
    whole = train(tmp_path / "a", MomentumRegressor(), STEPS)
    train(tmp_path / "b", MomentumRegressor(), 5)
    resumed = train(tmp_path / "c", MomentumRegressor(), STEPS, ckpt=tmp_path / "b" / "step=5.ckpt")
    loader = step_loader()
    for step in range(5, STEPS):
        assert torch.equal(resumed.lightning_module.inputs[step], loader.batch_of_step(step)[0])
    assert differences(whole, resumed) == []


class _Reloaded(pl.LightningDataModule):
    """A new StepLoader at each epoch (``reload_dataloaders_every_n_epochs=1``)."""

    def train_dataloader(self) -> Any:
        return step_loader()


def test_a_loader_built_anew_each_epoch_goes_on_at_the_global_step(tmp_path: Path) -> None:
    """A loader built at an epoch's start starts at its first batch: ExactResume seeks it
    to the global step, in the uninterrupted run and after a resume."""
    reload = {"reload_dataloaders_every_n_epochs": 1}
    whole = train(
        tmp_path / "a", AdamWRegressor(), 30, [ExactResume()], loader=_Reloaded(), **reload
    )
    loader = step_loader()
    for step in (0, 12, 25, 29):  # three data epochs
        assert torch.equal(whole.lightning_module.inputs[step], loader.batch_of_step(step)[0])
    train(tmp_path / "b", AdamWRegressor(), 14, [ExactResume()], loader=_Reloaded(), **reload)
    resumed = train(
        tmp_path / "c", AdamWRegressor(), 30, [ExactResume()], tmp_path / "b" / "step=14.ckpt",
        loader=_Reloaded(), **reload,
    )  # fmt: skip
    assert same_inputs(whole.lightning_module, resumed.lightning_module, range(14, 30))
    assert differences(whole, resumed) == []


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
    global step: the resume must train that step on its own batch."""
    whole = train(tmp_path / "a", MomentumRegressor(), STEPS, [ExactResume()])
    saver = OnExceptionCheckpoint(tmp_path / "b", filename="failed")
    with pytest.raises(RuntimeError, match="planted"):
        train(tmp_path / "b", _FailsOnce(), STEPS, [ExactResume(), saver])
    resumed = train(
        tmp_path / "c", MomentumRegressor(), STEPS, [ExactResume()], tmp_path / "b" / "failed.ckpt"
    )
    assert same_inputs(whole.lightning_module, resumed.lightning_module, range(9, STEPS))
    assert differences(whole, resumed) == []


# --------------------------------------------------------------- SkipStep: what it puts back


class _Snapshots(Callback):
    """The parameters and every optimizer state tensor at the start of some steps."""

    def __init__(self, steps: Sequence[int]) -> None:
        self.steps, self.seen = set(steps), {}  # type: ignore[var-annotated]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step in self.steps:
            state = {k: v.clone() for k, v in pl_module.state_dict().items()}
            for i, s in trainer.optimizers[0].state.items():
                state.update({f"{id(i)}.{n}": v.clone() for n, v in s.items()})
            self.seen[trainer.global_step] = state


@pytest.mark.parametrize(
    ("module", "moments"),
    [(AdamWRegressor, {"exp_avg", "exp_avg_sq", "step"}), (MomentumRegressor, {"momentum_buffer"})],
)
def test_a_skipped_step_leaves_weights_and_optimizer_state_as_before(
    tmp_path: Path, module: type[pl.LightningModule], moments: set[str]
) -> None:
    snaps = _Snapshots([10, 11, 12])
    skip = SkipStep(window=8, warmup=4, sigma=6.0)
    run = train(tmp_path, module(spike=[11]), 14, [skip, snaps])
    assert list(skip.skipped_steps) == [11]
    before, after, earlier = snaps.seen[11], snaps.seen[12], snaps.seen[10]
    assert {k.split(".")[-1] for k in before} >= moments
    assert before.keys() == after.keys()
    for key, value in before.items():  # weight decay, moments, step count: none moved
        assert torch.equal(value, after[key]), key
    assert all(not torch.equal(v, before[k]) for k, v in earlier.items() if "weight" in k)
    assert all(torch.isfinite(p).all() for p in run.lightning_module.parameters())


@pytest.mark.parametrize("module", [AdamWRegressor, MomentumRegressor])
def test_state_a_skipped_first_step_created_is_removed(
    tmp_path: Path, module: type[pl.LightningModule]
) -> None:
    """The window's initial values make step 0 skippable: the optimizer state the step
    created is removed (none, as before the step) and its weights are the initial ones."""
    snaps = _Snapshots([0, 1])
    skip = SkipStep(window=8, warmup=2, initial=[10.0, 11.0, 10.0, 11.0])
    train(tmp_path, module(spike=[0]), 2, [skip, snaps])
    assert list(skip.skipped_steps) == [0]
    weights = {k: v for k, v in snaps.seen[1].items() if k in snaps.seen[0]}
    assert all(torch.equal(v, snaps.seen[0][k]) for k, v in weights.items())
    state = {k: v for k, v in snaps.seen[1].items() if k not in snaps.seen[0]}
    assert state == {}


@pytest.mark.parametrize("module", [AdamWRegressor, MomentumRegressor])
def test_after_a_skipped_first_step_training_goes_on_as_from_a_fresh_optimizer(
    tmp_path: Path, module: type[pl.LightningModule]
) -> None:
    """Zeros are where AdamW's and SGD's state start: the run whose step 0 was skipped
    trains as the run that never saw that batch (its position skipped in the data)."""
    skip = SkipStep(window=8, warmup=2, initial=[10.0, 11.0, 10.0, 11.0])
    skipped = train(tmp_path / "a", module(spike=[0]), 6, [skip])
    fresh = train(tmp_path / "b", module(), 5, loader=step_loader(skip=[0]))
    assert list(skip.skipped_steps) == [0]
    assert differences(skipped, fresh) == []


# ------------------------------------------------------------ SpikeDetector: mode and ratio

SCORES = [-11.0 if s % 2 else -9.0 for s in range(40)]  # mean -10, std 1.05 over 10
SCORES[22] = -7.5  # above the ratio rule's -8 (1.2 x |mean| above it), below mean + 3 std
SCORES[36] = -5.0  # above both


@pytest.mark.parametrize(("mode", "flagged"), [("any", [22, 36]), ("all", [36])])
def test_the_rules_on_a_negative_metric_a_module_logs(
    tmp_path: Path, mode: str, flagged: list[int]
) -> None:
    detector = SpikeDetector(
        monitor="score",
        window=10,
        warmup=10,
        ratio=1.2,
        z_score=3.0,
        mode=mode,  # type: ignore[arg-type]
    )
    train(tmp_path, PlantedMetric(SCORES), len(SCORES), [detector])
    assert [s["step"] for s in detector.spikes] == flagged


def test_the_rules_on_negative_values_judged_one_by_one() -> None:
    for mode, ratio, z_score, flagged in [
        ("any", 1.2, 3.0, [22, 36]),
        ("all", 1.2, 3.0, [36]),
        ("any", 1.2, None, [22, 36]),  # the ratio rule alone, on a negative mean
        ("any", None, 3.0, [36]),
    ]:
        detector = SpikeDetector(
            monitor="score",
            window=10,
            warmup=10,
            ratio=ratio,
            z_score=z_score,
            mode=mode,  # type: ignore[arg-type]
        )
        found = [
            s["step"] for step, v in enumerate(SCORES) for s in detector.check(step, {"score": v})
        ]
        assert found == flagged, (mode, ratio, z_score)


# ------------------------------------------------------- BatchSkipper and LRScaler resumes


@pytest.mark.filterwarnings(NO_EXACT_RESUME)
def test_a_batch_skipper_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    def run(name: str, steps: int, ckpt: Path | None = None) -> pl.Trainer:
        return train(
            tmp_path / name, MomentumRegressor(), steps, [BatchSkipper(ranges=[(5, 9)])], ckpt
        )

    whole, _ = run("a", STEPS), run("b", 7)
    resumed = run("c", STEPS, tmp_path / "b" / "step=7.ckpt")
    loader = step_loader(skip=range(5, 9))
    for step in range(7, STEPS):  # step 7 trains position 11
        assert torch.equal(resumed.lightning_module.inputs[step], loader.batch_of_step(step)[0])
    assert differences(whole, resumed) == []


def test_an_lr_scaler_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    def run(name: str, steps: int, ckpt: Path | None = None) -> pl.Trainer:
        scaler = LRScaler(factor=0.5, start_step=5, end_step=13)
        return train(
            tmp_path / name, DrawingRegressor(schedule=True), steps, [scaler, ExactResume()], ckpt
        )

    seed_all(3)
    whole = run("a", STEPS)
    seed_all(3)
    run("b", 9)
    seed_all(4)
    resumed = run("c", STEPS, tmp_path / "b" / "step=9.ckpt")
    lrs, again = whole.lightning_module.lrs, resumed.lightning_module.lrs
    assert [lrs[s] for s in range(9, STEPS)] == [again[s] for s in range(9, STEPS)]
    assert lrs[12] == 0.5 * lrs[13]  # scaled to step 12, as scheduled from 13 on
    assert differences(whole, resumed) == []


# ----------------------------------------------------------------- CUDA: RNG, GradScaler

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
        return train(tmp_path / name, DrawingRegressor(spike=[11]), steps, callbacks, ckpt, **cuda)

    seed_all(5)
    whole = run("a", STEPS)
    seed_all(5)
    run("b", 7)
    seed_all(6)
    resumed = run("c", STEPS, tmp_path / "b" / "step=7.ckpt")
    assert torch.cuda.is_initialized()
    drawn, again = whole.lightning_module.draws, resumed.lightning_module.draws
    assert [drawn[s] for s in range(7, STEPS)] == [again[s] for s in range(7, STEPS)]
    assert differences(whole, resumed) == []
    skip = next(c for c in resumed.callbacks if isinstance(c, SkipStep))
    assert list(skip.skipped_steps) == [11]
    if precision == "16-mixed":
        scalers = [getattr(t.precision_plugin, "scaler", None) for t in (whole, resumed)]
        assert all(s is not None for s in scalers)
        assert scalers[0].get_scale() == scalers[1].get_scale()  # type: ignore[union-attr]


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_a_skipped_step_on_cuda_leaves_weights_and_state_as_before(tmp_path: Path) -> None:
    snaps = _Snapshots([11, 12])
    skip = SkipStep(window=8, warmup=4, sigma=6.0)
    train(tmp_path, AdamWRegressor(spike=[11]), 14, [skip, snaps], accelerator="cuda")
    assert list(skip.skipped_steps) == [11]
    for key, value in snaps.seen[11].items():
        assert torch.equal(value, snaps.seen[12][key]), key
