"""``lit-spikes study``: how often a recipe spikes, whether its resume is exact, which
remedy helps, over many seeds (``cli``: the command; ``config``: its options; ``cells``:
what each seed runs; ``jobs``: the cells as a job a rerun continues; ``findings`` and
``report``: k of n with a Wilson interval). The demos' own study runs its cells through
``jobs`` and counts through ``findings`` and ``report`` (their ``__all__`` below)."""

from typing import TYPE_CHECKING, Any

from lit_spikes.tools.study.early_warning import crossings
from lit_spikes.tools.study.findings import Finding, SeedCells, count, wilson
from lit_spikes.tools.study.jobs import (
    RESULT,
    AnotherStudy,
    Cell,
    StudyInterrupted,
    StudyPlan,
    StudyRun,
    check_log_root,
    done_cells,
    read_result,
    run_cell,
    run_study,
)
from lit_spikes.tools.study.tables import (
    cell_text,
    findings_section,
    machine,
    table,
    write_findings_csv,
)

if TYPE_CHECKING:
    from lit_spikes.tools.study.cli import main

__all__ = [
    "RESULT",
    "AnotherStudy",
    "Cell",
    "Finding",
    "SeedCells",
    "StudyInterrupted",
    "StudyPlan",
    "StudyRun",
    "cell_text",
    "check_log_root",
    "count",
    "crossings",
    "done_cells",
    "findings_section",
    "machine",
    "main",
    "read_result",
    "run_cell",
    "run_study",
    "table",
    "wilson",
    "write_findings_csv",
]


def __getattr__(name: str) -> Any:
    # The command (Lightning, the study's config) imported on first use only
    if name == "main":
        from lit_spikes.tools.study.cli import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
