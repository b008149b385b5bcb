"""``ClipGradients`` (callbacks/clip.py): the logged gradient norm is the one before
clipping, bit-equal to what clipping measures."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tests.conftest import fit


def test_gradient_clipping_logs_the_norm_before_clipping(tmp_path: Path) -> None:
    clipped = fit(tmp_path, "clipped", 5, gradient_clip_val=1e-3)
    free = fit(tmp_path, "free", 5)
    assert clipped.module.history[0]["grad_norm"] == free.module.history[0]["grad_norm"] > 1e-3
    assert clipped.module.history[1]["loss"] != free.module.history[1]["loss"]


def test_grad_norm_is_bit_equal_to_what_clipping_measures() -> None:
    """The logged norm is the one ``clip_grad_norm_`` compares with its threshold."""
    from lit_spikes.demo.model import GPTConfig, build_model
    from lit_spikes.demo.module import grad_norm

    model = build_model(GPTConfig(), 1)
    for scale in (1e-30, 1e-3, 1.0, 1e20):
        generator = torch.Generator().manual_seed(int(-math.log10(scale) * 7) % 1000)
        for parameter in model.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator) * scale
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        expected = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        assert torch.equal(grad_norm(model.parameters()), expected), scale
    for parameter in model.parameters():
        parameter.grad = None
    assert grad_norm(model.parameters()).item() == 0.0
