"""Two DDP processes (gloo, one CPU thread each): sharded step-indexed data, bit-exact
resume at the same world size, a spike in one rank's shard stopping every rank, remedies.

Each DDP run is a separate ``python -m tests.demo.test_ddp <spec.json>`` process: Lightning's
``strategy="ddp"`` starts rank 1 by running that same command again (its
``_SubprocessScriptLauncher``), which would re-run pytest's own argv if it were started
inside pytest. Every rank writes what it saw (its history, its detector's spikes, its
final step) to ``<out>/<name>.rank<r>.json`` for the test to compare.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lit_spikes.callbacks import BatchSkipper, LRScaler, SpikeDetector
from lit_spikes.callbacks.exact_resume import STATE_KEY
from lit_spikes.demo.data import DataConfig, StepDataModule
from lit_spikes.demo.module import TinyGPTModule
from lit_spikes.shared.training import RunSpec, checkpoint_path
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

WORLD = 2
N, K, EVERY = 20, 10, 5
DROPOUT = {"dropout": 0.1}
"""Dropout in the resume runs: each rank draws its own masks, so every rank's RNG state
must come back from the checkpoint (rank 0 alone writes the file)."""
DDP_TIMEOUT_S = 120
"""Wall-clock limit of one DDP run: a rank left waiting in a collective fails the test
instead of hanging it (the gloo timeout is 60 s)."""


# --------------------------------------------------------------------------- the DDP worker


class NaNOnOneRank(TinyGPTModule):
    """TinyGPTModule whose loss is NaN at global step ``nan_step`` on rank ``nan_rank`` only."""

    def __init__(self, *args: Any, nan_step: int, nan_rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nan_step, self.nan_rank = nan_step, nan_rank
        forward = self.model.forward

        def planted(idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
            out = forward(idx, targets)
            here = (self.global_step, self.global_rank) == (self.nan_step, self.nan_rank)
            if self.training and targets is not None and here:
                return out._replace(loss=out.loss * float("nan"))
            return out

        self.model.forward = planted  # type: ignore[method-assign]


def _worker(spec_path: str) -> None:
    """Body of ``python -m tests.demo.test_ddp <spec.json>``: one DDP run, run by every rank."""
    spec = json.loads(Path(spec_path).read_text())
    callbacks: list[Any] = []
    detector = SpikeDetector(**spec["detector"]) if spec.get("detector") else None
    if detector is not None:
        callbacks.append(detector)
    if spec.get("skipper"):
        callbacks.append(BatchSkipper(ranges=[tuple(r) for r in spec["skipper"]["ranges"]]))
    if spec.get("scaler"):
        callbacks.append(LRScaler(**spec["scaler"]))
    data = dict(spec.get("data", {}))
    if "poison" in data:
        data["poison"] = tuple(data["poison"])
    if "world" in data:
        data["world"] = replace(TINY_DATA.world, **data["world"])
    kwargs: dict[str, Any] = {
        "gpt": replace(TINY_GPT, **spec.get("gpt", {})),
        "optim": replace(TINY_OPTIM, **spec.get("optim", {})),
        "model_seed": 0,
    }
    nan = spec.get("nan")
    module = (
        NaNOnOneRank(**kwargs, nan_step=nan["step"], nan_rank=nan["rank"])
        if nan
        else TinyGPTModule(**kwargs)
    )
    trainer_kwargs: dict[str, Any] = {
        "devices": WORLD,
        "strategy": DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
    }
    if spec.get("val_every") is None:
        trainer_kwargs["limit_val_batches"] = 0
    ckpt_path = spec.get("ckpt_path")
    run_spec = RunSpec(
        log_root=Path(spec["root"]),
        name=spec["name"],
        max_steps=spec["max_steps"],
        checkpoint_every=spec.get("checkpoint_every"),
        val_every=spec.get("val_every"),
        callbacks=callbacks,
        progress_bar=False,
        trainer_kwargs=trainer_kwargs,
        resume_step=int(load_ckpt(ckpt_path)["global_step"]) if ckpt_path else None,
    )
    trainer = run_spec.trainer()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|non-finite).*")
        trainer.fit(
            module, datamodule=StepDataModule(replace(TINY_DATA, **data)), ckpt_path=ckpt_path
        )
    bpc = trainer.callback_metrics.get("val/bpc")
    report = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "num_threads": torch.get_num_threads(),
        "global_step": trainer.global_step,
        "should_stop": trainer.should_stop,
        "history": module.history,
        "nonfinite_steps": module.nonfinite_steps,
        "spikes": [s.to_dict() for s in detector.spikes] if detector is not None else [],
        "val_bpc": float(bpc) if bpc is not None else None,
    }
    out = Path(spec["out"]) / f"{spec['name']}.rank{trainer.global_rank}.json"
    out.write_text(json.dumps(report))


def run_ddp(tmp: Path, name: str, max_steps: int, **spec: Any) -> list[dict[str, Any]]:
    """Train ``name`` under ``tmp`` with 2 DDP processes; returns each rank's report."""
    out = tmp / "reports"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"root": str(tmp), "name": name, "max_steps": max_steps, "out": str(out), **spec}
    if spec.get("ckpt_path") is not None:
        spec["ckpt_path"] = str(spec["ckpt_path"])
    spec_path = tmp / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = ddp_env()
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "tests.demo.test_ddp", str(spec_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=DDP_TIMEOUT_S,
    )
    wall = time.perf_counter() - start
    # The pipes close when every rank has exited (rank 1 inherits them), so each report
    # that will ever exist exists now. The exit code is rank 0's only.
    paths = [out / f"{name}.rank{rank}.json" for rank in range(WORLD)]
    missing = [rank for rank, path in enumerate(paths) if not path.exists()]
    assert result.returncode == 0 and not missing, (
        f"DDP run {name}: rank 0 exited with {result.returncode}, no report from rank(s) "
        f"{missing}:\n{result.stderr[-4000:]}"
    )
    reports = [json.loads(path.read_text()) for path in paths]
    assert [r["rank"] for r in reports] == list(range(WORLD))
    assert all(r["world_size"] == WORLD and r["num_threads"] == 1 for r in reports)
    print(f"DDP run {name}: {wall:.1f} s")
    return reports


