"""A study's report, computed from its cells' results alone: ``report.md`` (the findings
with their intervals and each seed's outcomes), ``findings.csv`` and ``cells.csv`` in the
log root. Every run is compared with doing nothing (the reference, which from the
checkpoint on the exact resume is) by recover's measure: the module's validation metric
at the last validation every run made (``ToolFacts.val_metric``), else the training loss
over the same data positions."""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_spikes.tools.recover.measure import common_measure
from lit_spikes.tools.recover.remedies import rung_name
from lit_spikes.tools.study.cells import DIAGNOSE, REFERENCE, RESUME
from lit_spikes.tools.study.config import StudyConfig
from lit_spikes.tools.study.findings import Finding, SeedCells, count
from lit_spikes.tools.study.tables import (
    cell_text,
    findings_section,
    machine,
    table,
    write_findings_csv,
)


@dataclass
class StudyReport:
    findings: list[Finding]
    seeds: list[dict[str, dict[str, Any]]]
    """Each seed's cell results by their name in the seed (``reference``, ``skip_data``,
    ``diagnose_step35``)."""
    measures: list[dict[str, Any]]
    """Each seed's measure: ``name`` and the value of each run compared."""
    markdown: str


def by_seed(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """Each seed's cells by their name in the seed, in seed order (the sweep's apart)."""
    seeds: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for result in results.values():
        if result["kind"] != "sweep":
            key = (result["model_seed"], result["data_seed"])
            seeds.setdefault(key, {})[result["name"].rsplit("/", 1)[-1]] = dict(result)
    return [seeds[key] for key in sorted(seeds, key=lambda k: (k[1], k[0]))]


def seed_measure(config: StudyConfig, seed: SeedCells) -> dict[str, Any]:
    """The seed's runs measured alike: doing nothing (the reference) and each rung."""
    names = [rung_name(r) for r in config.rungs]
    rows = {n: seed[n]["records"] for n in [REFERENCE, *names] if n in seed}
    measure = common_measure(rows, config.facts.val_metric)
    return {"name": measure.name, "values": measure.values}


def _better(config: StudyConfig, name: str, measure: Mapping[str, Any]) -> bool | None:
    """Whether the rung ``name`` ended better than doing nothing (None: not measured)."""
    values = measure["values"]
    rung, nothing = values.get(name), values.get(REFERENCE)
    if rung is None or nothing is None:
        return None
    return bool(rung > nothing if config.facts.val_mode == "max" else rung < nothing)


def findings(
    config: StudyConfig, seeds: Sequence[SeedCells], measures: Sequence[Any]
) -> list[Finding]:
    """The study's findings over ``seeds`` (each seed's cells, ``measures`` theirs)."""
    spiked = [s[REFERENCE]["onset"] is not None for s in seeds]
    out = [
        Finding(
            "spike",
            f"the reference run flags a spike ({', '.join(config.detector.monitor)})",
            sum(spiked),
            len(seeds),
        ),
        Finding(
            "exact_resume_equal",
            "the exact resume equals the reference (every tensor torch.equal, every loss)",
            *count(
                seeds, [RESUME], lambda s: s[RESUME]["params_equal"] and s[RESUME]["losses_equal"]
            ),
        ),
    ]
    named = measures[0]["name"].split(" (")[0] if measures else "the measure"
    metric = config.facts.val_name or named
    for rung in config.rungs:
        name = rung_name(rung)
        judged = [
            (was_spiked, better)
            for was_spiked, m in zip(spiked, measures, strict=True)
            if (better := _better(config, name, m)) is not None
        ]
        for with_spike, key, where in (
            (True, "", "seeds with a spike"),
            (False, "_no_spike", "seeds without"),
        ):
            group = [better for was_spiked, better in judged if was_spiked == with_spike]
            text = f"{_label(rung)} ends better than doing nothing ({metric}; {where})"
            out.append(Finding(f"{name}_better{key}", text, sum(group), len(group)))
    causes = Counter(
        cell["cause"] for s in seeds for n, cell in s.items() if n.startswith(f"{DIAGNOSE}_")
    )
    for cause in sorted(causes):
        text = f"diagnose calls a flagged spike {cause}"
        out.append(
            Finding(f"diagnose_{cause}", text, causes[cause], sum(causes.values()), "spikes")
        )
    return out


def _label(rung: Mapping[str, Any]) -> str:
    options = ", ".join(f"{k} {v}" for k, v in (rung.get("init_args") or {}).items())
    return f"{rung_name(rung)} ({options})" if options else rung_name(rung)


def build_report(
    config: StudyConfig, results: Mapping[str, Mapping[str, Any]], wall_s: float | None = None
) -> StudyReport:
    seeds = [s for s in by_seed(results) if REFERENCE in s]
    measures = [seed_measure(config, s) for s in seeds]
    report = StudyReport(findings(config, seeds, measures), seeds, measures, "")
    report.markdown = _markdown(config, report, len(results), wall_s)
    return report


def _markdown(config: StudyConfig, report: StudyReport, cells: int, wall_s: float | None) -> str:
    took = f", {wall_s / 60:.1f} min" if wall_s else ""
    lines = [
        "# lit-spikes study",
        "",
        f"Model `{config.run.model_name}`, data `{config.data.get('class_path')}`; "
        f"{len(report.seeds)} of {len(config.seeds)} seeds done ({config.seeds}), "
        f"{config.steps} steps each; {cells} cells on {machine()}{took}.",
        "",
        *findings_section([f for f in report.findings if f.n]),  # all in findings.csv
        *_seeds_section(config, report),
    ]
    return "\n".join(lines)


def _seeds_section(config: StudyConfig, report: StudyReport) -> list[str]:
    names = [rung_name(r) for r in config.rungs]
    header = ["seed", "spikes", "ckpt", "exact resume", "do nothing", *names, "diagnose"]
    rows = []
    for seed, measure in zip(report.seeds, report.measures, strict=True):
        ref = seed[REFERENCE]
        resume = seed.get(RESUME)
        causes = [
            f"{cell['spike_step']}: {cell['cause']}"
            for n, cell in sorted(seed.items())
            if n.startswith(f"{DIAGNOSE}_")
        ]
        rows.append(
            [
                ref["model_seed"],
                ", ".join(map(str, ref["onsets"])) or "none",
                resume["params"]["ckpt_step"] if resume else None,
                None
                if resume is None
                else ("equal" if resume["params_equal"] and resume["losses_equal"] else "differs"),
                *(measure["values"].get(n) for n in [REFERENCE, *names]),
                "; ".join(causes) or None,
            ]
        )
    measured = report.measures[0]["name"] if report.measures else "-"
    return [f"## Each seed: {measured}", "", *table(header, rows), ""]


def write_report(config: StudyConfig, report: StudyReport) -> list[Path]:
    """``report.md``, ``findings.csv`` and ``cells.csv`` in the log root; returns them."""
    root = config.log_root
    paths = [root / "report.md", root / "findings.csv", root / "cells.csv"]
    paths[0].write_text(report.markdown)
    write_findings_csv(paths[1], report.findings)
    keys = ["name", "kind", "seed", "start_step", "onsets", "measure", "params_equal", "cause"]
    with paths[2].open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(keys)
        for seed, measure in zip(report.seeds, report.measures, strict=True):
            for short, cell in sorted(seed.items()):
                values = {
                    **cell,
                    "seed": cell["model_seed"],
                    "measure": measure["values"].get(short),
                }
                values["onsets"] = " ".join(map(str, cell.get("onsets") or []))
                writer.writerow([cell_text(values.get(k)) for k in keys])
    return paths
