"""The library on modules that are not the project's: StepLoader, ExactResume and the
watching callbacks, with plain Lightning Trainers, ModelCheckpoint files and
``Trainer.fit(ckpt_path=...)``, as a user runs them."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lit_spikes import StepLoader
from lit_spikes.callbacks import BatchSkipper, ExactResume, RollbackRestore, SpikeDetector
from tests.conftest import REPO
from tests.user_modules import DropoutRegressor, LoggingRegressor, PoisonedRows, regression_data

STEPS, RESUME_AT, BATCH = 30, 17, 8  # 12 batches an epoch: the resume is mid-epoch 1

# Lightning's warnings about what a test below does on purpose (each run of a pair writes
# into its own folder: the dirpath change is filtered in pyproject.toml).
NOT_RESUMABLE = (
    "ignore:You're resuming from a checkpoint that ended before the epoch ended:UserWarning"
)
NO_EXACT_RESUME = "ignore:Be aware that when using `ckpt_path`.*'ExactResume\\{}':UserWarning"


def trainer(
    root: Path, steps: int, callbacks: Sequence[Callback] = (), **kwargs: Any
) -> pl.Trainer:
    """A plain Trainer as a user builds one, writing ``step=<k>.ckpt`` every 1 step."""
    saver = ModelCheckpoint(root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    return pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver, *callbacks],
        **kwargs,
    )


def train(
    root: Path,
    module: pl.LightningModule,
    loader: Any,
    steps: int,
    callbacks: Sequence[Callback] = (),
    ckpt_path: Path | None = None,
    **kwargs: Any,
) -> pl.Trainer:
    run = trainer(root, steps, callbacks, **kwargs)
    run.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return run


def states_equal(a: pl.Trainer, b: pl.Trainer) -> list[str]:
    """Names of the parameters and optimizer tensors that differ (``torch.equal``)."""
    assert a.lightning_module is not None and b.lightning_module is not None
    differ = [
        name
        for (name, x), (_, y) in zip(
            a.lightning_module.state_dict().items(),
            b.lightning_module.state_dict().items(),
            strict=True,
        )
        if not torch.equal(x, y)
    ]
    for index, (oa, ob) in enumerate(zip(a.optimizers, b.optimizers, strict=True)):
        for key, (sa, sb) in enumerate(zip(oa.state.values(), ob.state.values(), strict=True)):
            differ += [f"optimizer{index}.{key}.{n}" for n in sa if not torch.equal(sa[n], sb[n])]
    return differ


def resume_pair(
    tmp_path: Path,
    make_module: Callable[[], pl.LightningModule],
    make_loader: Callable[[], Any],
    callbacks: Callable[[], Sequence[Callback]] = lambda: [ExactResume()],
    resume_at: int = RESUME_AT,
    **kwargs: Any,
) -> tuple[pl.Trainer, pl.Trainer]:
    """The uninterrupted run to STEPS and the one resumed at ``resume_at`` in a new Trainer."""
    whole = train(tmp_path / "a", make_module(), make_loader(), STEPS, callbacks(), **kwargs)
    train(tmp_path / "b", make_module(), make_loader(), resume_at, callbacks(), **kwargs)
    ckpt = tmp_path / "b" / f"step={resume_at}.ckpt"
    resumed = train(
        tmp_path / "c", make_module(), make_loader(), STEPS, callbacks(), ckpt, **kwargs
    )
    return whole, resumed


def loader(**kwargs: Any) -> StepLoader:
    return StepLoader(regression_data(), BATCH, seed=7, **kwargs)


@pytest.mark.parametrize("module", [DropoutRegressor, LoggingRegressor])
def test_a_resume_from_a_ckpt_equals_the_uninterrupted_run(
    tmp_path: Path, module: type[pl.LightningModule]
) -> None:
    whole, resumed = resume_pair(tmp_path, module, loader)
    assert states_equal(whole, resumed) == []
    assert whole.lightning_module.losses[RESUME_AT:] == resumed.lightning_module.losses


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


def test_gradient_accumulation_with_a_step_loader_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\) with a StepLoader"):
        train(tmp_path, LoggingRegressor(), loader(), 4, [ExactResume()], accumulate_grad_batches=2)


def test_without_exact_resume_dropout_resumes_otherwise(tmp_path: Path) -> None:
    """The negative control: the same pair without ExactResume draws other dropout masks."""
    whole, resumed = resume_pair(tmp_path, DropoutRegressor, loader, callbacks=lambda: [])
    assert states_equal(whole, resumed) != []


@pytest.mark.filterwarnings(NOT_RESUMABLE)  # the plain loader is the control
def test_a_plain_shuffled_loader_resumes_on_other_batches(tmp_path: Path) -> None:
    """The data control: Lightning restarts a plain DataLoader at its first batch."""

    def plain() -> DataLoader[Any]:
        return DataLoader(regression_data(), BATCH, shuffle=True, drop_last=True)

    whole, resumed = resume_pair(tmp_path, LoggingRegressor, plain)
    assert whole.lightning_module.losses[RESUME_AT:] != resumed.lightning_module.losses


def test_a_datamodule_returning_a_step_loader_resumes_exactly(tmp_path: Path) -> None:
    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> StepLoader:
            return loader()

    runs = []
    for name, steps, ckpt in (("a", STEPS, None), ("b", RESUME_AT, None), ("c", STEPS, "b")):
        run = trainer(tmp_path / name, steps, [ExactResume()])
        path = tmp_path / ckpt / f"step={RESUME_AT}.ckpt" if ckpt else None
        run.fit(DropoutRegressor(), datamodule=Data(), ckpt_path=path)
        runs.append(run)
    assert states_equal(runs[0], runs[2]) == []


def test_workers_give_the_batches_of_the_main_process(tmp_path: Path) -> None:
    in_main = train(tmp_path / "0", LoggingRegressor(), loader(), 14, [ExactResume()])
    workers = train(tmp_path / "2", LoggingRegressor(), loader(num_workers=2), 14, [ExactResume()])
    assert states_equal(in_main, workers) == []
    assert in_main.lightning_module.losses == workers.lightning_module.losses


def test_a_skip_set_changes_exactly_the_batches_it_names() -> None:
    plain = list(itertools.islice(loader().iter_from(0), 20))
    skipping = list(itertools.islice(loader(skip=[3, 4, 15]).iter_from(0), 17))
    positions = [p for p in range(20) if p not in (3, 4, 15)]
    for batch, position in zip(skipping, positions, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(batch, plain[position], strict=True))


def test_the_order_is_a_permutation_per_epoch_seeded_by_the_seed() -> None:
    data = loader()
    rows = [row for step in range(data.batches_per_epoch) for row in data.rows_of_step(step)]
    assert sorted(rows) == list(range(len(rows)))  # one epoch: each row once
    nxt = [r for s in range(12, 24) for r in data.rows_of_step(s)]
    assert nxt != rows and sorted(nxt) == sorted(rows)  # the next epoch: another order
    assert StepLoader(regression_data(), BATCH, seed=8).rows_of_step(0) != data.rows_of_step(0)


def test_each_rank_takes_its_rows_of_the_global_batch() -> None:
    data = loader()
    halves = [data.rows_of_step(5, rank, 2) for rank in (0, 1)]
    assert halves[0] + halves[1] == data.rows_of_step(5)
    with pytest.raises(ValueError, match="must divide by world_size=3"):
        data.rows_of_step(5, 0, 3)


@pytest.mark.filterwarnings(NO_EXACT_RESUME)  # the StepLoader refuses, without ExactResume
def test_another_order_at_a_resume_is_refused_by_name(tmp_path: Path) -> None:
    train(tmp_path / "a", LoggingRegressor(), loader(), 5, [ExactResume()])
    other = StepLoader(regression_data(), BATCH, seed=8)
    with pytest.raises(ValueError, match="seed: checkpoint 7, now 8"):
        train(tmp_path / "b", LoggingRegressor(), other, 10, [], tmp_path / "a" / "step=5.ckpt")


@pytest.mark.filterwarnings(NO_EXACT_RESUME)  # the rollback refuses, without ExactResume
@pytest.mark.parametrize("remedy", ["rollback", "skip"])
def test_remedies_refuse_a_loader_that_cannot_be_positioned(tmp_path: Path, remedy: str) -> None:
    """A plain DataLoader restarts at its first batch: a rollback or skip on it would train
    the wrong batches and look like it worked."""
    plain = DataLoader(regression_data(), BATCH)
    train(tmp_path / "a", LoggingRegressor(), plain, 6, [ExactResume()])
    if remedy == "rollback":
        rollback = RollbackRestore(tmp_path / "a", spike_step=5, distance=2)
        run = trainer(tmp_path / "b", 10, [rollback])
        with pytest.raises(TypeError, match="StepLoader"):
            rollback.fit(run, LoggingRegressor(), train_dataloaders=plain)
    else:
        with pytest.raises(TypeError, match="StepLoader"):
            train(tmp_path / "b", LoggingRegressor(), plain, 10, [BatchSkipper(positions=[8])])


def test_a_rollback_with_a_step_loader_resumes_the_earlier_file(tmp_path: Path) -> None:
    whole = train(tmp_path / "a", LoggingRegressor(), loader(), 12, [ExactResume()])
    rollback = RollbackRestore(tmp_path / "a", spike_step=9, distance=3)
    run = trainer(tmp_path / "b", 12, [rollback, ExactResume()])
    module = LoggingRegressor()
    rollback.fit(run, module, train_dataloaders=loader())
    assert rollback.ckpt_step == 6
    assert module.losses == whole.lightning_module.losses[6:]  # the same batches again


SPIKE = 9
"""The step of the planted bad batch: in the first data epoch, whose rows come once."""


def planted(step: int = SPIKE) -> PoisonedRows:
    """Rows that the seed-7 StepLoader trains at ``step``, their targets blown up."""
    return PoisonedRows(set(loader().rows_of_step(step)))


@pytest.mark.parametrize(
    ("module", "monitor"),
    [(DropoutRegressor, "loss"), (LoggingRegressor, "train_loss"), (LoggingRegressor, "grad_norm")],
)
def test_the_detector_flags_a_planted_spike(
    tmp_path: Path, module: type[pl.LightningModule], monitor: str
) -> None:
    detector = SpikeDetector(monitor=monitor, window=5, warmup=5, ratio=3.0)
    data = StepLoader(planted(), BATCH, seed=7)
    train(tmp_path, module(), data, 11, [detector, ExactResume()])
    assert [s["step"] for s in detector.spikes] == [SPIKE]


def test_a_monitor_the_module_never_logs_is_an_error_naming_what_is_logged(tmp_path: Path) -> None:
    detector = SpikeDetector(monitor="val_loss")
    with pytest.raises(RuntimeError, match=r"val_loss.*logs \['train_loss'\]"):
        train(tmp_path, LoggingRegressor(), loader(), 3, [detector])


def test_the_detector_state_round_trips_through_a_ckpt(tmp_path: Path) -> None:
    def detector() -> SpikeDetector:
        return SpikeDetector(monitor="train_loss", window=5, warmup=5, ratio=3.0)

    first, whole = detector(), detector()
    data = lambda: StepLoader(planted(), BATCH, seed=7)  # noqa: E731
    train(tmp_path / "w", LoggingRegressor(), data(), 24, [whole, ExactResume()])
    train(tmp_path / "a", LoggingRegressor(), data(), 20, [first, ExactResume()])
    resumed = detector()
    ckpt = tmp_path / "a" / "step=20.ckpt"
    train(tmp_path / "b", LoggingRegressor(), data(), 24, [resumed, ExactResume()], ckpt)
    assert list(resumed.spikes) == list(whole.spikes) and resumed.spikes
    assert resumed.state_dict() == whole.state_dict()


def test_the_detector_state_is_bounded_however_long_the_run() -> None:
    detector = SpikeDetector(window=20, warmup=5, ratio=1.4, max_records=50)

    def size() -> int:
        state = detector.state_dict()
        return len(state["spikes"]) + sum(len(v) for v in state["recent"].values())

    sizes = []
    for step in range(10_000):
        detector.check(step, {"loss": 10.0 if step % 40 == 0 else 1.0})
        if step in (2_000, 9_999):
            sizes.append(size())
    assert sizes[0] == sizes[1] == 50 + 20
    assert detector.num_spikes > 200


def test_a_resume_in_a_new_process_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    whole = train(tmp_path / "a", DropoutRegressor(), loader(), STEPS, [ExactResume()])
    train(tmp_path / "b", DropoutRegressor(), loader(), RESUME_AT, [ExactResume()])
    out = tmp_path / "resumed.pt"
    script = f"""
