"""The library under DDP (2 gloo processes) on a module that is not the project's: a resume
from a real ``.ckpt`` equals the uninterrupted run, and a bad batch in one rank's shard is
flagged on both ranks at the same step.

Each run is ``python -m tests.library.test_ddp <spec.json>``: Lightning's DDP launcher
starts rank 1 by running that same command again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, SpikeDetector
from tests.conftest import REPO, ddp_env
from tests.modules.user_modules import DropoutRegressor, PoisonedRows

BATCH, SEED, POISON_STEP, WORLD = 8, 7, 8, 2  # the spike in data epoch 0 (12 steps)


def _worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    clean = StepLoader(PoisonedRows(set()), BATCH, seed=SEED)
    rows = set(clean.rows_of_step(POISON_STEP, rank=0, world_size=WORLD))  # rank 0's shard only
    detector = SpikeDetector(monitor="loss", window=5, warmup=5, ratio=3.0)
    root = Path(spec["root"])
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=spec["max_steps"],
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(root, filename="{step}", every_n_train_steps=5, save_top_k=-1),
            detector,
            ExactResume(),
        ],
    )
    module = DropoutRegressor()
    data = StepLoader(PoisonedRows(rows), BATCH, seed=SEED)
    trainer.fit(module, train_dataloaders=data, ckpt_path=spec.get("ckpt_path"))
    out = Path(spec["out"])
    rank = trainer.global_rank
    spikes = [s.to_dict() for s in detector.spikes]  # plain records: JSON takes them
    report = {"rank": rank, "spikes": spikes, "losses": module.losses}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.save(module.state_dict(), out / f"rank{rank}.pt")


def run_ddp(tmp: Path, name: str, max_steps: int, ckpt_path: Path | None = None) -> list[Any]:
    out = tmp / name
    out.mkdir(parents=True)
    spec = {"root": str(out), "out": str(out), "max_steps": max_steps}
    if ckpt_path is not None:
        spec["ckpt_path"] = str(ckpt_path)
    (out / "spec.json").write_text(json.dumps(spec))
    result = subprocess.run(
        [sys.executable, "-m", "tests.library.test_ddp", str(out / "spec.json")],
        cwd=REPO,
        env=ddp_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [
        (json.loads((out / f"rank{r}.json").read_text()), torch.load(out / f"rank{r}.pt"))
        for r in range(WORLD)
    ]


@pytest.mark.slow
def test_ddp_resume_is_exact_and_a_one_rank_spike_is_flagged_on_both(tmp_path: Path) -> None:
    whole = run_ddp(tmp_path, "whole", 20)
    # Its own step-10 file: a run stopped there writes the same one, and each DDP launch
    # costs two Pythons' start (resumes from a run that stopped: tests/library/callbacks).
    resumed = run_ddp(tmp_path, "resumed", 20, tmp_path / "whole" / "step=10.ckpt")
    for (report, state), (resumed_report, resumed_state) in zip(whole, resumed, strict=True):
        assert all(torch.equal(v, resumed_state[k]) for k, v in state.items())
        assert resumed_report["losses"] == report["losses"][10:]  # this rank's shard
        assert report["spikes"][0]["step"] == POISON_STEP  # flagged on this rank too
        assert resumed_report["spikes"] == report["spikes"]
    shard_losses = whole[0][0]["spikes"][0]["rank_values"]
    assert shard_losses[0] > 100 * shard_losses[1]  # rank 0's shard held the bad rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(sys.argv[1])
