"""Prove that a LightningModule resumes bit for bit, and name what breaks it.

``assert_resumes_exactly(Model, Data, steps=40, resume_at=17)`` trains uninterrupted and
interrupted (a real ``.ckpt``, resumed in a fresh Trainer) and raises ``ResumeNotExact``
naming the first divergence; the ``resume_check`` pytest fixture (``lit_spikes.testing.plugin``,
registered as a pytest11 entry point) calls it; ``docs/check-resume.md`` has the details.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lit_spikes.testing.check import (
        CheckInputError,
        Plan,
        ResumeNotExact,
        assert_resumes_exactly,
        check_resume,
    )
    from lit_spikes.testing.record import Record, Recorder
    from lit_spikes.testing.verdict import (
        COMPONENTS,
        Divergence,
        Report,
        compare,
        format_report,
        format_table,
    )

_HOME = {
    "CheckInputError": "check",
    "Plan": "check",
    "ResumeNotExact": "check",
    "assert_resumes_exactly": "check",
    "check_resume": "check",
    "COMPONENTS": "verdict",
    "Divergence": "verdict",
    "Report": "verdict",
    "compare": "verdict",
    "format_report": "verdict",
    "format_table": "verdict",
    "Record": "record",
    "Recorder": "record",
}
__all__ = [
    "COMPONENTS",
    "CheckInputError",
    "Divergence",
    "Plan",
    "Record",
    "Recorder",
    "Report",
    "ResumeNotExact",
    "assert_resumes_exactly",
    "check_resume",
    "compare",
    "format_report",
    "format_table",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: pytest imports the plugin (a submodule, so this package too)
    # in every session of the environment, and torch and Lightning take seconds.
    if name in _HOME:
        return getattr(import_module(f"lit_spikes.testing.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
