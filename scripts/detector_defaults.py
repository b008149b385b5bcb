"""Measure SpikeDetector's default rule against the old one on clean runs of three kinds of
modules, a planted 10x loss and a 10x LR jump; prints the table of docs/detector.md.

Modules: the demo's GPT (``TinyGPTModule``, the demo's shape, at a stable peak LR of
0.01), a 1-D CNN classifier of noisy sinusoids whose loss sits near 0.06, and two MLP
regressions, batches of 128 (a smooth target, whose batch losses sit at the noise floor;
a rough one, whose batches now and then hold a point the net fits badly). Per module:

- false flags: steps flagged in its clean run (``min_step=0``: from the first step the
  warm-up allows);
- x10 caught: a fresh plant every 23 steps from step 105 on, each alone: that step's value
  replaced by 10x the median of the 100 losses before it, judged by the detector that has
  seen the clean run up to there;
- LR jump: the same run with the LR x10 from the middle on (the same steps before it):
  the first step flagged from the jump on (caught: within 25 steps; a classifier's loss
  climbs for some 20 steps before it is far out of its noise);
- and the demo's reference run (configs/reference.yaml, peak LR 0.1): the steps each rule
  flags after its warm-up (min_step 100).

Run: ``.venv/bin/python scripts/detector_defaults.py`` (about 4 minutes on one core).
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
import subprocess
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_spikes.callbacks import LRScaler, SpikeDetector
from lit_spikes.demo.data import DataConfig, StepDataModule
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import OptimConfig, TinyGPTModule

RULES: dict[str, Callable[[], SpikeDetector]] = {
    "old default (ratio 1.4, window 20)": lambda: SpikeDetector(ratio=1.4),
    "new default (robust_z 8, window 100)": lambda: SpikeDetector(),
}
PLANT_FROM, PLANT_EVERY, CAUGHT_WITHIN = 105, 23, 25


class Losses(Callback):
    """The loss each step returned, as a detector's ``loss`` sees it."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.values.append(float(args[1]["loss"]))


class _Plain(pl.LightningModule):
    """A user's module: a net, a loss, AdamW or SGD, a constant LR (x10 from ``jump_step``)."""

    def __init__(self, net: nn.Module, loss: Callable[..., torch.Tensor], jump_step: int | None):
        super().__init__()
        self.net, self.loss, self.jump_step = net, loss, jump_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self.net(x), y)

    def factor(self, step: int) -> float:
        return 10.0 if self.jump_step is not None and step >= self.jump_step else 1.0

    def optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Classifier(_Plain):
    def __init__(self, jump_step: int | None = None) -> None:
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv1d(1, 8, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool1d(4),
            nn.Conv1d(8, 16, 5, padding=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(16, 4),
        )
        super().__init__(net, nn.functional.cross_entropy, jump_step)

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class Regressor(_Plain):
    def __init__(self, jump_step: int | None = None) -> None:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        super().__init__(net, nn.functional.mse_loss, jump_step)

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def sinusoids(rows: int) -> TensorDataset:
    """Four classes of noisy sinusoids (3, 6, 9, 12 periods), random phase."""
    generator = torch.Generator().manual_seed(0)
    label = torch.randint(0, 4, (rows,), generator=generator)
    t = torch.linspace(0, 1, 64)
    phase = torch.rand(rows, 1, generator=generator) * 2 * math.pi
    wave = torch.sin((label + 1).float()[:, None] * 3 * 2 * math.pi * t + phase)
    x = wave + 1.1 * torch.randn(rows, 64, generator=generator)
    return TensorDataset(x[:, None, :], label)


def regression(rows: int, rough: bool) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=generator)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(99))
    z = x @ w if rough else x @ w / math.sqrt(8)
    return TensorDataset(x, torch.sin(z) + 0.1 * torch.randn(rows, 1, generator=generator))


def losses(module: pl.LightningModule, steps: int, data: Any, callbacks: list[Any]) -> list[float]:
    record = Losses()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[record, *callbacks],
    )
    if isinstance(data, pl.LightningDataModule):
        trainer.fit(module, datamodule=data)
    else:
        trainer.fit(module, train_dataloaders=data)
    return record.values


