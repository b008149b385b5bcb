"""``SkipStep`` (OLMo-core's skip-step): arguments, decisions, a skipped update (a NaN or
inf loss, a NaN gradient) leaves weights and optimizer state as before, and a resumed run,
under DDP too, decides exactly as the uninterrupted one."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lit_spikes.callbacks import (
    RollbackRestore,
    SkipStep,
    SpikeDetector,
)
from lit_spikes.checkpoints import checkpoint_files
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import (
    REPO,
    TINY_DATA,
    TINY_GPT,
    TINY_OPTIM,
    assert_states_equal,
    ddp_env,
    fit,
    load_ckpt,
)
from tests.modules.guarantee_modules import (
    AdamWRegressor,
    MomentumRegressor,
    step_loader,
)
from tests.modules.guarantee_runs import guarantee_differences, train_guarded
from tests.modules.watched_runs import (
    WATCHED_FEATURES,
    WatchedRegressor,
    dropped,
    fit_watched,
    regressor_data,
)


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
    run = train_guarded(tmp_path, module(spike=[11]), 14, [skip, snaps])
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
    train_guarded(tmp_path, module(spike=[0]), 2, [skip, snaps])
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
    skipped = train_guarded(tmp_path / "a", module(spike=[0]), 6, [skip])
    fresh = train_guarded(tmp_path / "b", module(), 5, loader=step_loader(skip=[0]))
    assert list(skip.skipped_steps) == [0]
    assert guarantee_differences(skipped, fresh) == []


NO_CUDA = "no CUDA device: the CUDA RNG, GradScaler and 16-mixed paths need a GPU"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_a_skipped_step_on_cuda_leaves_weights_and_state_as_before(tmp_path: Path) -> None:
    snaps = _Snapshots([11, 12])
    skip = SkipStep(window=8, warmup=4, sigma=6.0)
    train_guarded(tmp_path, AdamWRegressor(spike=[11]), 14, [skip, snaps], accelerator="cuda")
    assert list(skip.skipped_steps) == [11]
    for key, value in snaps.seen[11].items():
        assert torch.equal(value, snaps.seen[12][key]), key


def test_a_second_skip_step_ignores_an_update_the_first_dropped(tmp_path: Path) -> None:
    """Two SkipSteps in one Trainer: after the first drops step 8's gradients, the others
    must neither take a norm of no gradients (0) into a window nor miss the step: the
    gradient norm is measured once a step, before any of them drops it."""
    data = replace(TINY_DATA, poison=(8,))
    first = SkipStep(monitor="loss", window=4, sigma=0.1, warmup=2)
    second = SkipStep(monitor="grad_norm", window=20, sigma=6.0, warmup=2)
    again = SkipStep(monitor="loss", window=4, sigma=0.1, warmup=2, start_step=1)
    fit(tmp_path, "two", 12, callbacks=[first, second, again], data=data)
    assert 8 in first.skipped_steps
    alone = SkipStep(monitor="loss", window=4, sigma=0.1, warmup=2)
    fit(tmp_path, "one", 12, callbacks=[alone], data=data)
    assert alone.skipped_steps == first.skipped_steps
    # Each still judged step 8 (every finite value enters a window).
    assert list(again.values) == list(first.values) == list(alone.values)
    assert len(second.values) == 12 and all(norm > 0 for norm in second.values)
    norms = SkipStep(monitor="grad_norm", window=20, sigma=6.0, warmup=2)
    fit(tmp_path, "norms", 9, callbacks=[norms], data=data)  # no skip before step 9
    assert list(second.values)[:9] == list(norms.values)


def finite(module: pl.LightningModule) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize(
    ("kwargs", "step"),
    [({}, 3), ({"window": 8, "warmup": 4}, 0), ({"window": 8, "warmup": 4, "start_step": 10}, 5)],
    ids=["defaults-in-warmup", "first-step", "before-start-step"],
)
def test_a_nan_step_is_dropped_at_any_step(
    optimizer: str, kwargs: dict[str, Any], step: int
) -> None:
    module = WatchedRegressor(optimizer, poison={step: math.nan})
    skip = SkipStep(**kwargs)
    trainer = fit_watched(module, [skip], step + 4)
    assert list(skip.skipped_steps) == [step]
    assert dropped(trainer, step), "the NaN step's update reached the weights or state"
    assert not dropped(trainer, step + 1)  # the next step trains
    assert finite(module)
    if step == 0:  # no state before the first step, none after its dropped update
        assert trainer.states.after[0]["state"] == {}  # type: ignore[attr-defined]


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_a_users_nan_step_skip_step_dropped_is_never_a_rollback_target(tmp_path: Path) -> None:
    """A module of the user's, SkipStep dropping its NaN at step 7, a ModelCheckpoint every
    2 steps and a CheckpointRetention: the files written after the NaN (8, 10, ...) record
    it and are passed over by every rollback; the one before it (6) is kept and chosen."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_spikes.callbacks import CheckpointRetention
    from lit_spikes.checkpoints import newest_valid_checkpoint, nonfinite_steps_of

    directory = tmp_path / "ckpts"
    skip = SkipStep(window=8, warmup=4)
    retention = CheckpointRetention(directory, keep_last=2, rollback_distance=4)
    saver = ModelCheckpoint(directory, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=20,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver, skip, retention],
    )
    trainer.fit(WatchedRegressor("adamw", poison={7: math.nan}), train_dataloaders=regressor_data())
    assert list(skip.nonfinite_steps) == [7] == list(skip.skipped_steps)
    # 6: the newest before the NaN; 16: within 4 steps of the last trained
    assert [s for s, _ in checkpoint_files(directory)] == [6, 16, 18, 20]
    assert nonfinite_steps_of(load_ckpt(directory / "step=20.ckpt")) == [7]
    assert nonfinite_steps_of(load_ckpt(directory / "step=6.ckpt")) == []
    with pytest.warns(UserWarning, match=r"non-finite loss or gradient at step\(s\) \[7\]"):
        assert newest_valid_checkpoint(directory)[0] == 6
    with pytest.warns(UserWarning, match=r"non-finite loss or gradient at step\(s\) \[7\]"):
        assert RollbackRestore(directory, spike_step=19).ckpt_step == 6
    assert newest_valid_checkpoint(directory, refuse_nonfinite=False)[0] == 20  # a requeue's


