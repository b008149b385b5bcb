"""The LR-sensitivity sweep, after Wortsman et al. (2023), "Small-scale proxies for
large-scale Transformer training instabilities": final loss and largest attention logit
against the peak LR, with and without QK-norm. Their claim: without QK-norm the logits
grow by orders of magnitude and the loss degrades at high LR; QK-norm flattens both."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def sweep_points(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (peak LR, QK-norm): the seeds' mean final loss (the last 10 steps'
    mean), their mean and largest ``max_logit`` and the seeds behind them."""
    groups: dict[tuple[float, bool], list[Mapping[str, Any]]] = {}
    for cell in cells:
        key = (float(cell["params"]["peak_lr"]), bool(cell["params"]["qk_norm"]))
        groups.setdefault(key, []).append(cell)
    rows = []
    for (lr, qk), group in sorted(groups.items()):
        losses = [c["final_loss"] for c in group]
        logits = [c["max_logit"] for c in group]
        rows.append(
            {
                "peak_lr": lr,
                "qk_norm": qk,
                "seeds": len(group),
                "final_loss": _mean(losses),
                "final_loss_min": min(losses),
                "final_loss_max": max(losses),
                "max_logit": _mean(logits),
                "max_logit_max": max(logits),
                "val_bpc": _mean([c["val_bpc"] for c in group]),
            }
        )
    return rows


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def sweep_summary(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the sweep shows, in words, whichever way it comes out."""
    lines = []
    for qk in (False, True):
        curve = [r for r in rows if r["qk_norm"] == qk]
        if len(curve) < 2:
            continue
        low, high = curve[0], curve[-1]
        best = min(curve, key=lambda r: r["final_loss"])
        what = "with QK-norm" if qk else "without QK-norm"
        lines.append(
            f"{what}: from peak LR {low['peak_lr']:g} to {high['peak_lr']:g} the largest "
            f"attention logit goes from {low['max_logit']:.1f} to {high['max_logit']:.1f} "
            f"({high['max_logit'] / low['max_logit']:.1f}x); final loss {low['final_loss']:.3f}"
            f" to {high['final_loss']:.3f}, lowest {best['final_loss']:.3f} at {best['peak_lr']:g}"
        )
    plain = {r["peak_lr"]: r for r in rows if not r["qk_norm"]}
    normed = {r["peak_lr"]: r for r in rows if r["qk_norm"]}
    shared = sorted(set(plain) & set(normed))
    if shared:
        lower = [lr for lr in shared if normed[lr]["final_loss"] < plain[lr]["final_loss"]]
        lines.append(
            f"QK-norm ends at a lower loss at {len(lower)} of {len(shared)} peak LRs"
            + (f" ({', '.join(f'{lr:g}' for lr in lower)})" if lower else "")
        )
    return lines
