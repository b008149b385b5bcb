"""The remedies of the ladder as plain JSON specs (what the ledger records), the
callbacks and Trainer arguments a spec stands for, and the spec each rung gets for a
spike."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import BatchSkipper, LRScaler, SkipStep
from lit_spikes.recover.config import RecoverConfig
from lit_spikes.recover.ledger import BranchRecord, Intervention


def remedy_callbacks(specs: Sequence[dict[str, Any]]) -> tuple[list[Callback], dict[str, Any]]:
    """The callbacks and Trainer arguments of a lineage's remedies (JSON specs)."""
    callbacks: list[Callback] = []
    trainer_kwargs: dict[str, Any] = {}
    for spec in specs:
        kind = spec["kind"]
        if kind == "skip_data":
            callbacks.append(BatchSkipper(ranges=[tuple(r) for r in spec["ranges"]]))
        elif kind == "scale_lr":
            callbacks.append(LRScaler(spec["factor"], start_step=spec["start_step"]))
        elif kind == "skip_step":
            callbacks.append(
                SkipStep(
                    window=spec["window"],
                    sigma=spec["sigma"],
                    warmup=spec["warmup"],
                    start_step=spec["start_step"],
                    initial=spec["initial"],
                )
            )
        elif kind == "clip":
            trainer_kwargs["gradient_clip_val"] = spec["value"]
        else:
            raise ValueError(f"unknown remedy kind {kind!r} in {spec!r}")
    return callbacks, trainer_kwargs


def describe_remedy(spec: dict[str, Any]) -> str:
    kind = spec["kind"]
    if kind == "skip_data":
        return ", ".join(f"skip data {a}-{b - 1}" for a, b in spec["ranges"])
    if kind == "scale_lr":
        return f"LR x{spec['factor']:g} from step {spec['start_step']}"
    if kind == "skip_step":
        return f"skip-step ({spec['sigma']:g} sigma) from step {spec['start_step']}"
    return f"clip grad norm at {spec['value']:g}"


def remedy_spec(
    remedy: str,
    config: RecoverConfig,
    intervention: Intervention,
    spiked: BranchRecord,
    records: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The JSON spec of ``remedy`` for this spike and checkpoint; ``records`` are the
    spiked lineage's per-step records."""
    k = intervention.ckpt_step
    if remedy == "skip_data":
        positions = {r["step"]: r for r in records if "step" in r}
        first = int(positions[k]["position"]) if k in positions else k
        start = max(first, int(intervention.spike["position"]) - config.skip_before)
        return {"kind": "skip_data", "ranges": [[start, start + config.skip_length]]}
    if remedy == "scale_lr":
        current = [r["factor"] for r in spiked.remedies if r["kind"] == "scale_lr"]
        factor = (current[-1] if current else 1.0) * config.lr_factor
        return {"kind": "scale_lr", "factor": factor, "start_step": k}
    if remedy == "skip_step":
        losses = [
            float(r["loss"])
            for r in records
            if "step" in r and r["step"] < k and math.isfinite(r["loss"])
        ][-config.skip_step_window :]
        return {
            "kind": "skip_step",
            "window": config.skip_step_window,
            "sigma": config.skip_step_sigma,
            "warmup": min(10, config.skip_step_window),  # the window starts filled
            "start_step": k,
            "initial": losses,
        }
    clips = [r["value"] for r in spiked.remedies if r["kind"] == "clip"]
    return {"kind": "clip", "value": min([config.clip_norm, *clips])}
