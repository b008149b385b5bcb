"""The demos' findings over the seeds of a study (``lit_spikes.tools.study.findings``:
the interval and the counting)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from lit_spikes.tools.study import Finding as Finding
from lit_spikes.tools.study import SeedCells, count
from lit_spikes.tools.study import wilson as wilson


def _below(kind: str) -> Callable[[SeedCells], bool]:
    return lambda s: s[kind]["val_bpc"] < s["reference"]["val_bpc"]


def findings(seeds: Sequence[SeedCells]) -> list[Finding]:
    """Each of the seed's findings over ``seeds`` (each a seed's cells by kind). "Doing
    nothing" is the reference run: from the checkpoint on, the exact resume is it."""
    rules: list[tuple[str, str, Sequence[str], Callable[[SeedCells], bool]]] = [
        (
            "spike",
            "a post-warm-up loss spike is flagged in the reference run",
            ["reference"],
            lambda s: s["reference"]["onset"] is not None,
        ),
        (
            "exact_resume_equal",
            "the exact resume equals the reference (every parameter torch.equal, every loss)",
            ["resume_exact"],
            lambda s: s["resume_exact"]["params_equal"] and s["resume_exact"]["losses_equal"],
        ),
        (
            "fresh_adamw_worse",
            "a fresh AdamW ends above doing nothing (val bits/char)",
            ["reference", "fresh_adamw"],
            lambda s: not _below("fresh_adamw")(s),
        ),
        (
            "other_data_differs",
            "another data seed gives another trajectory (a loss differs)",
            ["other_data_seed"],
            lambda s: not s["other_data_seed"]["losses_equal"],
        ),
        (
            "scale_lr_better",
            "halving the LR ends below doing nothing",
            ["reference", "scale_lr"],
            _below("scale_lr"),
        ),
        (
            "skip_before_better",
            "skipping the data window that ends at the spike ends below doing nothing",
            ["reference", "skip_before"],
            _below("skip_before"),
        ),
        (
            "skip_straddle_better",
            "skipping the data window that straddles the spike ends below doing nothing",
            ["reference", "skip_straddle"],
            _below("skip_straddle"),
        ),
        (
            "clip_no_cure",
            "clipping the gradient norm ends no lower than doing nothing (no cure)",
            ["reference", "clip"],
            lambda s: not _below("clip")(s),
        ),
        (
            "qk_norm_bounds_logit",
            "QK-norm keeps the largest attention logit below the plain run's",
            ["reference", "qk_norm"],
            lambda s: s["qk_norm"]["max_logit"] < s["reference"]["max_logit"],
        ),
    ]
    out = []
    for key, text, needs, holds in rules:
        k, n = count(seeds, needs, holds)
        out.append(Finding(key, text, k, n))
    causes = Counter(s["diagnose"]["cause"] for s in seeds if "diagnose" in s)
    diagnosed = sum(causes.values())
    for cause in sorted(causes):
        out.append(
            Finding(
                f"diagnose_{cause}",
                f"diagnose calls the seed's first spike {cause} (of the seeds with a spike)",
                causes[cause],
                diagnosed,
            )
        )
    return out
