"""`make bench`, the library's row: what StepLoader, ExactResume and SpikeDetector cost.

A plain Lightning Trainer on the default model (the demos' tiny GPT) with ``StepLoader``,
``ExactResume`` and ``SpikeDetector``, against the same Trainer with a plain
``DataLoader`` over the same rows and none of them; interleaved repeats in alternating
order, ms/step medians after the warm-up steps, the median of the per-repeat ratios.
Target: at most 1.01x.

    python scripts/bench_library.py [--steps 80] [--warmup 10] [--repeats 7]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, SpikeDetector
from lit_spikes.demo.data import DataConfig, StepDataModule, collate_rows
from lit_spikes.demo.module import TinyGPTModule


class _Bare(TinyGPTModule):
    """The default model without the ExactResume it brings itself."""

    def configure_callbacks(self) -> list[Callback]:
        return []


class _Stamps(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def ms_per_step(with_library: bool, steps: int, warmup: int) -> float:
    data = StepDataModule(DataConfig())
    data.setup("fit")
    stamps = _Stamps()
    callbacks: list[Callback] = [stamps]
    if with_library:
        module: TinyGPTModule = TinyGPTModule()  # brings ExactResume (configure_callbacks)
        loader: Any = StepLoader(
            data.loader.dataset, data.config.batch_size, shuffle=False, collate_fn=collate_rows
        )
        callbacks += [SpikeDetector(), ExactResume()]
    else:
        module = _Bare()
        loader = DataLoader(
            data.loader.dataset, data.config.batch_size, shuffle=False, collate_fn=collate_rows
        )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=loader)
    spans = [
        b - a for a, b in zip(stamps.starts[warmup:], stamps.starts[warmup + 1 :], strict=False)
    ]
    return 1000 * statistics.median(spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    torch.set_num_threads(1)
    ratios, plain, library = [], [], []
    for repeat in range(args.repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        times = {flag: ms_per_step(flag, args.steps, args.warmup) for flag in order}
        plain.append(times[False])
        library.append(times[True])
        ratios.append(times[True] / times[False])
    print(
        f"library (StepLoader + ExactResume + SpikeDetector) against a plain Trainer: "
        f"{statistics.median(library):.2f} / {statistics.median(plain):.2f} ms/step, "
        f"ratio {statistics.median(ratios):.3f} (median of {args.repeats} interleaved pairs, "
        f"range {min(ratios):.3f}-{max(ratios):.3f}; target <= 1.01)"
    )


if __name__ == "__main__":
    main()
