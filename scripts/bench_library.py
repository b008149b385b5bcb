"""`make bench`, the library's row: what StepLoader, ExactResume and SpikeDetector cost.

A plain Lightning Trainer on the default model (the demos' tiny GPT) with ``StepLoader``,
``ExactResume`` and ``SpikeDetector``, against the same Trainer with a plain
``DataLoader`` over the same rows and none of them; interleaved repeats in alternating
order, ms/step medians after the warm-up steps, the median of the per-repeat ratios.
Target: at most 1.01x.

First the same two Trainers on a tiny MLP (32-64-1, AdamW; a step of a millisecond or
two, where the library's fixed work shows), at batch 8 and 256, with ``ExactResume``'s
hooks timed inside the library's runs. Then a batch alone, outside the Trainer, the
median of 200: ``StepLoader`` against ``DataLoader`` at batch 8 (with the hooks, the exact
path's host work a step; target: at most 50 us) and at batch 256, in the main process and
with 2 workers (target: at most 1.5x).

Then the RNG work of one step, side by side: the design before per-step seeds
(``collect_rng_states`` at each step's start, the states a save inside the step would
hold) against the per-step seeds (two ``seed_all`` a step, the step's and the one after
it, and one per shard of the batch that ``StepLoader`` reads), in microseconds and as a
share of the library's step.

    python scripts/bench_library.py [--steps 80] [--warmup 10] [--repeats 7] [--tiny-steps 300]
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
from torch.utils.data import DataLoader, TensorDataset

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, SpikeDetector
from lit_spikes.demo.data import DataConfig, StepDataModule, collate_rows
from lit_spikes.demo.module import TinyGPTModule
from lit_spikes.loader import default_shards
from lit_spikes.randomness import (
    BETWEEN,
    ROW,
    STEP,
    collect_rng_states,
    derive,
    seed_all,
)


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
    return _fit_ms(module, loader, callbacks, steps, warmup)


def _fit_ms(
    module: pl.LightningModule, loader: Any, callbacks: list[Callback], steps: int, warmup: int
) -> float:
    """A bare Trainer's fit (no logger, files or validation); its median step after the
    warm-up, in ms, from the ``_Stamps`` among ``callbacks``."""
    stamps = next(c for c in callbacks if isinstance(c, _Stamps))
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


class _TinyMLP(pl.LightningModule):
    """A step of a millisecond or two: the library's fixed work is a visible share."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _tiny_rows(rows: int = 8192) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(rows, 32, generator=generator), torch.randn(rows, 1, generator=generator)
    )


HOOK_US: list[float] = []
"""ExactResume's hooks, microseconds a step, one entry a library run of the tiny MLP."""


