"""The seed's instability, reproduced at the defaults (slow: two full-size runs)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from lit_spikes.callbacks import LRScaler, SpikeDetector
from lit_spikes.demo.branches import run_branch
from lit_spikes.demo.demos import DemoSetup

pytestmark = pytest.mark.slow


def test_default_run_spikes_after_warmup_and_halving_the_lr_is_better(tmp_path: Path) -> None:
    setup = DemoSetup(log_root=tmp_path)
    reference = run_branch(setup.reference(callbacks=[]), tmp_path, progress_bar=False)
    losses = reference.losses()
    logits = {int(r["step"]): r["max_logit"] for r in reference.history}
    # A post-warm-up spike: within 3 steps the loss rises >= 40% above its last-10 mean.
    spikes = [
        s
        for s in range(110, setup.steps)
        if max(losses[s + i] for i in range(3) if s + i in losses)
        >= 1.4 * statistics.fmean(losses[t] for t in range(s - 10, s))
    ]
    assert spikes, "no post-warm-up spike at the defaults"
    onset = spikes[0]
    assert 100 < onset < 200
    assert 100 <= max(logits[s] for s in range(onset - 5, onset + 5)) < 1000  # in the hundreds
    halved = run_branch(
        setup.branch(
            "halved",
            "halve the LR",
            ckpt_path=setup.checkpoint(100),
            callbacks=[LRScaler(0.5, start_step=100)],
        ),
        tmp_path,
        progress_bar=False,
    )
    assert halved.val_bpc < reference.val_bpc - 0.2
    # The demo's rule flags this spike, and nothing in the stable (halved) run.
    on_reference, on_halved = (SpikeDetector(min_step=100, ratio=1.4) for _ in range(2))
    for record in reference.history:
        on_reference.check(int(record["step"]), record)
    for record in reference.history[:100] + halved.history:
        on_halved.check(int(record["step"]), record)
    assert on_reference.onsets and on_reference.onsets[0] in range(onset - 2, onset + 3)
    assert list(on_halved.spikes) == []
