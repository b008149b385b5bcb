"""``SpikeDetector``: its arguments and rules (the default robust z-score as a pure
function), the spikes and NaNs it flags on planted runs, the keys it judges and when, and
its state through real checkpoints."""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, SkipStep, SpikeDetector
from lit_spikes.callbacks.spike_detector import robust_limit
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import TINY_DATA, TINY_OPTIM, NaNAtStepModule, fit, load_ckpt
from tests.modules.guarantee_modules import (
    PlantedMetric,
)
from tests.modules.guarantee_runs import train_guarded
from tests.modules.plain_runs import BATCH, loader, train
from tests.modules.user_modules import (
    DropoutRegressor,
    LoggingRegressor,
    PoisonedRows,
)
from tests.modules.watched_runs import WatchedRegressor, dropped, fit_watched

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


def _rule(**settings: Any) -> SpikeDetector:
    return SpikeDetector(monitor="train_loss", window=5, warmup=5, ratio=3.0, **settings)


def test_a_resume_may_change_what_the_detector_does_and_keeps_its_window(tmp_path: Path) -> None:
    """The same rule resumed with another ``action`` or ``verbose`` restores the window:
    the planted spike at step 9 is flagged after a resume at 6 (with 3 steps judged after
    it, an empty window of warmup 5 would flag nothing)."""
    data = lambda: StepLoader(planted(), BATCH, seed=7)  # noqa: E731
    whole = _rule()
    train(tmp_path / "w", LoggingRegressor(), data(), 12, [whole, ExactResume()])
    first = _rule(action="stop")
    train(tmp_path / "a", LoggingRegressor(), data(), 6, [first, ExactResume()])
    assert first.state_key == whole.state_key and not first.spikes
    resumed = _rule(verbose=True)
    ckpt = tmp_path / "a" / "step=6.ckpt"
    train(tmp_path / "b", LoggingRegressor(), data(), 12, [resumed, ExactResume()], ckpt)
    assert [s["step"] for s in resumed.spikes] == [s["step"] for s in whole.spikes] == [SPIKE]
    assert resumed.state_dict()["recent"] == whole.state_dict()["recent"]


OTHER_KEY = "ignore:Be aware that when using `ckpt_path`.*SpikeDetector:UserWarning"
"""Lightning's own warning for a key no callback of the resume has (this file's point)."""


@pytest.mark.filterwarnings(OTHER_KEY)
def test_a_file_of_the_older_key_with_action_is_restored(tmp_path: Path) -> None:
    """Files written while the key held ``action`` resume as well: the state under
    ``SpikeDetector{..., 'action': 'stop'}`` is taken, and the file alone rebuilds it."""
    from lit_spikes.tools.resume_callbacks import rebuild

    data = lambda: StepLoader(planted(), BATCH, seed=7)  # noqa: E731
    first = _rule(action="stop")
    train(tmp_path / "a", LoggingRegressor(), data(), 6, [first, ExactResume()])
    ckpt = tmp_path / "a" / "step=6.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    old_key = first._generate_state_key(
        monitor=("train_loss",),
        window=5,
        ratio=3.0,
        z_score=None,
        mode="any",
        warmup=5,
        action="stop",
    )
    assert old_key in first.older_state_keys and old_key != first.state_key
    checkpoint["callbacks"][old_key] = checkpoint["callbacks"].pop(first.state_key)
    torch.save(checkpoint, ckpt)
    resumed = _rule()
    train(tmp_path / "b", LoggingRegressor(), data(), 12, [resumed, ExactResume()], ckpt)
    assert [s["step"] for s in resumed.spikes] == [SPIKE]
    built = rebuild(old_key, checkpoint["callbacks"][old_key])
    assert built is not None and built[0].action == "stop" and "action" not in built[2]


