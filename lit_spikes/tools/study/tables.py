"""The tables of a study's report, shared by every study (the demos' too): the machine
it ran on, markdown tables, the findings' section and CSV."""

from __future__ import annotations

import csv
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_spikes.tools.study.findings import Finding


def machine() -> str:
    """The CPU's model name (``lscpu``'s), else the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cell_text(value: Any, digits: int = 3) -> str:
    """A table cell: ``-`` for nothing, floats to ``digits``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.3g}"  # a diverged run
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell_text(v) for v in row) + " |" for row in rows]
    return lines


def findings_section(found: Sequence[Finding]) -> list[str]:
    """The findings as a table and as sentences."""
    rows = []
    for f in found:
        lo, hi = f.interval
        rows.append([f.text, f"{f.holds} of {f.n} {f.unit}", f"{lo:.2f}-{hi:.2f}" if f.n else "-"])
    lines = ["## Findings", "", *table(["finding", "holds in", "95% Wilson interval"], rows)]
    return [*lines, "", *(f"- {f.sentence()}" for f in found if f.n), ""]


def write_findings_csv(path: Path, found: Sequence[Finding]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["key", "finding", "holds", "n", "fraction", "wilson_lo", "wilson_hi"])
        for f in found:
            lo, hi = f.interval
            writer.writerow([f.key, f.text, f.holds, f.n, f.holds / f.n if f.n else "", lo, hi])