def losses(report: dict[str, Any]) -> dict[int, float]:
    return {int(r["step"]): r["loss"] for r in report["history"]}


# ------------------------------------------------------------------ fast: no processes started


def test_batch_size_must_divide_by_the_world_size() -> None:
    dm = StepDataModule(replace(TINY_DATA, batch_size=6))
    dm.trainer = pl.Trainer(accelerator="cpu", devices=4, strategy="ddp", logger=False)
    assert dm.trainer.world_size == 4  # no process started: that happens in fit()
    with pytest.raises(ValueError, match=r"DataConfig.batch_size=6 .* world_size=4 .* e\.g\. 4"):
        dm.setup("fit")
    dm.trainer = pl.Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False)
    dm.setup("fit")  # 6 rows: 2 per process
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        dm.stream(0, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"batch_size=4 .* world_size=3"):
        StepDataModule(TINY_DATA).stream(0, rank=0, world_size=3)


def test_the_shard_is_checked_before_the_processes_start() -> None:
    """``lit-spikes fit`` asks the data (``check_run``) once the Trainer is built: its
    processes, each of which would fail in ``setup``, are not started yet."""
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False)
    dm = StepDataModule(TINY_DATA)  # 4 rows a batch
    with pytest.raises(ValueError, match=r"DataConfig.batch_size=4 .* world_size=3"):
        dm.check_run("validate", trainer, model=None, datamodule=dm, checkpoint=None)
    dm = StepDataModule(replace(TINY_DATA, batch_size=6))
    dm.check_run("validate", trainer, model=None, datamodule=dm, checkpoint=None)