@pytest.mark.filterwarnings(OTHER_KEY)
def test_a_detector_whose_state_is_not_restored_is_named_in_a_warning(tmp_path: Path) -> None:
    data = lambda: StepLoader(planted(), BATCH, seed=7)  # noqa: E731
    train(tmp_path / "a", LoggingRegressor(), data(), 6, [_rule(), ExactResume()])
    other = SpikeDetector(monitor="train_loss", window=4, warmup=4, ratio=3.0)
    ckpt = tmp_path / "a" / "step=6.ckpt"
    with pytest.warns(UserWarning, match=r"SpikeDetector\{.*'window': 4.*restored nothing"):
        train(tmp_path / "b", LoggingRegressor(), data(), 8, [other, ExactResume()], ckpt)
    assert other.state_dict()["seen"] == 2


def test_the_action_rides_in_the_state_and_a_rebuild_from_the_file_keeps_it() -> None:
    from lit_spikes.tools.resume_callbacks import rebuild

    stop = _rule(action="stop")
    built = rebuild(stop.state_key, stop.state_dict())
    assert built is not None and built[0].action == "stop" and "action" not in built[2]
    assert built[0].state_key == stop.state_key


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
    train_guarded(tmp_path, PlantedMetric(SCORES), len(SCORES), [detector])
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


N, K, EVERY = 20, 10, 5


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


def test_spike_detector_flags_a_jump_and_a_nan_and_not_noise() -> None:
    detector = SpikeDetector(window=5, warmup=5, ratio=1.4)
    values = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02, 3.1, 2.9, 2.0, float("nan"), 2.0]
    for step, value in enumerate(values):
        detector.check(step, {"loss": value})
    assert [s["step"] for s in detector.spikes] == [7, 10]  # 2.9 after 3.1 is no longer new
    assert detector.onsets == [7]  # the NaN three steps on: the same episode (settle 10)
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
    caplog.set_level(logging.INFO, logger="lightning.pytorch")  # Lightning's default level
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
    assert len(said) == 2 and said[0].startswith("SpikeDetector: loss spike at step 25: ")
    assert said[0].endswith("x); stopping")
    assert said[1].startswith("SpikeDetector(loss): 1 spike episode in 26 steps: step 25 (")


def test_spike_detector_flags_nan_loss(tmp_path: Path) -> None:
    from lit_spikes.demo.data import StepDataModule
    from lit_spikes.shared.training import RunSpec
    from tests.conftest import TINY_GPT

    detector = SpikeDetector(action="stop")
    module = NaNAtStepModule(gpt=TINY_GPT, optim=TINY_OPTIM)
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
    with pytest.warns(UserWarning, match=r"'window': 4.*restored nothing"):
        fit(
            tmp_path,
            "resumed",
            30,
            ckpt_path=ckpt,
            callbacks=[restored, other],
            data=data,
            optim=optim,
        )
    assert restored.state_dict() == saved.state_dict()
    assert list(other.spikes) == []


def test_detector_state_key_follows_its_settings() -> None:
    detector = SpikeDetector(window=20, ratio=1.4)
    expected = detector._generate_state_key(
        monitor=("loss",),
        window=20,
        ratio=detector.ratio,
        z_score=detector.z_score,
        mode="any",
        warmup=detector.warmup,
    )
    assert detector.state_key == expected == detector.state_key
    detector.window = 30
    assert "'window': 30" in detector.state_key
    before = detector.state_key
    detector.action, detector.verbose = "stop", True  # what it does with a flag: not judging
    assert detector.state_key == before and "action" not in before


def flags(detector: SpikeDetector, values: list[float]) -> list[int]:
    return [s["step"] for i, v in enumerate(values) for s in detector.check(i, {"loss": v})]