def test_an_inf_loss_is_dropped_too() -> None:
    module = WatchedRegressor("adamw", poison={2: math.inf})
    skip = SkipStep(window=8, warmup=4)
    trainer = fit_watched(module, [skip], 5)
    assert list(skip.skipped_steps) == [2] and dropped(trainer, 2) and finite(module)


class TwoOptimizers(pl.LightningModule):
    """Manual optimization, two optimizers (each its own half of the model)."""

    def __init__(self, poison: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(WATCHED_FEATURES, 1), nn.Linear(WATCHED_FEATURES, 1)
        self.poison = poison

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        factor = 100.0 if batch_idx == self.poison else 1.0
        for layer, optimizer in zip((self.a, self.b), self.optimizers(), strict=True):
            loss = nn.functional.mse_loss(layer(x), y) * factor
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.AdamW(self.a.parameters(), lr=0.01),
            torch.optim.SGD(self.b.parameters(), lr=0.01, momentum=0.9),
        ]


@pytest.mark.filterwarnings(
    "ignore:You passed in a `val_dataloader` but have no `validation_step`:UserWarning"
)  # its module trains only
def test_skip_step_refuses_several_optimizers_under_manual_optimization() -> None:
    with pytest.raises(RuntimeError, match=r"SkipStep: .*manual optimization with 2 optimizers"):
        fit_watched(TwoOptimizers(poison=10), [SkipStep(window=8, warmup=4)], 20)
    detector = SpikeDetector(window=4, warmup=4, ratio=3.0)  # records, drops nothing
    trainer = pl.Trainer(
        max_steps=24,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[detector],
    )
    trainer.fit(TwoOptimizers(poison=10), train_dataloaders=regressor_data())
    assert detector.onsets == [21]  # batch 10's second step (two steps a batch)


