"""The spike callbacks: arguments, state through real checkpoints, detection, remedies."""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lit_spikes.callbacks import (
    BatchSkipper,
    CheckpointRetention,
    FinalCheckpoint,
    LRScaler,
    RollbackRestore,
    SkipStep,
    SpikeDetector,
)
from lit_spikes.demo.module import TinyGPTModule
from lit_spikes.tools.training import checkpoint_path
from tests.conftest import TINY_DATA, TINY_OPTIM, assert_states_equal, fit, load_ckpt, tb_scalars

N, K, EVERY = 20, 10, 5


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"monitor": ()}, r"monitor=\(\)\): give a name or a list of names"),
        ({"monitor": ["loss", ""]}, r"give a name or a list of names"),
        ({"window": 1}, r"window=1 must be an integer >= 2"),
        ({"window": 20.5}, r"window=20.5 must be an integer >= 2"),
        ({"robust_z": 0.0}, r"robust_z=0.0 must be a finite number > 0"),
        ({"ratio": 0.9}, r"ratio=0.9 must be a finite number > 1 \(a spike is a rise\)"),
        ({"ratio": float("inf")}, r"ratio=inf must be a finite number > 1"),
        ({"z_score": -1.0}, r"z_score=-1.0 must be a finite number > 0"),
        ({"z_score": float("nan")}, r"z_score=nan must be a finite number > 0"),
        ({"action": "rollback"}, r"action='rollback' must be one of \('log', 'stop'\)"),
        ({"reduce": "sum"}, r"reduce='sum' must be one of \('mean', 'max'\)"),
        ({"warmup": -3}, r"warmup=-3 must be an integer >= 0"),
        ({"min_step": True}, r"min_step=True must be an integer >= 0"),
    ],
)
def test_spike_detector_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpikeDetector(**kwargs)


def test_remedy_callbacks_reject_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"ranges entry \(30, 20\)"):
        BatchSkipper(ranges=[(30, 20)])
    with pytest.raises(ValueError, match=r"skip position -1"):
        BatchSkipper(positions=[-1])
    with pytest.raises(ValueError, match=r"at least one position"):
        BatchSkipper()
    with pytest.raises(ValueError, match=r"factor=0 must be a finite number > 0"):
        LRScaler(factor=0)
    with pytest.raises(ValueError, match=r"factor=inf must be a finite number > 0"):
        LRScaler(factor=float("inf"))  # an infinite LR: NaN at the next step
    with pytest.raises(ValueError, match=r"factor=True must be a finite number > 0"):
        LRScaler(factor=True)
    with pytest.raises(ValueError, match=r"start_step=2.5 must be an integer >= 0"):
        LRScaler(factor=0.5, start_step=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"end_step=5 must be > start_step=5"):
        LRScaler(factor=0.5, start_step=5, end_step=5)
    with pytest.raises(ValueError, match=r"distance=-1"):
        RollbackRestore(tmp_path, spike_step=10, distance=-1)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        _ = RollbackRestore(tmp_path / "nowhere", spike_step=10).ckpt_path


# ------------------------------------------------------------------ detection


def test_spike_detector_flags_a_jump_and_a_nan_and_not_noise() -> None:
    detector = SpikeDetector(window=5, warmup=5, ratio=1.4)
    values = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02, 3.1, 2.9, 2.0, float("nan"), 2.0]
    for step, value in enumerate(values):
        detector.check(step, {"loss": value})
    assert [s["step"] for s in detector.spikes] == [7, 10]  # 2.9 after 3.1 is no longer new
    assert detector.onsets == [7, 10]
    first = detector.spikes[0]
    assert first["metric"] == "loss" and first["value"] == 3.1
    assert first["reference"] == pytest.approx(
        sum(values[2:7]) / 5
    )  # a mean, not an exactness claim
    assert math.isnan(detector.spikes[1]["value"])