def near_zero_loss(steps: int = 600, level: float = 0.05) -> list[float]:
    """A healthy loss near zero: each batch's loss is the level times a log-normal noise
    (a batch's loss is a mean of positive terms: skewed up, a tail of 2-3x the level)."""
    noise = torch.randn(steps, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (level * torch.exp(0.3 * noise)).tolist()


def test_the_default_flags_no_step_of_a_healthy_loss_near_zero() -> None:
    """The old default (1.4x the mean of 20 steps) flagged a healthy run near 0.05 by the
    dozen; the default judges by the window's own spread."""
    values = near_zero_loss()
    assert flags(SpikeDetector(), values) == []
    assert len(flags(SpikeDetector(ratio=1.4), values)) > 20  # the demo's rule would


def test_the_default_catches_a_10x_loss_whatever_the_scale_and_offset() -> None:
    values = near_zero_loss()
    for step in (150, 300, 599):  # each alone, 10x the level it rises from
        planted = list(values)
        planted[step] = 10 * statistics.median(values[step - 100 : step])
        for scale, offset in ((1.0, 0.0), (1000.0, 0.0), (1.0, 3.0), (0.001, -2.0)):
            moved = [scale * v + offset for v in planted]
            assert flags(SpikeDetector(), moved) == [step], (step, scale, offset)


def test_a_window_without_spread_makes_no_finite_value_a_spike() -> None:
    """As SkipStep: no spread, no scale to call a value an outlier by (a MAD of 0 with
    some spread falls back to the mean absolute deviation); NaN is always a spike."""
    assert robust_limit([2.0] * 10, 8.0) == math.inf
    # 7 of 10 equal: a MAD of 0, the mean deviation still gives a scale
    assert robust_limit([1.0] * 7 + [2.0] * 3, 8.0) == pytest.approx(1.0 + 8 * 1.2533 * 0.3)
    detector = SpikeDetector(window=10, warmup=10)
    assert flags(detector, [2.0] * 10 + [2.5]) == []
    assert [s["step"] for s in detector.check(11, {"loss": math.nan})] == [11]
    z = SpikeDetector(window=10, warmup=10, z_score=3.0)  # the z rule, likewise
    assert flags(z, [2.0] * 10 + [2.5]) == []


def test_a_threshold_given_keeps_its_rule_window_and_checkpoint_name() -> None:
    """ratio or z_score alone: no robust rule added, the window of 20 as before, and the
    same state key as a detector written before robust_z existed (a resume finds it)."""
    detector = SpikeDetector(ratio=1.4)
    assert (detector.robust_z, detector.window, detector.warmup) == (None, 20, 20)
    old_key = detector._generate_state_key(
        monitor=("loss",),
        window=20,
        ratio=1.4,
        z_score=None,
        mode="any",
        warmup=20,
        action="log",
    )
    assert old_key in detector.older_state_keys
    default = SpikeDetector()
    assert (default.robust_z, default.window, default.warmup) == (8.0, 100, 100)
    assert "robust_z" in default.state_key


def test_recover_and_diagnose_judge_a_users_module_by_the_scale_free_default() -> None:
    """``--detector.*`` left unset: the built-in model keeps its demo's rule, a user's
    module gets the detector's own (the demo's 1.4x flagged the loss near zero above by
    the dozen); a rule given is used as given, for either."""
    from lit_spikes.demo.module import TinyGPTModule
    from lit_spikes.tool_facts import facts_of
    from lit_spikes.tools.detector_config import DetectorConfig

    demo = facts_of(TinyGPTModule())
    builtin, users = DetectorConfig().build(demo), DetectorConfig().build()
    assert (builtin.ratio, builtin.robust_z, builtin.window, builtin.warmup) == (1.4, None, 20, 20)
    assert (users.ratio, users.robust_z, users.window) == (None, SpikeDetector().robust_z, 100)
    assert flags(users, near_zero_loss()) == []
    for facts in (demo, None):
        given = DetectorConfig(ratio=3.0).build(facts)
        assert (given.ratio, given.robust_z, given.window) == (3.0, None, 20)


@pytest.mark.parametrize("watcher", ["detector", "skip"])
def test_strict_refuses_a_key_not_logged_this_step_naming_it_and_the_step(
    watcher: str,
) -> None:
    callback: Callback = (
        SpikeDetector(monitor="sparse", window=3, warmup=2, ratio=1.4)
        if watcher == "detector"
        else SkipStep(monitor="sparse", window=4, warmup=2)
    )
    with pytest.raises(RuntimeError, match=r"\['sparse'\] not logged in training step 1"):
        fit_watched(WatchedRegressor(sparse_every=5), [callback], 12)


def test_a_sparse_key_is_judged_only_where_logged() -> None:
    """Logged every 5th step, x100 at step 10: one spike, at 10; 8 values judged."""
    detector = SpikeDetector(monitor="sparse", window=3, warmup=2, ratio=3.0, strict=False)
    skip = SkipStep(monitor="sparse", window=16, warmup=2, strict=False)
    module = WatchedRegressor(sparse_every=5, sparse_poison={10: 100.0})
    fit_watched(module, [detector, skip], 40)
    assert [s["step"] for s in detector.spikes] == [10]
    assert detector._seen == 40  # every step is seen, ...
    assert len(skip.values) == 8  # ... but only the 8 logged values enter a window
    assert list(skip.skipped_steps) == [10]  # not ordinary step 5 on step 0's value again


def test_a_window_without_spread_makes_no_finite_value_an_outlier() -> None:
    skip = SkipStep(window=4, warmup=2, initial=[1.0, 1.0, 1.0])
    assert skip.threshold() == math.inf
    assert not skip.decide(0, 1.0 + 1e-9)
    assert skip.decide(1, math.nan)
    assert list(skip.skipped_steps) == [1]


@pytest.mark.parametrize("watcher", ["detector", "skip"])
def test_a_key_logged_only_in_validation_is_refused_or_never_judged(watcher: str) -> None:
    def make(strict: bool) -> Any:
        if watcher == "detector":
            return SpikeDetector(monitor="val_loss", window=3, warmup=2, ratio=1.4, strict=strict)
        return SkipStep(monitor="val_loss", window=4, warmup=2, strict=strict)

    validating = {"val_check_interval": 10, "limit_val_batches": 2}
    with pytest.raises(RuntimeError, match=r"\['val_loss'\] not logged in training step 0"):
        fit_watched(WatchedRegressor(), [make(strict=True)], 30, **validating)
    callback = make(strict=False)
    fit_watched(WatchedRegressor(), [callback], 30, **validating)
    if watcher == "detector":
        assert list(callback._recent["val_loss"]) == [] and not callback.spikes
    else:
        assert list(callback.values) == [] and list(callback.skipped_steps) == []


@pytest.mark.parametrize("micro", [0, 1], ids=["first-micro-batch", "second-micro-batch"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_outlier_micro_batch_makes_its_optimizer_step_an_outlier(
    micro: int, optimizer: str
) -> None:
    step = 12
    module = WatchedRegressor(optimizer, poison={2 * step + micro: 100.0})
    detector = SpikeDetector(window=8, warmup=8, ratio=3.0)
    skip = SkipStep(window=8, warmup=8)
    trainer = fit_watched(module, [detector, skip], 16, accumulate_grad_batches=2)
    assert [s["step"] for s in detector.spikes] == [step]
    assert detector._seen == 16  # one judgement per optimizer step
    assert list(skip.skipped_steps) == [step]
    assert dropped(trainer, step)
    assert not dropped(trainer, step - 1) and not dropped(trainer, step + 1)


def test_an_accumulated_steps_loss_is_the_mean_of_its_micro_batches() -> None:
    """Judged: (l0 + l1) / 2 per step, each micro-batch's loss counted once however many
    watchers there are."""
    module = WatchedRegressor()
    skip = SkipStep(window=8, warmup=8)
    detector = SpikeDetector(window=8, warmup=8, ratio=1.4)
    fit_watched(module, [detector, skip], 6, accumulate_grad_batches=2)
    losses = module.losses
    means = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2], strict=True)]
    assert list(skip.values) == pytest.approx(means, rel=1e-6)
    assert list(detector._recent["loss"]) == pytest.approx(means, rel=1e-6)