def flagged(rule: Callable[[], SpikeDetector], values: list[float], min_step: int = 0) -> list[int]:
    detector = rule()
    detector.min_step = min_step
    return [s["step"] for i, v in enumerate(values) for s in detector.check(i, {"loss": v})]


def planted_caught(rule: Callable[[], SpikeDetector], values: list[float]) -> tuple[int, int]:
    """(caught, planted): each plant judged by a copy of the detector fed the clean run."""
    detector, last = rule(), deque[float](maxlen=100)
    caught = planted = 0
    for step, value in enumerate(values):
        if step >= PLANT_FROM and (step - PLANT_FROM) % PLANT_EVERY == 0:
            planted += 1
            spike = 10 * statistics.median(last)
            caught += bool(copy.deepcopy(detector).check(step, {"loss": spike}))
        detector.check(step, {"loss": value})
        last.append(value)
    return caught, planted


def modules(steps: int, gpt_steps: int) -> dict[str, Callable[[int | None], tuple[Any, ...]]]:
    """name: jump_step -> (module, steps, data, callbacks)."""
    gpt = GPTConfig(vocab_size=41, n_layer=4, n_head=4, d_model=64, block_size=64)

    def tiny_gpt(jump: int | None) -> tuple[Any, ...]:
        optim = OptimConfig(peak_lr=0.01, max_steps=gpt_steps)
        module = TinyGPTModule(gpt=gpt, optim=optim, num_threads=1)
        extra = [LRScaler(factor=10.0, start_step=jump)] if jump is not None else []
        return module, gpt_steps, StepDataModule(DataConfig()), extra

    def loader(data: TensorDataset, batch: int = 32) -> DataLoader[Any]:
        return DataLoader(data, batch_size=batch)

    return {
        "demo GPT (peak LR 0.01)": tiny_gpt,
        "1-D CNN classifier": lambda j: (Classifier(j), steps, loader(sinusoids(32 * steps)), []),
        "MLP regression, smooth": lambda j: (
            Regressor(j),
            steps,
            loader(regression(128 * steps, rough=False), 128),
            [],
        ),
        "MLP regression, rough": lambda j: (
            Regressor(j),
            steps,
            loader(regression(128 * steps, rough=True), 128),
            [],
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="clean steps, small modules")
    parser.add_argument("--gpt-steps", type=int, default=1000, help="clean steps, the GPT")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    started = time.monotonic()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line),
        platform.processor(),
    )
    print(f"machine: {model}, torch {torch.__version__}, 1 thread")
    header = (
        "| module | rule | clean steps | loss (last 10%) | false flags (per 1,000) "
        "| x10 caught | LR x10 at step: first flag |"
    )
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for name, build in modules(args.steps, args.gpt_steps).items():
        module, steps, data, extra = build(None)
        clean = losses(module, steps, data, extra)
        jump_at = steps // 2
        module, _, data, extra = build(jump_at)
        jumped = losses(module, jump_at + 2 * CAUGHT_WITHIN, data, extra)
        tail = statistics.fmean(clean[-steps // 10 :])
        for rule_name, rule in RULES.items():
            false = flagged(rule, clean)
            caught, planted = planted_caught(rule, clean)
            after = [s for s in flagged(rule, jumped) if s >= jump_at]
            first = after[0] if after else None
            verdict = (
                "caught" if first is not None and first < jump_at + CAUGHT_WITHIN else "missed"
            )
            print(
                f"| {name} | {rule_name} | {steps} | {tail:.4f} | {len(false)} "
                f"({1000 * len(false) / steps:.2f}) | {caught}/{planted} | {jump_at}: {first} "
                f"({verdict}) |"
            )
    reference = TinyGPTModule(
        gpt=GPTConfig(vocab_size=41, n_layer=4, n_head=4, d_model=64, block_size=64), num_threads=1
    )
    demo = losses(reference, 200, StepDataModule(DataConfig()), [])
    for rule_name, rule in RULES.items():
        print(
            f"demo reference run (configs/reference.yaml), {rule_name}: flags after step "
            f"100 at {flagged(rule, demo, min_step=100)}"
        )
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