@pytest.mark.parametrize("metric", ["loss", "max_logit", "grad_norm"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_spike_detector_flags_a_non_finite_value_of_any_watched_metric(
    metric: str, bad: float
) -> None:
    detector = SpikeDetector(monitor=metric, window=5, warmup=5)
    assert detector.check(0, {metric: bad})  # even before the warm-up ends
    for step in range(1, 7):
        assert not detector.check(step, {metric: 2.0})  # and it never entered the reference
    found = detector.check(7, {metric: bad})
    assert [s["step"] for s in found] == [7]
    assert not math.isfinite(found[0]["value"]) and found[0]["reference"] == 2.0


def test_spike_detector_z_score_mode() -> None:
    detector = SpikeDetector(window=10, warmup=10, ratio=None, z_score=6.0)
    for step in range(10):
        detector.check(step, {"loss": 2.0 + 0.01 * (step % 3)})
    assert not detector.check(10, {"loss": 2.05})
    assert detector.check(11, {"loss": 2.5})


def test_spike_detector_does_not_flag_a_smooth_run(tmp_path: Path) -> None:
    detector = SpikeDetector(ratio=1.4)  # the demo's rule: the strictest
    fit(tmp_path, "smooth", 40, callbacks=[detector], optim=replace(TINY_OPTIM, max_steps=40))
    assert list(detector.spikes) == []


def test_spike_detector_flags_a_poisoned_batch_and_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    detector = SpikeDetector(warmup=10, window=10, ratio=1.2, action="stop", verbose=True)
    data = replace(TINY_DATA, poison=(25,))
    run = fit(
        tmp_path,
        "poisoned",
        40,
        callbacks=[detector],
        data=data,
        optim=replace(TINY_OPTIM, max_steps=40),
    )
    assert detector.onsets == [25]
    assert run.trainer.global_step == 26  # stopped right after the spike step
    assert max(run.losses) == 25
    # verbose: said on the console too (a log-only detector said nothing but TensorBoard)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpikeDetector")]
    assert len(said) == 1 and said[0].startswith("SpikeDetector: loss spike at step 25: ")
    assert said[0].endswith("x); stopping")


class _NaNAtStep(TinyGPTModule):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 12:
            self.history[-1]["loss"] = float("nan")
            return loss * float("nan")
        return loss


def test_spike_detector_flags_nan_loss(tmp_path: Path) -> None:
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.tools.training import RunSpec
    from tests.conftest import TINY_GPT

    detector = SpikeDetector(action="stop")
    module = _NaNAtStep(gpt=TINY_GPT, optim=TINY_OPTIM)
    spec = RunSpec(
        tmp_path,
        "nan",
        N,
        callbacks=[detector],
        progress_bar=False,
        trainer_kwargs={"limit_val_batches": 0},
    )
    trainer = spec.trainer()
    # The loss is finite in the module's own check (NaN only after it): its gradients are not.
    with pytest.warns(UserWarning, match="non-finite gradient norm at step 12: its update is"):
        trainer.fit(module, datamodule=StepDataModule(TINY_DATA))
    assert [s["step"] for s in detector.spikes] == [12]
    assert trainer.global_step == 13


# ------------------------------------------------------------------ state through a real .ckpt


def test_spike_detector_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    data, optim = replace(TINY_DATA, poison=(25,)), replace(TINY_OPTIM, max_steps=40)
    saved = SpikeDetector(warmup=10, window=10, ratio=1.2)
    reference = fit(
        tmp_path, "ref", 30, checkpoint_every=10, callbacks=[saved], data=data, optim=optim
    )
    assert saved.onsets == [25]
    ckpt = checkpoint_path(reference.spec.run_dir, 30)
    assert load_ckpt(ckpt)["callbacks"][saved.state_key] == saved.state_dict()
    restored = SpikeDetector(warmup=10, window=10, ratio=1.2)
    other = SpikeDetector(warmup=10, window=4, ratio=1.2)  # another instance, another key
    fit(
        tmp_path, "resumed", 30, ckpt_path=ckpt, callbacks=[restored, other], data=data, optim=optim
    )
    assert restored.state_dict() == saved.state_dict()
    assert list(other.spikes) == []


def test_callbacks_that_judge_or_skip_differently_can_share_a_trainer(tmp_path: Path) -> None:
    """Each instance's state has its own key: two that differ in any setting that changes
    what they do (here: only in action, start step, or the positions beyond the first and
    the count) were once refused by Lightning as duplicates."""
    pairs = [
        (SpikeDetector(action="log"), SpikeDetector(action="stop", min_step=100)),
        (SpikeDetector(mode="any", z_score=3.0), SpikeDetector(mode="all", z_score=3.0)),
        (SkipStep(start_step=0), SkipStep(start_step=50)),
        (BatchSkipper(positions=[10, 11, 12]), BatchSkipper(positions=[10, 20, 30])),
    ]
    for first, second in pairs:
        assert first.state_key != second.state_key
        run = fit(tmp_path, "pair", 2, checkpoint_every=2, callbacks=[first, second])
        states = load_ckpt(checkpoint_path(run.spec.run_dir, 2))["callbacks"]
        assert states[first.state_key] == first.state_dict()
        assert states[second.state_key] == second.state_dict()
        shutil.rmtree(run.spec.run_dir)


def test_remedy_states_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    skipper, scaler = BatchSkipper(ranges=[(12, 15)]), LRScaler(0.5, start_step=3)
    reference = fit(tmp_path, "ref", K, checkpoint_every=EVERY, callbacks=[skipper, scaler])
    ckpt = load_ckpt(checkpoint_path(reference.spec.run_dir, K))
    assert ckpt["callbacks"][skipper.state_key] == {"skip": [12, 13, 14]}
    assert ckpt["callbacks"][scaler.state_key] == {"factor": 0.5, "start_step": 3, "end_step": None}
    assert ckpt["StepDataModule"]["skip"] == [12, 13, 14]


# ------------------------------------------------------------------ remedies resume bit-exactly


def test_batch_skipper_run_resumes_bit_exactly(tmp_path: Path) -> None:
    reference = fit(
        tmp_path, "ref", N, checkpoint_every=EVERY, callbacks=[BatchSkipper(ranges=[(12, 16)])]
    )
    positions = [r["position"] for r in reference.module.history]
    assert positions == [*range(12), *range(16, 24)]
    # data/skipped counts the positions skipped up to each step's own batch, logged at
    # that step (it once logged the next step's count)
    skipped = tb_scalars(reference.spec.run_dir)["data/skipped"]
    assert skipped == [(step, 0.0 if step < 12 else 4.0) for step in range(N)]
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
        callbacks=[BatchSkipper(ranges=[(12, 16)])],
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )
    # Skipping is restored from the checkpoint even without the callback.
    bare = fit(
        tmp_path,
        "bare",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
    )
    assert [r["position"] for r in bare.module.history] == positions[K:]


def test_lr_scaler_run_resumes_bit_exactly(tmp_path: Path) -> None:
    reference = fit(
        tmp_path, "ref", N, checkpoint_every=EVERY, callbacks=[LRScaler(0.5, start_step=7)]
    )
    plain = fit(tmp_path, "plain", 8)
    assert reference.module.history[7]["lr"] == plain.module.history[7]["lr"] * 0.5
    assert reference.module.history[6]["lr"] == plain.module.history[6]["lr"]
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
        callbacks=[LRScaler(0.5, start_step=7)],
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )


