"""What the resume check costs over the two runs it needs anyway.

    .venv/bin/python scripts/bench_check_resume.py [--steps 200] [--resume_at 90] [--repeats 5]

The two runs: one uninterrupted to ``--steps``; one interrupted at ``--resume_at`` (its
ModelCheckpoint ``.ckpt``) and resumed from it to ``--steps`` in a fresh Trainer. The check
runs exactly those, plus its recorder (digests of batch, RNG and LR every step, the whole
state at the resume step and at the end) and the comparison. Both are timed, interleaved,
``--repeats`` times; the medians' ratio is the overhead (target: at most 1.2x).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume
from lit_spikes.testing.check import Plan, fit_once, run_check

WIDTH = 256


class MLP(pl.LightningModule):
    """A few linear layers with dropout, AdamW and a step schedule: every component the
    check records is in use."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Linear(64, WIDTH), torch.nn.GELU()]
        for _ in range(3):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Dropout(0.1)]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def data() -> StepLoader:
    g = torch.Generator().manual_seed(0)
    rows = TensorDataset(torch.randn(4096, 64, generator=g), torch.randn(4096, 1, generator=g))
    return StepLoader(rows, batch_size=64, seed=0)


def callbacks() -> list[pl.Callback]:
    return [ExactResume()]


def two_runs(plan: Plan, root: Path) -> None:
    """The uninterrupted run and the interrupted-and-resumed one, without the check."""
    fit_once(plan, root / "uninterrupted", record=False)
    fit_once(plan, root / "interrupted", record=False, stop_at=plan.resume_at)
    ckpt = root / "interrupted" / "checkpoints" / "resume.ckpt"
    fit_once(plan, root / "resumed", record=False, ckpt_path=ckpt)


def timed(fn: Any, plan: Plan) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        fn(plan, Path(tmp))
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--resume_at", type=int, default=90)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    torch.set_num_threads(1)  # steadier timings on a shared machine
    plan = Plan(MLP, data, callbacks, args.steps, args.resume_at)
    report = run_check(plan, Path(tempfile.mkdtemp()))  # warm-up, and the check must pass
    assert report.exact, report
    plain, checked = [], []
    for _ in range(args.repeats):
        plain.append(timed(two_runs, plan))
        checked.append(timed(lambda p, r: run_check(p, r), plan))
    base, check = statistics.median(plain), statistics.median(checked)
    print(
        f"two runs ({args.steps} steps, resumed at {args.resume_at}): {base:.3f} s; "
        f"the check: {check:.3f} s (medians of {args.repeats}; fastest: {min(plain):.3f} s "
        f"and {min(checked):.3f} s, {min(checked) / min(plain):.3f}x)"
    )
    verdict = "met" if check / base <= 1.2 else "NOT met"
    print(f"overhead: {check / base:.3f}x (target at most 1.2x: {verdict})")


if __name__ == "__main__":
    main()
