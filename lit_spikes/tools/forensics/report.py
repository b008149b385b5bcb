"""The forensics replay's verdict for a person: a few lines on the terminal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_spikes.tools.forensics.verdict import RUN, Exit

if TYPE_CHECKING:
    from lit_spikes.tools.forensics.run import Forensics

SHOWN = 8
"""The statistics named in the line of those that moved together; the rest counted."""

KINDS = {
    "forward": "its weights or outputs left their band while no layer before it did: the "
    "change entered the forward pass there",
    "backward": "its gradient left its band while no weights or outputs did: the change "
    "entered the backward pass there",
    "update": "its update or optimizer state left its band first",
}


def _named(exit_: Exit) -> str:
    where = "" if exit_.layer == RUN else f"{exit_.layer} "
    return f"{where}{exit_.stat} ({exit_.value:.4g}, {exit_.distance:.0f} spreads out)"


def verdict_lines(result: Forensics) -> list[str]:
    """The verdict in a few lines for a person."""
    steps = sorted({s for values in result.series.values() for s in values})
    checked = (
        f"the loss equals the run's logged loss to the bit at all {len(result.checked)} "
        "steps the run logged"
        if result.checked
        else "the run logged no loss at these steps, so the replay is unchecked"
    )
    lines = [
        f"Replayed steps {steps[0]}-{steps[-1]} from {result.ckpt_path} with "
        f"{len(result.layers)} layers instrumented: {checked}.",
        f"Bands from steps {result.band_steps.start}-{result.band_steps.stop - 1}; the "
        f"window searched: steps {result.window.start}-{result.window.stop - 1}.",
    ]
    if result.pace is not None:
        count, replayed, own = result.pace
        lines.append(
            f"The replay took {replayed:.1f} s for {count} steps, {own:.1f} s of it in the "
            f"instruments: the steps themselves {replayed - own:.1f} s."
        )
    reading, onset = result.reading, result.spike_step
    if reading.first_step is None:
        return [*lines, "No layer's statistic left its band before the loss onset."]
    lead = onset - reading.first_step
    plural = "s" if lead != 1 else ""
    when = f"at step {reading.first_step}, {lead} step{plural} before the loss onset at {onset}"
    if reading.kind == "optimizer":
        lr = [e for e in result.exits if e.layer == RUN and e.stat == "lr"]
        why = f" (the LR left its band at step {lr[0].step})" if lr else ""
        lines.append(
            f"First: every layer's update norm at once {when}: the optimizer's step moved, "
            f"not a layer{why}."
        )
    else:
        lines.append(f"First: {reading.origin} {when}: {KINDS[reading.kind]}.")
    together = [_named(e) for e in reading.together]
    more = f", and {len(together) - SHOWN} more" if len(together) > SHOWN else ""
    lines.append(
        f"Moved together at step {reading.first_step}: {', '.join(together[:SHOWN])}{more}."
    )
    loss = [e for e in result.exits if e.layer == RUN and e.stat == "loss"]
    if loss:
        lines.append(f"The loss left its band at step {loss[0].step}.")
    return lines
