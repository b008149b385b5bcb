"""What of a replay is not the run: each setting the checkpoint records that the replay
trained otherwise. A replay whose first steps differ from the run's logged losses is not
the run; naming the setting (clipping, precision, threads, a module or data argument, an
unknown ``max_steps``) points at the fix, where "a setting differs" only said to look."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from lit_spikes.callbacks.exact_resume import saved_fingerprint
from lit_spikes.callbacks.fingerprint import differing_entries, fingerprint

FINGERPRINT_NAMES = {
    "precision": "--trainer.precision",
    "gradient_clip": "gradient clipping (--trainer.gradient_clip_val)",
    "num_threads": "torch threads (--num_threads)",
    "flush_denormal": "subnormal flushing (torch.set_flush_denormal)",
    "world_size": "processes (world size)",
    "deterministic": "deterministic algorithms",
}
"""How each entry of ``ExactResume``'s fingerprint is named to a user."""

UNKNOWN_LENGTH = (
    "max_steps: the run's is not known (no config.yaml beside the file records it), the "
    "replay's ends at the horizon: a schedule over trainer.max_steps replays another"
)


def _same(recorded: Any, replayed: Any) -> bool:
    try:
        return bool(recorded == replayed)
    except (RuntimeError, TypeError, ValueError):  # a tensor of several values: not told
        return True


def _arguments(flag: str, recorded: Any, replayed: Any) -> list[str]:
    """The saved hyper-parameters (``save_hyperparameters``) that differ, as ``--flag.name``."""
    if not isinstance(recorded, Mapping) or not isinstance(replayed, Mapping):
        return []
    return [
        f"{flag}.{name}: the run's {recorded[name]!r}, the replay's {replayed[name]!r}"
        for name in sorted(set(recorded) & set(replayed), key=str)
        if not _same(recorded[name], replayed[name])
    ]


def settings_unlike_the_run(
    checkpoint: dict[str, Any],
    trainer: pl.Trainer,
    module: pl.LightningModule,
    datamodule: Any,
    length_known: bool,
) -> list[str]:
    """Each setting the checkpoint records (``ExactResume``'s fingerprint, the module's and
    the data's saved hyper-parameters) that the replay ran with otherwise, and its length
    where the run's is not known: ``"<setting>: the run's <a>, the replay's <b>"``."""
    saved, here = saved_fingerprint(checkpoint), fingerprint(trainer)
    lines = [
        f"{FINGERPRINT_NAMES.get(key, key)}: the run's {saved[key]!r}, the replay's {here[key]!r}"
        for key in differing_entries(saved, here)  # clipping added too: not the run's
    ]
    lines += _arguments("--model", checkpoint.get("hyper_parameters"), module.hparams)
    data_hparams = getattr(datamodule, "hparams", None)
    lines += _arguments("--data", checkpoint.get("datamodule_hyper_parameters"), data_hparams)
    if not length_known:
        lines.append(UNKNOWN_LENGTH)
    return lines