def test_two_lr_scalers_differing_only_in_their_end_each_keep_their_own_state(
    tmp_path: Path,
) -> None:
    def scalers() -> list[LRScaler]:
        return [LRScaler(0.5, start_step=3, end_step=6), LRScaler(0.5, start_step=3, end_step=9)]

    reference = fit(tmp_path, "ref", N, checkpoint_every=EVERY, callbacks=scalers())
    saved = load_ckpt(checkpoint_path(reference.spec.run_dir, K))["callbacks"]
    assert sorted(v["end_step"] for k, v in saved.items() if k.startswith("LRScaler")) == [6, 9]
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
        callbacks=scalers(),
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )


def test_gradient_clipping_logs_the_norm_before_clipping(tmp_path: Path) -> None:
    clipped = fit(tmp_path, "clipped", 5, gradient_clip_val=1e-3)
    free = fit(tmp_path, "free", 5)
    assert clipped.module.history[0]["grad_norm"] == free.module.history[0]["grad_norm"] > 1e-3
    assert clipped.module.history[1]["loss"] != free.module.history[1]["loss"]


def test_grad_norm_is_bit_equal_to_what_clipping_measures() -> None:
    """The logged norm is the one ``clip_grad_norm_`` compares with its threshold."""
    from lit_spikes.demo.model import GPTConfig, build_model
    from lit_spikes.demo.module import grad_norm

    model = build_model(GPTConfig(), 1)
    for scale in (1e-30, 1e-3, 1.0, 1e20):
        generator = torch.Generator().manual_seed(int(-math.log10(scale) * 7) % 1000)
        for parameter in model.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator) * scale
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        expected = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        assert torch.equal(grad_norm(model.parameters()), expected), scale
    for parameter in model.parameters():
        parameter.grad = None
    assert grad_norm(model.parameters()).item() == 0.0


