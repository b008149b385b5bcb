"""The evidence a verdict prints: one line per replay, and the reading of the cause,
written from the same numbers ``verdict_cause`` decides on."""

from __future__ import annotations

from collections.abc import Sequence

from lit_spikes.tools.diagnose.config import DiagnoseConfig
from lit_spikes.tools.diagnose.verdict import Cause, Replay, deciding_ratio

NO_RNG = (
    "the checkpoint holds no RNG states (the run trained without ExactResume) and the "
    "module draws random numbers in its steps (dropout): a replay draws others"
)
"""Why a replay of a random module cannot match a run that saved no RNG states."""


def _compared(same: Replay, original: float | None, incomparable: str | None) -> str:
    """How replay (a)'s loss at the spike compares with the original's."""
    if original is None:
        return "no original loss to compare with (pass original_loss / --spike_loss)"
    if same.bit_equal:
        return f"bit-identical to the original {original!r}"
    if same.bit_equal is None and incomparable:
        return (
            f"the original was {original:.4f}; bit-equality cannot be told here "
            f"({incomparable}), so the spike counts as back where it is flagged"
        )
    if same.bit_equal is None:
        return (
            f"the original as given, {original!r} (rounded: bit-equality cannot be told; "
            "the run's TensorBoard events have every digit)"
        )
    return f"the original was {original:.4f} (differs by {same.loss_at_spike - original:+.2e})"


def same_data_line(
    spike_step: int, same: Replay, original: float | None, incomparable: str | None
) -> str:
    return (
        f"(a) same state, same data, from step {same.ckpt_step}: loss at step {spike_step} "
        f"{same.loss_at_spike:.4f}, {_compared(same, original, incomparable)}; flagged steps "
        f"{same.flagged or 'none'}."
    )


def no_spike_line(spike_step: int, same: Replay, original: float | None) -> str:
    judge = (
        "the run's own detector, continued from the checkpoint,"
        if same.detector_from_checkpoint
        else "a fresh detector (the checkpoint holds none of these settings: "
        "--window_before or a detector like the run's may judge otherwise)"
    )
    replayed = (
        "replays bit-identically"
        if same.bit_equal
        else "replays (no original loss)"
        if original is None
        else "replays (to the given loss's decimals)"
    )
    return (
        f"Step {spike_step} {replayed}, but it is no spike: {judge} flags "
        f"{same.flagged or 'no step'} there. Nothing to diagnose at step {spike_step}; "
        "give a flagged step (TensorBoard's spike/loss, or the run's SpikeDetector.spikes)."
    )


def not_the_run(step: int, logged: float, replayed: float, settings: str, unlike: list[str]) -> str:
    """Replay (a) differs from the run's logged loss before the spike: it is not the run;
    ``unlike`` names the settings the checkpoint records otherwise."""
    found = (
        f"It differs from the run in {'; '.join(unlike)}"
        if unlike
        else "No setting the checkpoint records differs: one it does not record does (the "
        "module's code, an argument it does not save, a callback, the data as given)"
    )
    return (
        f"The replay is not the run: its loss at step {step}, before the spike, is "
        f"{replayed!r} against the run's logged {logged!r}. {found}. Give the run's (its "
        "config.yaml, --model.*, --data.*, --trainer.*) before suspecting the hardware "
        f"(replayed with {settings})."
    )


NOT_REPRODUCED = (
    "The spike does not come back from the same state and data: the run's own "
    "state and data do not produce it; something outside them did (hardware fault, "
    "bit flip, a process that touched the weights)."
)


def other_data_lines(
    spike_step: int,
    same: Replay,
    others: Sequence[Replay],
    position: int,
    config: DiagnoseConfig,
) -> list[str]:
    """A line for each other-data replay, with its rise ratio, then how they decide."""
    lines = []
    for index, other in enumerate(others, start=1):
        assert other.skipped is not None
        first, end = other.skipped
        name = "(b)" if len(others) == 1 else f"(b{index})"
        line = (
            f"{name} same state, data positions {first}-{end - 1} skipped (the spike's "
            f"position is {position}): max loss {other.max_loss:.4f} from step "
            f"{spike_step - config.window_before} on (same data: {same.max_loss:.4f}); "
            f"flagged steps {other.flagged or 'none'}"
        )
        judgement = other.judgement
        line += f"; it {judgement.describe()}." if judgement is not None else "."
        lines.append(line)
    ratio = deciding_ratio(others)
    back = sum(o.ratio >= config.recurrence for o in others)
    if 0 < back < len(others):
        lines.append(
            f"The other-data replays disagree: {back} of {len(others)} bring the spike back; "
            f"the median of their ratios, {ratio:.2f}, decides against the bar "
            f"{config.recurrence:g}. More windows (--windows {len(others) + 2}) or an earlier "
            "checkpoint (--earlier_ckpt_path, replay (c)) would settle it."
        )
    elif len(others) > 1:
        said = "bring the spike back" if back else "leave the spike out"
        lines.append(f"All {len(others)} other-data replays {said} (median ratio {ratio:.2f}).")
    return lines


def earlier_lines(spike_step: int, same: Replay, earlier: Replay) -> list[str]:
    lines = [
        f"(c) from the earlier step-{earlier.ckpt_step} checkpoint, same data: loss at step "
        f"{spike_step} {earlier.loss_at_spike:.4f}, "
        + (
            "bit-identical"
            if earlier.bit_equal
            else "not bit-identical"
            if earlier.bit_equal is False
            else "bit-equality cannot be told"
        )
        + (" to the same-data replay" if not same.bit_equal else "")
        + f"; flagged steps {earlier.flagged or 'none'}."
    ]
    if earlier.bit_equal is False:
        lines.append(
            f"The spike comes back from step {same.ckpt_step} but not from step "
            f"{earlier.ckpt_step}: the step-{same.ckpt_step} state is not what the run's own "
            "history produces."
        )
    return lines


READINGS: dict[Cause, str] = {
    "state-caused": "Without the data around it the run still spikes: the state (weights, "
    "optimizer moments, learning rate) causes it; aim at the cause (lower LR, QK-norm), "
    "skipping data only moves it.",
    "data-caused": "Without the data around it the spike is gone: those batches cause it; "
    "skipping them (PaLM) removes it.",
}
"""The last line of a verdict that replay (b) decided."""
