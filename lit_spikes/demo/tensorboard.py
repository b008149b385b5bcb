"""What the demo shows in TensorBoard beside its runs: the custom-scalars layout of its
curves, one chart per tag across every row, and the HPARAMS metric of its rows, the final
validation bits/char (``lit_spikes.shared.tb`` writes them; it names no demo tag)."""

from __future__ import annotations

from lit_spikes.shared.tb import hparam_tag

HPARAM_METRIC = hparam_tag("val/bpc")
"""The HPARAMS view's metric of the demos' rows: the final validation bits/char."""

LAYOUT = {
    "lit-spikes: all rows on one chart": {
        "training loss": ["Multiline", [r"^train/loss$"]],
        "largest attention logit": ["Multiline", [r"^train/max_logit$"]],
        "learning rate": ["Multiline", [r"^lr$"]],
        "gradient norm (before clipping)": ["Multiline", [r"^grad_norm$"]],
        "validation bits/char": ["Multiline", [r"^val/bpc$"]],
        "data position": ["Multiline", [r"^data/position$"]],
    }
}
"""Custom-scalars layout: one Multiline chart per tag, matching that tag in every run."""