def test_poison_first_half_lands_in_rank_0_shard_only() -> None:
    clean = StepDataModule(TINY_DATA)
    half = StepDataModule(replace(TINY_DATA, poison=(2,), poison_rows="first_half"))
    whole = StepDataModule(replace(TINY_DATA, poison=(2,)))

    def shard(dm: StepDataModule, step: int, rank: int) -> torch.Tensor:
        return next(iter(dm.stream(step, rank=rank, world_size=WORLD)))["y"]

    assert torch.equal(shard(half, 2, 0), shard(whole, 2, 0))  # rank 0: random characters
    assert not torch.equal(shard(half, 2, 0), shard(clean, 2, 0))
    assert torch.equal(shard(half, 2, 1), shard(clean, 2, 1))  # rank 1: the text
    assert torch.equal(shard(half, 1, 0), shard(clean, 1, 0))  # other positions untouched
    with pytest.raises(ValueError, match=r"poison_rows='some' must be 'all' or 'first_half'"):
        DataConfig(poison_rows="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"needs batch_size >= 2, got batch_size=1"):
        DataConfig(batch_size=1, poison_rows="first_half")


def test_validation_shards_cover_every_window_once() -> None:
    """An odd number of windows: Lightning's default DistributedSampler would pad one rank
    with a repeated window; ours gives 2 ranks 7 + 6 of the 13 windows, each once."""
    world = replace(TINY_DATA.world, num_chars=1000)
    dm = StepDataModule(replace(TINY_DATA, world=world, val_batch_size=2))
    seen = []
    for rank in range(WORLD):
        dm.trainer = SimpleNamespace(
            world_size=WORLD, global_rank=rank, state=SimpleNamespace(fn=None)
        )  # type: ignore[assignment]
        seen.append(list(dm.val_dataloader().sampler))
    windows = len(dm.val_dataloader().dataset)  # type: ignore[arg-type]
    assert windows % WORLD == 1
    assert sorted(seen[0] + seen[1]) == list(range(windows))
    dm.trainer = SimpleNamespace(
        world_size=windows + 1, global_rank=0, state=SimpleNamespace(fn=None)
    )  # type: ignore[assignment]
    with pytest.raises(ValueError, match=rf"{windows} windows .* world_size={windows + 1}"):
        dm.val_dataloader()


class _Strategy:
    root_device = torch.device("meta")  # not the CPU: a tensor made there would show

    def __init__(self, gathered: torch.Tensor) -> None:
        self.gathered, self.calls = gathered, 0

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        # NCCL gathers only tensors on the strategy's device (the GPU).
        assert tensor.device == self.root_device, tensor.device
        self.calls += 1
        return self.gathered


class _Trainer:
    """What the watching callbacks read of a Trainer under 2 processes."""

    world_size, global_step, precision_plugin = 2, 5, None

    def __init__(self, strategy: _Strategy, callbacks: list[Any]) -> None:
        self.strategy, self.callbacks = strategy, callbacks
        self.callback_metrics = {"train/max_logit": torch.tensor(5.0)}


def test_every_watched_value_of_every_callback_is_gathered_once_a_step() -> None:
    """One all_gather a step for all watchers' names, on the strategy's device; mean,
    largest (NaN wins), and a value only from the ranks that had one."""
    from lit_spikes.callbacks import SkipStep
    from lit_spikes.callbacks.watch import note_loss, step_values

    detector = SpikeDetector(monitor=["loss", "train/max_logit"], warmup=0, ratio=1.4, reduce="max")
    skip = SkipStep(monitor="grad_norm")
    nan = math.nan
    # names gathered in the order of the callbacks: loss, train/max_logit, grad_norm
    gathered = torch.tensor(
        [[[4.0, 5.0, nan], [1.0, 1.0, 0.0]], [[2.0, nan, 3.0], [1.0, 1.0, 1.0]]],
        dtype=torch.float64,
    )
    strategy = _Strategy(gathered)
    trainer: Any = _Trainer(strategy, [detector, skip])
    note_loss(trainer, torch.tensor(4.0, device="meta"))
    first = step_values(trainer, 5, ["grad_norm"])
    later = step_values(trainer, 5, ["loss", "train/max_logit"])
    assert strategy.calls == 1
    assert first.reduced("mean").tolist() == [3.0]  # rank 0 had no gradient norm
    assert later.reduced("mean")[0].item() == 3.0
    assert torch.isnan(later.reduced("max")[1])
    assert later.per_rank[:, 0].tolist() == [4.0, 2.0]


# ------------------------------------------------------------------ 2 DDP processes each


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The uninterrupted 2-process run to step N, with dropout, checkpoints every EVERY."""
    root = tmp_path_factory.mktemp("ddp")
    return root, run_ddp(root, "reference", N, checkpoint_every=EVERY, gpt=DROPOUT)


@pytest.mark.slow
def test_ddp_resume_is_bit_exact(
    reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, uninterrupted = reference
    resumed = run_ddp(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        gpt=DROPOUT,
        ckpt_path=checkpoint_path(root / "reference", K),
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(root / "reference", N)),
        load_ckpt(checkpoint_path(tmp_path / "resumed", N)),
    )
    for rank in range(WORLD):  # every rank's own loss, step by step
        ref, res = losses(uninterrupted[rank]), losses(resumed[rank])
        assert sorted(res) == list(range(K, N))
        assert all(res[s] == ref[s] for s in res), f"rank {rank}"
    # the ranks trained on different rows, and each restored its own RNG state
    assert losses(uninterrupted[0])[K] != losses(uninterrupted[1])[K]
    entry = load_ckpt(checkpoint_path(root / "reference", K))["callbacks"][STATE_KEY]
    assert entry["fingerprint"]["world_size"] == WORLD
    seeds = entry["seed_by_rank"]  # each rank's own seed (the demo seeds rank r with seed + r)
    assert len(seeds) == WORLD and seeds[0] != seeds[1]


@pytest.mark.slow
def test_lit_spikes_fit_resumes_a_ddp_run_from_a_named_checkpoint(tmp_path: Path) -> None:
    """The resume's check for a live run in the directory is rank 0's: the other ranks,
    started by Lightning while rank 0 holds the directory, exited 75 ('in use by another
    run') and rank 0 was killed."""
    from tests.conftest import TINY_CLI

    root = tmp_path / "run"
    fit_cli = [
        sys.executable,
        "-m",
        "lit_spikes.tools.cli",
        "fit",
        *TINY_CLI,
        "--checkpoint_every",
        "5",
    ]
    fit_cli += ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    fit_cli += ["--trainer.default_root_dir", str(root)]
    resume = ["--ckpt_path", str(checkpoint_path(root, 10))]
    for extra in (["--trainer.max_steps", "10"], ["--trainer.max_steps", "15", *resume]):
        result = subprocess.run(
            [*fit_cli, *extra],
            cwd=REPO,
            env=ddp_env(),
            capture_output=True,
            text=True,
            timeout=DDP_TIMEOUT_S,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    assert load_ckpt(checkpoint_path(root, 15))["global_step"] == 15


@pytest.mark.slow
def test_ddp_resume_with_rank_0_seed_on_every_rank_is_not_exact(
    reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Negative control: with rank 0's seed on rank 1 too (what a checkpoint written by
    rank 0 alone would hold), rank 1 draws other dropout masks from step K on."""
    root, uninterrupted = reference
    checkpoint = load_ckpt(checkpoint_path(root / "reference", K))
    seeds = checkpoint["callbacks"][STATE_KEY]["seed_by_rank"]
    seeds[1] = seeds[0]
    torch.save(checkpoint, tmp_path / f"step={K}.ckpt")
    resumed = run_ddp(
        tmp_path,
        "rank0_rng",
        N,
        checkpoint_every=EVERY,
        gpt=DROPOUT,
        ckpt_path=tmp_path / f"step={K}.ckpt",
    )
    assert losses(resumed[0])[K] == losses(uninterrupted[0])[K]
    assert losses(resumed[1])[K] != losses(uninterrupted[1])[K]
    final = load_ckpt(checkpoint_path(tmp_path / "rank0_rng", N))["state_dict"]
    expected = load_ckpt(checkpoint_path(root / "reference", N))["state_dict"]
    assert any(not torch.equal(final[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_resume_with_another_world_size_warns(
    reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, _ = reference
    with pytest.warns(UserWarning, match=r"world_size: checkpoint 2, now 1\).*not guaranteed"):
        run = fit(
            tmp_path,
            "single",
            K + 2,
            gpt=replace(TINY_GPT, **DROPOUT),
            ckpt_path=checkpoint_path(root / "reference", K),
        )
    assert sorted(run.losses) == [K, K + 1]


@pytest.mark.slow
def test_spike_in_one_ranks_shard_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    """Position 25 is random characters in rank 0's rows only. Rank 1's own loss does not
    jump, yet both ranks flag step 25 from the mean over ranks and stop after it."""
    detector = {"warmup": 10, "window": 10, "ratio": 1.2, "action": "stop"}
    reports = run_ddp(
        tmp_path,
        "poisoned",
        40,
        detector=detector,
        data={"poison": [25], "poison_rows": "first_half"},
        optim={"max_steps": 40},
    )
    for report in reports:
        assert [s["step"] for s in report["spikes"]] == [25]
        assert report["global_step"] == 26 and report["should_stop"] is True
        assert max(losses(report)) == 25
    assert reports[0]["spikes"] == reports[1]["spikes"]  # the same global record
    spike = reports[0]["spikes"][0]
    poisoned, clean = spike["rank_values"]
    assert spike["value"] == (poisoned + clean) / 2 and poisoned > 1.2 * spike["reference"]
    assert poisoned == losses(reports[0])[25] and clean == losses(reports[1])[25]
    # judged alone, rank 1's shard is no spike: the stop came from the reduction
    recent = [losses(reports[1])[s] for s in range(15, 25)]
    assert clean < 1.2 * sum(recent) / len(recent)
    # the shards make up the 1-process global batch: its loss at step 0 (same weights)
    # is the mean of the ranks' losses, up to the order of the float reduction
    single = fit(tmp_path, "single", 1, optim=replace(TINY_OPTIM, max_steps=40))
    mean = (losses(reports[0])[0] + losses(reports[1])[0]) / 2
    assert single.losses[0] == pytest.approx(mean, rel=1e-6)


REMEDIES: dict[str, Any] = {
    "skipper": {"ranges": [[12, 15]]},
    "scaler": {"factor": 0.5, "start_step": 3},
    "data": {"world": {"num_chars": 19_000}},
}
"""Both remedies at once, on a world whose validation text has an odd number of windows
(121): Lightning's default sampler would count one of them twice under 2 processes."""


@pytest.mark.slow
def test_ddp_batch_skipper_and_lr_scaler_resume_bit_exactly(tmp_path: Path) -> None:
    reference = run_ddp(tmp_path, "reference", N, checkpoint_every=EVERY, **REMEDIES)
    resumed = run_ddp(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(tmp_path / "reference", K),
        val_every=N,
        **REMEDIES,
    )
    final = load_ckpt(checkpoint_path(tmp_path / "reference", N))
    assert_states_equal(final, load_ckpt(checkpoint_path(tmp_path / "resumed", N)))
    for rank in range(WORLD):
        ref, res = losses(reference[rank]), losses(resumed[rank])
        assert all(res[s] == ref[s] for s in range(K, N)), f"rank {rank}"
        positions = {int(r["step"]): int(r["position"]) for r in resumed[rank]["history"]}
        assert positions[11] == 11 and positions[12] == 15  # 12-14 skipped on every rank
        lrs = {int(r["step"]): r["lr"] for r in reference[rank]["history"]}
        assert lrs[5] == TINY_OPTIM.peak_lr * TINY_OPTIM.schedule()(5) * 0.5
    # validation covered each of the 121 windows once over both ranks: the 1-process value
    # of the same weights, up to float summation order
    bpcs = [r["val_bpc"] for r in resumed]
    assert bpcs[0] == bpcs[1]
    module = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    module.load_state_dict(final["state_dict"])
    single = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    world = replace(TINY_DATA.world, **REMEDIES["data"]["world"])
    [metrics] = single.validate(
        module, datamodule=StepDataModule(replace(TINY_DATA, world=world)), verbose=False
    )
    assert metrics["val/bpc"] == pytest.approx(bpcs[0], rel=1e-6)


@pytest.mark.slow
def test_ddp_nan_loss_on_one_rank_skips_the_update_on_every_rank(tmp_path: Path) -> None:
    """Lightning refuses a None from training_step under DDP, and a rank skipping its
    backward alone would leave the other waiting in the all-reduce."""
    reports = run_ddp(tmp_path, "nan", 10, checkpoint_every=10, nan={"step": 5, "rank": 0})
    for report in reports:
        assert report["global_step"] == 10 and report["nonfinite_steps"] == [5]
        assert report["history"][5].get("skipped") == 1.0
    assert math.isnan(losses(reports[0])[5]) and math.isfinite(losses(reports[1])[5])
    checkpoint = load_ckpt(checkpoint_path(tmp_path / "nan", 10))
    assert checkpoint["lit_spikes"]["nonfinite_steps"] == [5]
    steps = {float(s["step"]) for s in checkpoint["optimizer_states"][0]["state"].values()}
    assert steps == {9.0}  # AdamW saw 9 of the 10 steps: nothing moved at step 5


if __name__ == "__main__":
    _worker(sys.argv[1])
