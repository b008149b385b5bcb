"""BranchRunner: branches trained here and in worker processes, started as the
checkpoints they need appear, each computing exactly what it computes alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lit_spikes.branches import Branch, BranchRunner, run_branch
from lit_spikes.training import checkpoint_path
from tests.conftest import TINY_DATA, TINY_GPT, TINY_OPTIM

N, K = 12, 6


def tiny_branch(name: str, ckpt_path: Path | None = None, **changes: Any) -> Branch:
    return Branch(
        name,
        N,
        ckpt_path=ckpt_path,
        gpt=TINY_GPT,
        optim=TINY_OPTIM,
        data=TINY_DATA,
        model_seed=0,
        val_every=None,
        trainer_kwargs={"limit_val_batches": 0},
        **changes,
    )


@pytest.mark.slow
def test_runner_trains_every_branch_once_and_each_as_alone(tmp_path: Path) -> None:
    root = tmp_path / "runner"
    ckpt = checkpoint_path(root / "reference", K)
    children = [tiny_branch(f"child{i}", ckpt) for i in range(3)]
    reports: list[tuple[str, str, Any]] = []

    def on_report(kind: str, name: str, payload: Any) -> None:
        reports.append((kind, name, payload))
        if (kind, payload) == ("checkpoint", K):
            for child in children:  # one worker: the others wait, or this process takes one
                runner.submit(child)

    with BranchRunner(root, workers=1) as runner:
        reference = runner.run_here(tiny_branch("reference", checkpoint_every=K), on_report)
        events = list(runner.events())
    assert ("checkpoint", "reference", K) in reports
    done = [name for kind, name, _ in events if kind == "done"]
    assert sorted(done) == [c.name for c in children]  # each once
    assert set(runner.results) == {"reference", *done}
    alone_root = tmp_path / "alone"
    alone = run_branch(tiny_branch("reference", checkpoint_every=K), alone_root, progress_bar=False)
    for key, value in alone.state.items():
        assert torch.equal(value, reference.state[key]), f"reference: {key}"
    for child in children:
        solo = run_branch(
            tiny_branch(child.name, checkpoint_path(alone_root / "reference", K)),
            alone_root,
            progress_bar=False,
        )
        got = runner.results[child.name]
        assert got.losses() == solo.losses(), child.name
        for key, value in solo.state.items():
            assert torch.equal(value, got.state[key]), f"{child.name}: {key}"
