"""What decides a run's numerics, recorded in each checkpoint by ``ExactResume`` and
compared at a resume: versions, the CPU's kernels, threads, determinism settings, the
subnormal flushing, the precision and the gradient clipping."""

from __future__ import annotations

import os
from typing import Any

import lightning
import lightning.pytorch as pl
import torch

CUBLAS_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` for deterministic cuBLAS (PyTorch's reproducibility notes)."""


def flush_denormal_enabled() -> bool:
    """Whether this thread flushes subnormal floats: the smallest normal float32 halved
    is subnormal, and comes out as zero when they are flushed."""
    tiny = torch.tensor(torch.finfo(torch.float32).tiny, dtype=torch.float32)
    return bool((tiny / 2) == 0)


def deterministic_settings() -> dict[str, Any]:
    """The switches that make kernels deterministic, as this process has them."""
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def gradient_clipping(trainer: pl.Trainer | None) -> dict[str, Any] | None:
    """The Trainer's gradient clipping as a fingerprint records it: None for none (no
    ``gradient_clip_val``, or 0), else its value and algorithm (Lightning's default: norm)."""
    value = getattr(trainer, "gradient_clip_val", None) if trainer is not None else None
    if not value:
        return None
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    return {"value": float(value), "algorithm": str(getattr(algorithm, "value", "norm"))}


def software_fingerprint() -> dict[str, str]:
    """The versions and CPU kernels a step's numerics depend on, in this process."""
    return {
        "torch": str(torch.__version__),
        "lightning": str(lightning.__version__),
        # The SIMD kernels torch picked (AVX2, AVX512, ...): they round differently, so
        # the same run on another CPU family is another (equally exact) trajectory.
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }


def _scaler_name(trainer: pl.Trainer | None) -> str | None:
    scaler = getattr(trainer.precision_plugin, "scaler", None) if trainer is not None else None
    return type(scaler).__name__ if scaler is not None else None


def fingerprint(trainer: pl.Trainer | None) -> dict[str, Any]:
    """What decides the numerics of a step, beyond the checkpointed state."""
    device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
    return {
        **software_fingerprint(),
        "num_threads": torch.get_num_threads(),
        "flush_denormal": flush_denormal_enabled(),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "world_size": trainer.world_size if trainer is not None else 1,
        "precision": str(trainer.precision) if trainer is not None else "32-true",
        # Its state (scale, growth tracker) Lightning saves itself, with the precision plugin.
        "grad_scaler": _scaler_name(trainer),
        "deterministic": deterministic_settings(),
        "gradient_clip": gradient_clipping(trainer),
    }


def differing_entries(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The entries two fingerprints both hold, with other values (sorted)."""
    return [key for key in sorted(set(saved) & set(here)) if saved[key] != here[key]]


def fingerprint_differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """``"<key>: checkpoint <a>, now <b>"`` for each setting that differs. Clipping added
    where the checkpoint's run had none is not one: that is the clipping remedy."""
    return [
        f"{key}: checkpoint {saved[key]!r}, now {here[key]!r}"
        for key in differing_entries(saved, here)
        if not (key == "gradient_clip" and saved[key] is None)
    ]
