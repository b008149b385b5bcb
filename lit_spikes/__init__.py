"""lit-spikes: bit-exact resume and loss-spike remedies for any Lightning run.

The library: ``StepLoader`` (here) and the callbacks in ``lit_spikes.callbacks``; the
demo's tiny GPT and world, and the tools (recover, diagnose, check-resume), sit on top.
What the tools read of a module: ``ToolFacts`` (docs/tool-facts.md).
"""

from typing import TYPE_CHECKING, Any

from lit_spikes.tool_facts import (
    ChecksItsRun,
    Column,
    SpikeToolsModule,
    ToolFacts,
    Variant,
    facts_of,
)

if TYPE_CHECKING:
    from lit_spikes.loader import StepLoader

__all__ = [
    "ChecksItsRun",
    "Column",
    "SpikeToolsModule",
    "StepLoader",
    "ToolFacts",
    "Variant",
    "facts_of",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: torch takes seconds, and `lit-spikes --help` (lit_spikes.tools.cli)
    # or a command that needs no tensor must not wait for it.
    if name == "StepLoader":
        from lit_spikes.loader import StepLoader

        return StepLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
