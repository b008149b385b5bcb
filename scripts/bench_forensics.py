"""`make bench`, the forensics row (issue 67): what the run pays for forensics, and what a
replay costs against the run's own steps.

1. The library's row of ``make bench`` (the default model with StepLoader, ExactResume and
   SpikeDetector; ``bench_library.ms_per_step``), each measurement in a fresh process:
   one where ``lit_spikes.tools.forensics`` is imported first (available), one where its
   import is blocked (not there at all); interleaved in alternating order, ms/step
   medians and the median of the per-repeat ratios. Nothing of forensics is attached to
   a run, so the ratio is 1 within the machine's noise.
2. A replay against the run: the demo's default run to step 160 (its spike at 150 on the
   AMD EPYC VM), its steps 100-155 timed by a callback in the run, then ``forensics`` of
   step 150 from ``step=100.ckpt``: its seconds for the same steps, and the instruments'
   share of them.

    python scripts/bench_forensics.py [--repeats 5] [--steps 80] [--warmup 10]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent

PROBE = """
import sys
sys.path.insert(0, {here!r})
if {available}:
    import lit_spikes.tools.forensics
else:
    sys.modules["lit_spikes.tools.forensics"] = None  # an import of it fails
from bench_library import ms_per_step
print(ms_per_step(True, {steps}, {warmup}))
"""


def run_ms(available: bool, steps: int, warmup: int) -> float:
    """The library's ms/step in a fresh process, forensics importable or not."""
    code = PROBE.format(here=str(HERE), available=available, steps=steps, warmup=warmup)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    return float(done.stdout.strip().splitlines()[-1])


def run_pays(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    from bench_library import paired  # the library row's interleaving, its ratio's median

    without, available, ratio, low, high = paired(
        lambda flag: run_ms(flag, args.steps, args.warmup), args.repeats
    )
    print(
        f"the library's run, forensics importable / not there: "
        f"{available:.2f} / {without:.2f} ms/step, "
        f"ratio {ratio:.3f} (range {low:.3f}-{high:.3f}, "
        f"{args.repeats} repeats, {args.steps} steps, fresh processes)"
    )


def replay_against_run() -> None:
    import lightning.pytorch as pl

    from lit_spikes.tools.cli import main as lit_spikes
    from lit_spikes.tools.forensics import ForensicsConfig, forensics

    stamps: dict[int, float] = {}

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            stamps[trainer.global_step - 1] = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="bench-forensics-") as temp:
        fit = ["fit", "--trainer.max_steps", "160", "--checkpoint_every", "50"]
        fit += ["--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", temp]
        fit += ["--trainer.enable_progress_bar", "false"]
        from lit_spikes.tools.fit_cli import LitSpikesCLI

        after = LitSpikesCLI.after_instantiate_classes

        def with_clock(self: Any) -> None:  # the run's Trainer, with the clock among its callbacks
            after(self)
            self.trainer.callbacks.append(Clock())

        with mock.patch.object(LitSpikesCLI, "after_instantiate_classes", with_clock):
            lit_spikes(fit)
        start = time.perf_counter()
        result = forensics(temp, 150, ForensicsConfig())
        whole = time.perf_counter() - start
    assert result.pace is not None
    count, replayed, own = result.pace
    first, last = result.ckpt_step, result.ckpt_step + count
    ran = stamps[last] - stamps[first]
    print(
        f"a replay of steps {first}-{last} (the spike at 150): {replayed:.2f} s, "
        f"{own:.2f} s of it in the instruments; the run's same steps: {ran:.2f} s "
        f"(replay / run {replayed / ran:.2f}x, without the instruments "
        f"{(replayed - own) / ran:.2f}x); the whole call {whole:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.2f}, cores: {os.cpu_count()}")
    run_pays(args)
    replay_against_run()


if __name__ == "__main__":
    main()