import torch
torch.set_num_threads({torch.get_num_threads()})
from tests.test_library import loader, train
from tests.user_modules import DropoutRegressor
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


def json_of(path: Path) -> Any:
    return json.loads(path.read_text())


def test_the_library_imports_nothing_of_the_demo() -> None:
    """A user's process that imports the callbacks and the loader loads no demo world,
    model or module (and the project installs no top-level ``callbacks`` module, which a
    user's own callbacks.py would clash with)."""
    probe = (
        "import sys, lit_spikes.callbacks, lit_spikes; "
        "print(sorted(m for m in sys.modules if m.startswith(('lit_spikes', 'callbacks'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd="/", check=True, capture_output=True, text=True
    )
    loaded = result.stdout
    assert "lit_spikes.demo" not in loaded and "lit_spikes.tools" not in loaded, loaded
    assert "'callbacks" not in loaded


@pytest.mark.slow
def test_the_example_trains_resumes_and_remedies(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "examples/own_model.py", "--root", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "equals the uninterrupted one, bit for bit" in result.stdout
    assert "flagged at step 30" in result.stdout and "without a spike" in result.stdout


@pytest.mark.slow
def test_the_gpu_check_runs(tmp_path: Path) -> None:
    """Without a GPU (CI) `make gpu-check` still proves the resume on the CPU and says what
    it skips; on a GPU it also resumes 16-mixed (GradScaler) and measures the rest."""
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if torch.cuda.is_available():
        assert result.stdout.count(": bit-equal") == 6, result.stdout  # 16-mixed too
        assert "steps/s without / with the callbacks" in result.stdout
        assert "host syncs per steady step" in result.stdout
        assert "no CUDA device" not in result.stdout
    else:
        assert result.stdout.count(": bit-equal") == 4, result.stdout
        assert "no CUDA device: skipping" in result.stdout


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(10))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StepLoader(regression_data(), 0), r"batch_size=0 must be an integer >= 1"),
        (lambda: StepLoader(regression_data(rows=4), 8), r"has 4 rows, fewer than batch_size=8"),
        (lambda: StepLoader(regression_data(), 8, num_workers=-1), r"num_workers=-1"),
        (lambda: StepLoader(regression_data(), 8, shuffle="no"), r"shuffle='no' must be True"),
        (lambda: StepLoader(regression_data(), 8, skip=[-2]), r"skip position -2"),
        (lambda: StepLoader(_Stream(), 8), r"needs a map-style dataset"),
    ],
)
def test_bad_loader_arguments_are_refused_by_name(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