def timed_hooks(callback: Callback, steps: int) -> Any:
    """Wrap ``callback``'s own hooks (those it overrides) with timers; the returned
    function appends their microseconds a step to ``HOOK_US``."""
    spent = [0.0]
    for name in dir(type(callback)):
        if name.startswith("on_") and getattr(type(callback), name) is not getattr(Callback, name):
            hook = getattr(callback, name)

            def timed(*args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _hook(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - start

            setattr(callback, name, timed)
    return lambda: HOOK_US.append(1e6 * spent[0] / steps)


class _Empty(Callback):
    """Overrides nothing: what a step's difference says of a callback that does nothing."""


def tiny_ms_per_step(
    with_library: bool, batch: int, steps: int, warmup: int, control: bool = False
) -> float:
    """The tiny MLP's median step: ``ExactResume`` + ``StepLoader``, or a plain Trainer
    with a shuffled ``DataLoader`` (both shuffle); ``control``: the plain Trainer with an
    empty callback instead of the library."""
    stamps = _Stamps()
    callbacks: list[Callback] = [stamps]
    loader: Any
    done = None
    if with_library and control:
        loader = DataLoader(_tiny_rows(), batch, shuffle=True, drop_last=True)
        callbacks.append(_Empty())
    elif with_library:
        loader = StepLoader(_tiny_rows(), batch, seed=0)
        exact = ExactResume()
        done = timed_hooks(exact, steps)
        callbacks.append(exact)
    else:
        loader = DataLoader(_tiny_rows(), batch, shuffle=True, drop_last=True)
    ms = _fit_ms(_TinyMLP(), loader, callbacks, steps, warmup)
    if done is not None:
        done()
    return ms


def batch_ms(keyed: bool, batch: int, workers: int, batches: int = 200) -> float:
    """Milliseconds a batch, the median of ``batches`` batches (after 5 unmeasured) of a
    ``StepLoader`` as a fit reads it (no RNG states put back: ``ExactResume`` sets them at
    each step's start) or a shuffled ``DataLoader``."""
    loader: Any
    rows = (batches + 5) * batch  # one epoch: a DataLoader's iterator ends with it
    if keyed:
        loader = StepLoader(_tiny_rows(rows), batch, seed=0, num_workers=workers)
        loader.restores_rng = False
    else:
        loader = DataLoader(
            _tiny_rows(rows), batch, shuffle=True, drop_last=True, num_workers=workers
        )
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    spans = []
    for _ in range(batches):
        start = time.perf_counter()
        next(iterator)
        spans.append(time.perf_counter() - start)
    return 1000 * statistics.median(spans)


def paired(measure: Any, repeats: int) -> tuple[float, float, float, float, float]:
    """``measure(flag)`` for False and True, interleaved in alternating order: the medians
    (plain, library), and the median, least and largest of the per-repeat ratios."""
    ratios, plain, library = [], [], []
    for repeat in range(repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        times = {flag: measure(flag) for flag in order}
        plain.append(times[False])
        library.append(times[True])
        ratios.append(times[True] / times[False])
    return (
        statistics.median(plain),
        statistics.median(library),
        statistics.median(ratios),
        min(ratios),
        max(ratios),
    )


def tiny_rows(args: argparse.Namespace) -> None:
    """The tiny MLP's rows of ``make bench``: the exact path's cost where a step is short."""
    hooks = {}
    for batch in (8, 256):
        HOOK_US.clear()
        plain, library, ratio, low, high = paired(
            lambda flag, b=batch: tiny_ms_per_step(flag, b, args.tiny_steps, 30), args.repeats
        )
        hooks[batch] = statistics.median(HOOK_US)
        print(
            f"tiny MLP, batch {batch}: ExactResume + StepLoader {library:.3f} / plain Trainer + "
            f"DataLoader {plain:.3f} ms/step: {1000 * (library - plain):+.0f} us a step, "
            f"ratio {ratio:.3f} (median of {args.repeats} interleaved pairs, range "
            f"{low:.3f}-{high:.3f}); ExactResume's hooks {hooks[batch]:.0f} us a step, timed "
            "in the library's runs"
        )
    plain, empty, ratio, low, high = paired(
        lambda flag: tiny_ms_per_step(flag, 8, args.tiny_steps, 30, control=True), args.repeats
    )
    print(
        f"control, tiny MLP, batch 8: a plain Trainer with an empty callback {empty:.3f} / "
        f"without {plain:.3f} ms/step: {1000 * (empty - plain):+.0f} us a step, ratio "
        f"{ratio:.3f} (range {low:.3f}-{high:.3f}): how far a step's difference moves here "
        "with nothing to measure"
    )
    plain, library, ratio, low, high = paired(lambda flag: batch_ms(flag, 8, 0), args.repeats)
    print(
        f"a batch of 8 rows, this process: StepLoader {1000 * library:.0f} / DataLoader "
        f"{1000 * plain:.0f} us (median batch, {args.repeats} pairs); the exact path's host "
        f"work at batch 8, hooks and batch: {hooks[8] + 1000 * (library - plain):.0f} us a "
        "step (target <= 50)"
    )
    for workers in (0, 2):
        plain, library, ratio, low, high = paired(
            lambda flag, w=workers: batch_ms(flag, 256, w), args.repeats
        )
        print(
            f"a batch of 256 rows, {workers} workers: StepLoader {library:.3f} / DataLoader "
            f"{plain:.3f} ms (median batch), ratio {ratio:.2f} (median of {args.repeats} "
            f"pairs, range {low:.2f}-{high:.2f}; target <= 1.5)"
        )


def rng_work_us(rows: int, steps: int = 2000) -> tuple[float, float]:
    """Microseconds of RNG work a step: (before, per-step seeds), each the median of 5
    timings of ``steps`` steps, interleaved."""

    def before() -> None:
        collect_rng_states()

    def per_step_seeds() -> None:  # under ExactResume: the rows' reads keep no states
        for shard in range(default_shards(rows)):
            seed_all(derive(5, ROW, 7, shard))
        seed_all(derive(0, STEP, 7, 0, 0))
        seed_all(derive(0, BETWEEN, 8, 0, 0))

    timings: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(5):
        for name, work in (("before", before), ("now", per_step_seeds)):
            start = time.perf_counter()
            for _ in range(steps):
                work()
            timings[name].append(1e6 * (time.perf_counter() - start) / steps)
    return statistics.median(timings["before"]), statistics.median(timings["now"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tiny-steps", type=int, default=300)
    parser.add_argument("--only-tiny", action="store_true", help="only the tiny MLP's rows")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    torch.set_num_threads(1)
    tiny_rows(args)
    if args.only_tiny:
        return
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
    rows = DataConfig().batch_size
    before, now = rng_work_us(rows)
    step_us = 1000 * statistics.median(library)
    print(
        f"RNG work a step ({rows} rows a batch): states collected at each step's start (before "
        f"issue 53) {before:.1f} us ({100 * before / step_us:.2f}% of a step), per-step seeds "
        f"{now:.1f} us ({100 * now / step_us:.2f}%); ratio {now / before:.2f}"
    )


if __name__ == "__main__":
    main()
