"""`make gpu-check`: lit-spikes on a GPU, in one short run (at most about 5 minutes).

1. Exact resume on CUDA: the default model (the demos' tiny GPT) and a module written as
   users write them (dropout, AdamW, a schedule), each in ``32-true``, ``bf16-mixed`` and
   ``16-mixed`` (a GradScaler; not on the CPU):
   trained to step N, and trained to step K, written as a real ``.ckpt`` by
   ``ModelCheckpoint``, then resumed from it in a new process to step N: every parameter
   must be bit-equal (``torch.equal``) to the uninterrupted run's.
2. Steps per second of a plain Trainer with and without the library's callbacks
   (``StepLoader``, ``ExactResume``, ``SpikeDetector``, ``SkipStep``): target <= 1.01x.
3. Host syncs per step made while training under ``torch.cuda.set_sync_debug_mode("warn")``
   with the callbacks on, in steady state (after the first 50 steps).

Without CUDA it runs part 1 on the CPU (so CI runs it) and says that it skips the rest.

    python scripts/gpu_check.py [--steps 120] [--out /tmp/gpu-check]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, SkipStep, SpikeDetector
from lit_spikes.demo.data import DataConfig, StepDataModule
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import OptimConfig, TinyGPTModule

STEADY = 50


class UserModule(pl.LightningModule):
    """Written as Lightning users write them: dropout, AdamW, a warm-up schedule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 8))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, fused=torch.cuda.is_available())
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def user_data() -> StepLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 64, generator=generator)
    return StepLoader(TensorDataset(x, (x[:, :8].argmax(1))), batch_size=64, seed=0)


def build(kind: str) -> tuple[pl.LightningModule, Any]:
    if kind == "user":
        return UserModule(), user_data()
    gpt, optim = GPTConfig(dropout=0.1), OptimConfig(peak_lr=0.01, max_steps=10_000)
    return TinyGPTModule(gpt=gpt, optim=optim), StepDataModule(DataConfig())


def fit(kind: str, precision: str, steps: int, root: Path, ckpt: str | None = None) -> Path:
    """Train ``kind`` to ``steps`` under ``root``; returns the final weights' file."""
    module, data = build(kind)
    saver = ModelCheckpoint(
        root, filename="{step}", every_n_train_steps=steps // 2 or 1, save_top_k=-1
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="auto",
        devices=1,
        precision=precision,  # type: ignore[arg-type]
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[saver, ExactResume(deterministic=True)],
    )
    loaders = (
        {"datamodule": data}
        if isinstance(data, pl.LightningDataModule)
        else {"train_dataloaders": data}
    )
    trainer.fit(module, ckpt_path=ckpt, **loaders)
    out = root / "final.pt"
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, out)
    return out


def check_resumes(runs: list[tuple[str, str]], steps: int, out: Path) -> list[bool]:
    """Whether each (kind, precision) run, stopped at half its steps and resumed in a new
    process, ends bit-equal to the uninterrupted one; one new process resumes them all (a
    Python with torch and Lightning takes seconds to start)."""
    jobs = []
    for kind, precision in runs:
        fit(kind, precision, steps, out / f"{kind}-{precision}-whole")
        first = out / f"{kind}-{precision}-first"
        fit(kind, precision, steps // 2, first)
        resumed = out / f"{kind}-{precision}-resumed"
        jobs.append([kind, precision, steps, str(resumed), str(first / f"step={steps // 2}.ckpt")])
    subprocess.run([sys.executable, __file__, "--child", json.dumps(jobs)], check=True)
    verdicts = []
    for kind, precision in runs:
        a = torch.load(out / f"{kind}-{precision}-whole" / "final.pt", weights_only=True)
        b = torch.load(out / f"{kind}-{precision}-resumed" / "final.pt", weights_only=True)
        verdicts.append(all(torch.equal(a[k], b[k]) for k in a))
    return verdicts


class _Stamps(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        torch.cuda.synchronize()  # the timer's own sync, outside the steps it times
        self.starts.append(time.perf_counter())


def steps_per_second(with_library: bool, steps: int) -> float:
    stamps = _Stamps()
    callbacks: list[Callback] = [stamps]
    if with_library:
        callbacks += [ExactResume(), SpikeDetector(monitor=["loss", "grad_norm"]), SkipStep()]
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(UserModule(), train_dataloaders=user_data())
    spans = [b - a for a, b in zip(stamps.starts[10:], stamps.starts[11:], strict=False)]
    return 1.0 / statistics.median(spans)


def host_syncs_per_step(steps: int) -> float:
    """Sync warnings per steady step with the library's callbacks on (the user's module
    logs with self.log, which Lightning reads: counted too, said beside the figure)."""
    counted: list[int] = []

    class Count(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == STEADY:
                torch.cuda.set_sync_debug_mode("warn")

    callbacks = [Count(), ExactResume(), SpikeDetector(monitor=["loss", "grad_norm"]), SkipStep()]
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            trainer.fit(UserModule(), train_dataloaders=user_data())
        finally:
            torch.cuda.set_sync_debug_mode(0)
    counted.append(sum("synchroniz" in str(w.message) for w in seen))
    return counted[0] / (steps - STEADY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # every run of the check, and each new process, alike
    torch.set_flush_denormal(True)
    warnings.filterwarnings(
        "ignore",
        message=".*(does not have many workers|dirpath has changed|exists and is not empty).*",
    )
    if args.child:
        for kind, precision, steps, root, ckpt in json.loads(args.child):
            fit(kind, precision, steps, Path(root), ckpt)
        return
    cuda = torch.cuda.is_available()
    device = (
        torch.cuda.get_device_name() if cuda else f"CPU ({torch.backends.cpu.get_cpu_capability()})"
    )
    print(f"device: {device}; torch {torch.__version__}, lightning {pl.__version__}")
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    # 16-mixed (a GradScaler, whose state Lightning checkpoints) only on CUDA: not a CPU mode.
    precisions = ["32-true", "bf16-mixed", *(["16-mixed"] if cuda else [])]
    runs = [(kind, precision) for kind in ("default", "user") for precision in precisions]
    verdicts = check_resumes(runs, args.steps if cuda else 20, out)
    for (kind, precision), exact in zip(runs, verdicts, strict=True):
        verdict = "bit-equal" if exact else "DIFFERS"
        print(f"resume in a new process, {kind} model, {precision}: {verdict}")
    ok = all(verdicts)
    if not cuda:
        print("no CUDA device: skipping steps per second and host syncs (run on a GPU machine)")
    else:
        pairs = [(steps_per_second(False, 200), steps_per_second(True, 200)) for _ in range(3)]
        ratio = statistics.median(plain / lib for plain, lib in pairs)
        print(
            f"steps/s without / with the callbacks: {statistics.median(p for p, _ in pairs):.1f} / "
            f"{statistics.median(lib for _, lib in pairs):.1f}, ratio {ratio:.3f} (target <= 1.01)"
        )
        print(
            f"host syncs per steady step, callbacks on: {host_syncs_per_step(200):.2f} "
            "(Lightning's own logging of self.log values included)"
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