N, POISON, K = 40, 28, 20


OPTIM = replace(TINY_OPTIM, max_steps=N)


DATA = replace(TINY_DATA, poison=(POISON,))
"""The tiny run of the other tests, with a batch of random characters planted at step 28:
its loss jumps from about 2.7 to 4.8 (model seed 0)."""


def skip_step(**changes: Any) -> SkipStep:
    kwargs: dict[str, Any] = {"window": 16, "sigma": 6.0, "warmup": 10}
    kwargs.update(changes)
    return SkipStep(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"monitor": ["loss", "grad_norm"]}, r"judges one value: give one name"),
        ({"window": 1}, r"window=1 must be an integer >= 2"),
        ({"sigma": 0.0}, r"sigma=0.0 must be a finite number > 0"),
        ({"sigma": float("inf")}, r"sigma=inf must be a finite number > 0"),
        ({"window": 10, "warmup": 11}, r"warmup=11 must be an integer in \[2, window=10\]"),
        ({"warmup": 1}, r"warmup=1 must be an integer in \[2, window=128\]"),
        ({"start_step": -1}, r"start_step=-1 must be an integer >= 0"),
        ({"initial": [1.0, float("nan")]}, r"initial=\[nan\]: every initial value must be finite"),
    ],
)
def test_skip_step_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SkipStep(**kwargs)


@pytest.mark.parametrize(("window", "warmup"), [(2, 2), (3, 2), (4, 2), (5, 2), (128, 64)])
def test_default_warmup_is_half_the_window_and_at_least_two(window: int, warmup: int) -> None:
    assert SkipStep(window=window).warmup == warmup  # every window the docstring allows


def test_decisions_follow_mean_plus_k_sigma_of_the_window() -> None:
    skip = SkipStep(window=8, sigma=3.0, warmup=4, initial=[2.0, 2.1, 1.9])
    assert skip.threshold() is None  # 3 values < warmup 4
    assert not skip.decide(0, 2.05)
    limit = skip.threshold()
    assert limit is not None and 2.1 < limit < 2.5
    assert skip.decide(1, 5.0)  # an outlier: skipped
    assert skip.decide(2, float("nan"))  # never reaches the weights, and kept out of the window
    assert list(skip.values) == [2.0, 2.1, 1.9, 2.05, 5.0]  # skipped values enter it too
    late = SkipStep(window=8, sigma=3.0, warmup=4, start_step=10, initial=[2.0, 2.1, 1.9, 2.0])
    assert not late.decide(9, 50.0) and late.decide(10, 500.0)
    assert list(late.skipped_steps) == [10]


def test_a_skipped_step_leaves_weights_and_adamw_state_unchanged(tmp_path: Path) -> None:
    skip = skip_step()
    run = fit(
        tmp_path,
        "skip",
        POISON + 2,
        optim=OPTIM,
        data=DATA,
        callbacks=[skip],
        checkpoint_every=1,
    )
    assert list(skip.skipped_steps) == [POISON]
    before = load_ckpt(checkpoint_path(run.spec.run_dir, POISON))
    after = load_ckpt(checkpoint_path(run.spec.run_dir, POISON + 1))
    for key, value in before["state_dict"].items():
        assert torch.equal(value, after["state_dict"][key]), f"{key} moved in a skipped step"
    state_before = before["optimizer_states"][0]["state"]
    state_after = after["optimizer_states"][0]["state"]
    for index, tensors in state_before.items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(tensors[name], state_after[index][name]), f"{name} of {index}"
    # ... while the step counter and the schedule went on, and the next step trains again
    assert after["global_step"] == before["global_step"] + 1
    assert after["lr_schedulers"][0]["last_epoch"] == before["lr_schedulers"][0]["last_epoch"] + 1
    later = load_ckpt(checkpoint_path(run.spec.run_dir, POISON + 2))
    assert any(
        not torch.equal(value, later["state_dict"][key])
        for key, value in after["state_dict"].items()
    )
    # Without SkipStep the same step moves the weights.
    plain = fit(tmp_path, "plain", POISON + 1, optim=OPTIM, data=DATA, checkpoint_every=1)
    moved = load_ckpt(checkpoint_path(plain.spec.run_dir, POISON + 1))
    assert any(
        not torch.equal(value, moved["state_dict"][key])
        for key, value in before["state_dict"].items()
    )


