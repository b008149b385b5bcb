"""The seed's pitfall: optimizer state dicts alias the live tensors."""

from __future__ import annotations

import torch

from lit_spikes.demo.model import build_model
from lit_spikes.demo.module import OptimConfig
from lit_spikes.demo.snapshot import restore_snapshot, take_snapshot
from tests.conftest import TINY_GPT


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, TINY_GPT.vocab_size, (4, 9), generator=generator)
        loss = model(idx[:, :-1], idx[:, 1:]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(TINY_GPT, seed=0)
    optimizer, _ = OptimConfig(peak_lr=0.01).build(model.parameters())
    _train(model, optimizer, 3)
    return model, optimizer


def test_state_dict_without_deep_copy_changes_under_training() -> None:
    model, optimizer = _setup()
    naive = optimizer.state_dict()  # references to the live exp_avg tensors
    before = naive["state"][0]["exp_avg"].clone()
    _train(model, optimizer, 2)
    assert not torch.equal(naive["state"][0]["exp_avg"], before)


def test_load_state_dict_aliases_the_given_tensors() -> None:
    """Restoring a kept state dict, then training, rewrites the kept dict in place."""
    _, optimizer = _setup()
    kept = optimizer.state_dict()
    frozen = kept["state"][0]["exp_avg"].clone()
    other_model = build_model(TINY_GPT, seed=0)
    other, _ = OptimConfig(peak_lr=0.01).build(other_model.parameters())
    other.load_state_dict(kept)
    _train(other_model, other, 1)  # the original optimizer is not touched
    assert not torch.equal(kept["state"][0]["exp_avg"], frozen)


def test_project_snapshot_never_changes_and_restores_twice_identically() -> None:
    model, optimizer = _setup()
    snapshot = take_snapshot(model, optimizer, step=3)
    frozen = {k: v.clone() for k, v in snapshot.optimizer["state"][0].items()}
    _train(model, optimizer, 2)  # training on must not touch the snapshot
    for name, value in frozen.items():
        assert torch.equal(snapshot.optimizer["state"][0][name], value)

    finals = []
    for _ in range(2):  # the seed's bug: the second restore silently differed
        restore_snapshot(snapshot, model, optimizer)
        _train(model, optimizer, 2)
        finals.append({k: v.clone() for k, v in model.state_dict().items()})
    for name in finals[0]:
        assert torch.equal(finals[0][name], finals[1][name]), name
    for name, value in frozen.items():
        assert torch.equal(snapshot.optimizer["state"][0][name], value)


def test_a_plain_run_resumed_from_a_snapshot_equals_the_whole_run_with_dropout() -> None:
    """Dropout masks come from the RNG: a snapshot keeps its states, so a resume draws the
    masks the uninterrupted run drew, whatever the process's RNG did in between."""
    from dataclasses import replace

    from lit_spikes.demo.plain import train_plain
    from tests.conftest import TINY_DATA, TINY_OPTIM

    gpt = replace(TINY_GPT, dropout=0.1)
    whole = train_plain(gpt, TINY_OPTIM, TINY_DATA, 8, snapshot_at=4)
    assert whole.snapshot is not None
    torch.manual_seed(12345)  # whatever state the process is in by then
    resumed = train_plain(gpt, TINY_OPTIM, TINY_DATA, 8, resume=whole.snapshot)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history[4:]]
    for key, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
