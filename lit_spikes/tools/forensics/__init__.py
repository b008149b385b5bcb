"""Spike forensics by replay: which layer went first, at no cost to the run.

The run's resume is bit-exact, so the steps before a spike can be computed again from a
checkpoint before it with per-layer instruments attached (``instruments``), checked loss by
loss against the run's log (``run``), and read for the layer whose statistics left their
band first (``verdict``). The run itself carries no instrument.
"""

from lit_spikes.tools.forensics.config import ForensicsConfig
from lit_spikes.tools.forensics.instruments import LayerInstruments
from lit_spikes.tools.forensics.report import verdict_lines
from lit_spikes.tools.forensics.run import Forensics, ReplayNotExact, find_checkpoint, forensics
from lit_spikes.tools.forensics.verdict import Band, Exit, Reading, exits, read

__all__ = [
    "Band",
    "Exit",
    "Forensics",
    "ForensicsConfig",
    "LayerInstruments",
    "Reading",
    "ReplayNotExact",
    "exits",
    "find_checkpoint",
    "forensics",
    "read",
    "verdict_lines",
]