# ------------------------------------------------------------------ rollback


def test_rollback_picks_newest_checkpoint_before_the_spike_and_skips_corrupt(
    tmp_path: Path,
) -> None:
    reference = fit(tmp_path, "ref", N, checkpoint_every=EVERY)
    ckpt_dir = reference.spec.run_dir / "checkpoints"
    assert RollbackRestore(ckpt_dir, spike_step=17, distance=2).ckpt_step == 15
    assert RollbackRestore(ckpt_dir, spike_step=17, distance=3).ckpt_step == 10
    (ckpt_dir / "step=10.ckpt").write_bytes(b"")  # an interrupted save
    truncated = (ckpt_dir / "step=5.ckpt").read_bytes()
    rollback = RollbackRestore(ckpt_dir, spike_step=17, distance=3)
    with pytest.warns(UserWarning, match=r"step=10.ckpt: the file is empty"):
        assert rollback.ckpt_step == 5
    assert len(rollback.refused) == 1
    (ckpt_dir / "step=5.ckpt").write_bytes(truncated[: len(truncated) // 2])
    with pytest.warns(UserWarning), pytest.raises(FileNotFoundError, match="no valid checkpoint"):
        _ = RollbackRestore(ckpt_dir, spike_step=17, distance=3).ckpt_path


def test_rollback_restore_resumes_from_the_chosen_checkpoint(tmp_path: Path) -> None:
    reference = fit(tmp_path, "ref", N, checkpoint_every=EVERY)
    rollback = RollbackRestore(reference.spec.run_dir / "checkpoints", spike_step=13, distance=3)
    branch = fit(
        tmp_path,
        "branch",
        N,
        ckpt_path=rollback.ckpt_path,
        callbacks=[rollback],
        checkpoint_every=EVERY,
    )
    assert min(branch.losses) == 10
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(branch.spec.run_dir, N)),
    )
    with pytest.raises(ValueError, match="RollbackRestore chose"):
        fit(tmp_path, "wrong", N, callbacks=[rollback])
    # Preempted at step 15 and rerun from its own file with the same callbacks (as the
    # README's example would be), the branch goes on: the same as the one never stopped.
    first = RollbackRestore(reference.spec.run_dir / "checkpoints", spike_step=13, distance=3)
    stopped = fit(
        tmp_path,
        "stopped",
        15,
        ckpt_path=first.ckpt_path,
        callbacks=[first],
        checkpoint_every=EVERY,
    )
    again = RollbackRestore(reference.spec.run_dir / "checkpoints", spike_step=13, distance=3)
    own_file = checkpoint_path(stopped.spec.run_dir, 15)
    fit(tmp_path, "stopped", N, ckpt_path=own_file, callbacks=[again], checkpoint_every=EVERY)
    assert again.ckpt_step == 10  # the rollback it continues, not chosen again
    final = load_ckpt(checkpoint_path(stopped.spec.run_dir, N))
    assert final["callbacks"][again.state_key]["ckpt_step"] == 10
    assert_states_equal(load_ckpt(checkpoint_path(branch.spec.run_dir, N)), final)


