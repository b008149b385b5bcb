"""Property: for any run length, checkpoint step, skip set, LR scale and dropout, the
resumed run equals the uninterrupted one bit for bit."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_spikes.shared.training import checkpoint_path
from tests.conftest import TINY_DATA, TINY_GPT, TINY_OPTIM, fit


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    total = draw(st.integers(min_value=3, max_value=12))
    ckpt = draw(st.integers(min_value=1, max_value=total - 1))
    skip = draw(st.frozensets(st.integers(min_value=0, max_value=16), max_size=4))
    return {
        "total": total,
        "ckpt": ckpt,
        "gpt": replace(TINY_GPT, dropout=draw(st.sampled_from([0.0, 0.2]))),
        "data": replace(TINY_DATA, skip=tuple(skip)),
        "optim": replace(TINY_OPTIM, lr_scale=draw(st.sampled_from([0.5, 1.0, 3.0]))),
    }


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_resume_equals_uninterrupted(case: dict[str, object]) -> None:
    total, ckpt = case["total"], case["ckpt"]
    assert isinstance(total, int) and isinstance(ckpt, int)
    configs = {k: case[k] for k in ("gpt", "data", "optim")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        straight = fit(root, "straight", total, checkpoint_every=ckpt, **configs)  # type: ignore[arg-type]
        resumed = fit(
            root,
            "resumed",
            total,
            ckpt_path=checkpoint_path(root / "straight", ckpt),
            **configs,  # type: ignore[arg-type]
        )
        for key, value in straight.module.state_dict().items():
            assert torch.equal(value, resumed.module.state_dict()[key]), key
        state_a = straight.trainer.optimizers[0].state_dict()["state"]
        state_b = resumed.trainer.optimizers[0].state_dict()["state"]
        for index, tensors in state_a.items():
            for name, value in tensors.items():
                assert torch.equal(value, state_b[index][name]), (index, name)
        assert (
            straight.trainer.lr_scheduler_configs[0].scheduler.state_dict()
            == resumed.trainer.lr_scheduler_configs[0].scheduler.state_dict()
        )
        assert all(resumed.losses[s] == straight.losses[s] for s in resumed.losses)
        assert sorted(resumed.losses) == list(range(ckpt, total))