class FreshSkipStep(SkipStep):
    """Another state key, so a checkpoint's SkipStep state is never loaded into it: the
    negative control of the resume test (its window starts empty at the resume step)."""


def test_a_detector_listed_before_skip_step_sees_the_skipped_steps_real_gradient_norm(
    tmp_path: Path,
) -> None:
    """The norm is measured once a step, before any callback drops the gradients: a
    detector never reads the 0 of a dropped update into its window."""
    data = replace(TINY_DATA, poison=(8,))
    detector = SpikeDetector(monitor="grad_norm", window=30, warmup=0, ratio=1.4)
    skip = SkipStep(monitor="loss", window=4, sigma=0.1, warmup=2)
    fit(tmp_path, "run", 12, callbacks=[detector, skip], data=data)
    assert 8 in skip.skipped_steps, "the poisoned batch is skipped"
    unskipped = SpikeDetector(monitor="grad_norm", window=30, warmup=0, ratio=1.4)
    fit(tmp_path, "plain", 9, callbacks=[unskipped], data=data)
    assert list(detector._recent["grad_norm"])[:9] == list(unskipped._recent["grad_norm"])


def test_a_non_finite_loss_leaves_no_gradient_norm_in_any_window(tmp_path: Path) -> None:
    """Its gradients are dropped: its norm is not 0 in any window, and not a value."""
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.shared.training import RunSpec
    from tests.conftest import TINY_GPT, NaNLossModule

    skip = SkipStep(monitor="grad_norm", window=8, sigma=6.0, warmup=2)
    detector = SpikeDetector(monitor="grad_norm", window=8, warmup=0)
    spec = RunSpec(
        tmp_path,
        "nan",
        8,
        callbacks=[skip, detector],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0},
    )
    module = NaNLossModule(gpt=TINY_GPT, optim=TINY_OPTIM, nan_step=4)
    with pytest.warns(UserWarning, match="non-finite loss at step 4: its update is skipped"):
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
    assert module.nonfinite_steps == [4]
    assert "grad_norm" not in module.history[4]
    assert len(skip.values) == len(detector._recent["grad_norm"]) == 7  # steps 0-3, 5-7
    assert 0.0 not in skip.values and 0.0 not in detector._recent["grad_norm"]


