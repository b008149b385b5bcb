"""What the damaged-file checks cost (lit_spikes/file_digest.py, docs/survives.md): a
60 MB checkpoint (15 tensors of 1000x1000 float32) saved by ``AtomicCheckpointIO`` and
loaded by ``load_checkpoint``, against the same steps without the checks, side by side,
the median of 7 runs each.

    python scripts/bench_file_digest.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from lit_spikes.checkpoints import AtomicCheckpointIO, load_checkpoint
from lit_spikes.file_digest import misread, structure_digest


def median_s(step: Callable[[], object], runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    checkpoint = {
        "state_dict": {f"w{i}": torch.randn(1000, 1000) for i in range(15)},
        "optimizer_states": [], "lr_schedulers": [], "global_step": 1, "loops": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "step=1.ckpt"
        save = median_s(lambda: AtomicCheckpointIO().save_checkpoint(checkpoint, path))
        digest = median_s(lambda: structure_digest(checkpoint))
        load = median_s(lambda: load_checkpoint(path))
        loaded = torch.load(path, weights_only=True)
        check = median_s(lambda: misread(loaded, zipfile.ZipFile(path)))
        size = path.stat().st_size / 1e6
    print(f"file: {size:.1f} MB")
    print(f"save: {save * 1e3:.1f} ms, of which the structure digest {digest * 1e3:.2f} ms")
    print(f"load: {load * 1e3:.1f} ms, of which the checks of what torch read {check * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