def test_detector_state_key_follows_its_settings() -> None:
    detector = SpikeDetector(window=20, ratio=1.4)
    expected = detector._generate_state_key(
        monitor=("loss",),
        window=20,
        ratio=detector.ratio,
        z_score=detector.z_score,
        mode="any",
        warmup=detector.warmup,
        action="log",
    )
    assert detector.state_key == expected == detector.state_key
    detector.window, detector.action = 30, "stop"
    assert "'window': 30" in detector.state_key and "'action': 'stop'" in detector.state_key


class _CosineModule(TinyGPTModule):
    """A scheduler that computes each LR from the current one (most of torch's do)."""

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


class _NoSchedulerModule(TinyGPTModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _lrs(module: TinyGPTModule, callbacks: list[object], steps: int = 8) -> list[float]:
    import lightning.pytorch as pl

    from lit_spikes.demo.data import StepDataModule

    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=callbacks,  # type: ignore[arg-type]
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=StepDataModule(TINY_DATA))
    return [record["lr"] for record in module.history]


def test_lr_scaler_leaves_a_recursive_schedule_untouched() -> None:
    """Cosine annealing computes each LR from the last one: the scaled LR must not become
    its own, or the factor compounds every step and stays after end_step."""
    from tests.conftest import TINY_GPT

    plain = _lrs(_CosineModule(gpt=TINY_GPT, optim=TINY_OPTIM), [])
    scaled = _lrs(
        _CosineModule(gpt=TINY_GPT, optim=TINY_OPTIM), [LRScaler(0.5, start_step=2, end_step=5)]
    )
    expected = [lr * 0.5 if 2 <= step < 5 else lr for step, lr in enumerate(plain)]
    assert scaled == expected


def test_lr_scaler_refuses_an_optimizer_without_a_scheduler() -> None:
    from tests.conftest import TINY_GPT

    module = _NoSchedulerModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    with pytest.raises(ValueError, match="optimizer 0 \\(AdamW\\) has none"):
        _lrs(module, [LRScaler(0.5, start_step=2)])


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


def test_a_setting_written_as_an_integer_names_the_same_callback_state() -> None:
    """ratio: 2 in a YAML config and --ratio 2.0 on a command line are one detector: a
    resume must find its checkpointed window under either."""
    assert SpikeDetector(ratio=2).state_key == SpikeDetector(ratio=2.0).state_key
    assert SpikeDetector(monitor="loss").state_key == SpikeDetector(monitor=["loss"]).state_key
    assert SpikeDetector(z_score=3).state_key == SpikeDetector(z_score=3.0).state_key
    assert LRScaler(1, start_step=4).state_key == LRScaler(1.0, start_step=4).state_key


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CheckpointRetention("d", keep_last=2.5), "keep_last=2.5 must be an integer >= 1"),
        (lambda: CheckpointRetention("d", keep_last=True), "keep_last=True must be an integer"),
        (
            lambda: CheckpointRetention("d", rollback_distance=math.nan),
            "rollback_distance=nan must be an integer >= 0",
        ),
        (lambda: RollbackRestore("d", spike_step=122.5), "spike_step=122.5 must be an integer"),
        (lambda: RollbackRestore("d", spike_step="122"), "spike_step='122' must be an integer"),
        (lambda: FinalCheckpoint("d", every_n_steps=2.5), "every_n_steps=2.5 must be an integer"),
    ],
)
def test_checkpoint_callbacks_refuse_non_integer_steps_naming_them(
    build: Any, message: str
) -> None:
    """Each failed mid-training (a slice of 2.5) or silently deleted every rollback
    target (a NaN horizon): refused when built instead."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_numpy_integers_are_taken_as_ints() -> None:
    """A step from an array (np.int64) is an integer: taken, and kept as an int so that
    a state key shows 10, not np.int64(10)."""
    import numpy as np

    rollback = RollbackRestore("d", spike_step=np.int64(122), distance=np.int32(20))
    assert (rollback.spike_step, rollback.distance) == (122, 20)
    assert type(rollback.spike_step) is int
    assert SpikeDetector(window=np.int64(10)).state_key == SpikeDetector(window=10).state_key
    assert CheckpointRetention("d", keep_last=np.int64(2)).keep_last == 2