def test_resumed_skip_step_run_equals_its_uninterrupted_twin(tmp_path: Path) -> None:
    full_skip = skip_step()
    full = fit(
        tmp_path, "full", N, optim=OPTIM, data=DATA, callbacks=[full_skip], checkpoint_every=K
    )
    assert list(full_skip.skipped_steps) == [POISON]  # K=20 < 28: the window decides after resume
    resumed_skip = skip_step()
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        optim=OPTIM,
        data=DATA,
        callbacks=[resumed_skip],
        checkpoint_every=K,
        ckpt_path=checkpoint_path(full.spec.run_dir, K),
    )
    assert list(resumed_skip.skipped_steps) == [POISON]
    assert list(resumed_skip.values) == list(full_skip.values)
    assert_states_equal(
        load_ckpt(checkpoint_path(full.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )
    full_losses = full.losses
    assert all(full_losses[step] == loss for step, loss in resumed.losses.items())
    # Negative control: the same callback without its restored window (8 values < warmup
    # 10 at step 28) lets the poisoned update through, and the weights end elsewhere.
    fresh_skip = FreshSkipStep(window=16, sigma=6.0, warmup=10)
    fresh = fit(
        tmp_path,
        "fresh",
        N,
        optim=OPTIM,
        data=DATA,
        callbacks=[fresh_skip],
        ckpt_path=checkpoint_path(full.spec.run_dir, K),
    )
    assert list(fresh_skip.skipped_steps) == []
    assert any(
        not torch.equal(value, fresh.module.state_dict()[key])
        for key, value in full.module.state_dict().items()
    )


DDP_STEPS = POISON + 4


RESUME_AT = (K, POISON + 1)
"""The DDP run resumes from before the bad batch (the resumed run must skip step 28
itself) and from after it (the restored window and skipped list carry the decision)."""


def _ddp_worker(root: str, *runs: str) -> None:
    """Body of ``python -m tests.library.callbacks.test_skip_step <root> <run>...``, run
    by both ranks: each run, ``<name>`` or ``<name>=<ckpt>``, one after the other in the
    same two processes (a launch costs seconds of imports). The poisoned batch of step
    28 lands in rank 0's rows only (``poison_rows="first_half"``)."""
    for run_arg in runs:
        name, _, ckpt_path = run_arg.partition("=")
        _ddp_run(Path(root), name, ckpt_path or None)


def _ddp_run(root: Path, name: str, ckpt_path: str | None) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    skip = skip_step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = fit(
            root,
            name,
            DDP_STEPS,
            optim=OPTIM,
            data=replace(DATA, poison_rows="first_half"),
            callbacks=[skip],
            checkpoint_every=1,
            ckpt_path=ckpt_path,
            devices=2,
            strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        )
    rank = run.trainer.global_rank
    torch.save(
        {k: v.detach().clone() for k, v in run.module.state_dict().items()},
        root / f"{name}.weights.rank{rank}.pt",
    )
    report = {
        "skipped": list(skip.skipped_steps),
        "losses": run.losses,
        "values": list(skip.values),
    }
    (root / f"{name}.report.rank{rank}.json").write_text(json.dumps(report))


def run_ddp_skip_step(root: Path, *runs: tuple[str, Path | None]) -> dict[str, list[Any]]:
    """One 2-process launch of ``_ddp_worker`` for ``runs`` (name, checkpoint or None);
    returns each run's reports, one a rank."""
    args = [name if ckpt is None else f"{name}={ckpt}" for name, ckpt in runs]
    command = [sys.executable, "-m", "tests.library.callbacks.test_skip_step", str(root), *args]
    done = subprocess.run(
        command, cwd=REPO, env=ddp_env(), capture_output=True, text=True, timeout=180
    )
    reports = {name: [root / f"{name}.report.rank{r}.json" for r in (0, 1)] for name, _ in runs}
    found = all(p.exists() for paths in reports.values() for p in paths)
    assert done.returncode == 0 and found, done.stderr[-4000:]
    return {name: [json.loads(p.read_text()) for p in paths] for name, paths in reports.items()}


@pytest.mark.slow
def test_under_ddp_every_rank_skips_the_same_step_and_resumes_bit_exactly(
    tmp_path: Path,
) -> None:
    rank0, rank1 = run_ddp_skip_step(tmp_path, ("ddp", None))["ddp"]
    # Only rank 0 saw the bad rows, yet both judged the global loss and skipped step 28.
    assert rank0["losses"][str(POISON)] > 1.3 * rank1["losses"][str(POISON)]
    assert rank0["skipped"] == rank1["skipped"] == [POISON]
    assert rank0["values"] == rank1["values"]  # the same window, bit for bit
    weights = [torch.load(tmp_path / f"ddp.weights.rank{r}.pt", weights_only=True) for r in (0, 1)]
    for key, value in weights[0].items():
        assert torch.equal(value, weights[1][key]), f"{key} differs between the ranks"
    before = load_ckpt(checkpoint_path(tmp_path / "ddp", POISON))
    after = load_ckpt(checkpoint_path(tmp_path / "ddp", POISON + 1))
    for key, value in before["state_dict"].items():
        assert torch.equal(value, after["state_dict"][key]), f"{key} moved in a skipped step"
    state_before = before["optimizer_states"][0]["state"]
    state_after = after["optimizer_states"][0]["state"]
    for index, tensors in state_before.items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(tensors[name], state_after[index][name]), f"{name} of {index}"
    # Resumed under DDP, before and after the skipped step: the same decisions, the same
    # window and, on every parameter and AdamW moment, the same bits.
    full = load_ckpt(checkpoint_path(tmp_path / "ddp", DDP_STEPS))
    starts = [(f"resumed_from_{k}", checkpoint_path(tmp_path / "ddp", k)) for k in RESUME_AT]
    resumes = run_ddp_skip_step(tmp_path, *starts)  # both in one launch
    for name, resumed in resumes.items():
        for rank, report in enumerate(resumed):
            assert report["skipped"] == [POISON], f"{name}, rank {rank}"
            assert report["values"] == rank0["values"], f"{name}, rank {rank}"
        assert_states_equal(full, load_ckpt(checkpoint_path(tmp_path / name, DDP_STEPS)))


if __name__ == "__main__":
    _ddp_worker(*sys.argv[1:])


NAN_RUN, EVERY = 20, 5


def test_nan_loss_skips_the_update_counts_as_spike_and_is_never_a_rollback_target(
    tmp_path: Path,
) -> None:
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.shared.training import RunSpec
    from tests.conftest import NaNLossModule

    detector = SpikeDetector(ratio=1.4)
    module = NaNLossModule(gpt=TINY_GPT, optim=TINY_OPTIM, nan_step=12)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Snap(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if trainer.global_step in (12, 13):
                state = {k: v.clone() for k, v in pl_module.state_dict().items()}
                opt = trainer.optimizers[0].state_dict()["state"]
                state.update({f"exp_avg.{i}": s["exp_avg"].clone() for i, s in opt.items()})
                seen[trainer.global_step] = state

    spec = RunSpec(
        tmp_path,
        "nan",
        NAN_RUN,
        checkpoint_every=EVERY,
        callbacks=[detector, Snap()],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0},
    )
    with pytest.warns(UserWarning, match="non-finite loss at step 12: its update is skipped"):
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
    for key, value in seen[12].items():  # the NaN step changed no weight and no moment
        assert torch.equal(value, seen[13][key]), key
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())
    assert [s["step"] for s in detector.spikes] == [12]
    assert module.nonfinite_steps == [12]
    with pytest.warns(UserWarning, match=r"written after a non-finite loss .* \[12\]"):
        rollback = RollbackRestore(spec.run_dir / "checkpoints", spike_step=NAN_RUN, distance=0)
        assert rollback.ckpt_step == 10


def test_nan_gradient_with_finite_loss_skips_the_update(tmp_path: Path) -> None:
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.shared.training import RunSpec
    from tests.conftest import NaNAtStepModule  # finite forward, NaN backward at step 12

    module = NaNAtStepModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Snap(Callback):  # the weights and all of AdamW's state at a step's start
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if trainer.global_step in (11, 12, 13):
                state = {k: v.clone() for k, v in pl_module.state_dict().items()}
                for i, s in trainer.optimizers[0].state_dict()["state"].items():
                    state.update({f"{name}.{i}": v.clone() for name, v in s.items()})
                seen[trainer.global_step] = state

    spec = RunSpec(
        tmp_path,
        "nan_grad",
        14,
        callbacks=[Snap()],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0},
    )
    with pytest.warns(UserWarning, match="non-finite gradient norm at step 12"):
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
    assert module.nonfinite_steps == [12]
    # Zeroed gradients would pass a finiteness check: AdamW's weight decay and moment decay
    # would still move them. The step must leave every tensor as it was.
    assert any(k.startswith("exp_avg_sq.") for k in seen[12])
    for key, value in seen[12].items():
        assert torch.equal(value, seen[13][key]), key
    assert any(not torch.equal(v, seen[12][k]) for k, v in seen[11].items())  # step 11 moved
