"""The study's report, computed from the cells' results alone: ``report.md`` (findings
with their intervals, each seed's outcomes, early warning, the sweep), ``findings.csv``
and ``cells.csv`` in the log root, and the report as text in TensorBoard."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_spikes.demo.study.cells import REMEDIES
from lit_spikes.demo.study.config import StudyConfig
from lit_spikes.demo.study.findings import Finding, findings
from lit_spikes.demo.study.leads import spike_leads, summarize
from lit_spikes.demo.study.sweep import sweep_points, sweep_summary
from lit_spikes.tools.study import (
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
    """Each seed's cell results by kind."""
    leads: list[dict[str, Any]]
    """Each flagged spike's leads, with its seed."""
    lead_rows: list[dict[str, Any]]
    sweep: list[dict[str, Any]]
    sweep_lines: list[str]
    markdown: str


def by_seed(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """The seeds' cells (not the sweep's), each seed's by kind, in seed order."""
    seeds: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for result in results.values():
        if result["kind"] != "sweep":
            key = (result["model_seed"], result["data_seed"])
            seeds.setdefault(key, {})[result["kind"]] = dict(result)
    return [seeds[key] for key in sorted(seeds, key=lambda k: (k[1], k[0]))]


def build_report(
    config: StudyConfig, results: Mapping[str, Mapping[str, Any]], wall_s: float | None = None
) -> StudyReport:
    seeds = by_seed(results)
    leads = []
    for seed in seeds:
        reference = seed.get("reference")
        if reference is None or not reference["spikes"]:
            continue
        norms_file = config.log_root / reference["name"] / "update_norms.json"
        norms = json.loads(norms_file.read_text()) if norms_file.is_file() else {}
        for item in spike_leads(reference, norms, config.leads):
            leads.append({"model_seed": reference["model_seed"], **item})
    lead_rows = summarize(leads)
    sweep = sweep_points([r for r in results.values() if r["kind"] == "sweep"])
    found = findings(seeds)
    report = StudyReport(found, seeds, leads, lead_rows, sweep, sweep_summary(sweep), "")
    report.markdown = _markdown(config, report, len(results), wall_s)
    return report


def _markdown(config: StudyConfig, report: StudyReport, cells: int, wall_s: float | None) -> str:
    took = f", {wall_s / 60:.1f} min" if wall_s else ""
    lines = [
        "# lit-spikes study",
        "",
        f"{len(report.seeds)} of {len(config.seeds)} seeds done (model seeds "
        f"{config.model_seeds}, data seeds {config.data_seeds}), "
        f"{config.steps} steps each, peak LR {config.peak_lr:g}; {cells} cells on "
        f"{machine()}{took}. One run's exact numbers differ from one CPU to another; these "
        "frequencies are what a single run is one draw of.",
        "",
    ]
    lines += findings_section(report.findings)
    lines += _seeds_section(report)
    lines += _leads_section(config, report)
    lines += _sweep_section(report)
    return "\n".join(lines)


def _seeds_section(report: StudyReport) -> list[str]:
    header = ["seed", "spike", "ckpt", "do nothing", *REMEDIES, "max logit", "QK-norm logit"]
    header.append("diagnose")
    rows = []
    for seed in report.seeds:
        ref = seed.get("reference", {})
        any_cell = next(iter(seed.values()))
        ckpt = next((c["params"].get("ckpt_step") for c in seed.values() if c["params"]), None)
        rows.append(
            [
                f"{any_cell['model_seed']}/{any_cell['data_seed']}",
                ref.get("onset"),
                ckpt,
                ref.get("val_bpc"),
                *(seed[k]["val_bpc"] if k in seed else None for k in REMEDIES),
                cell_text(ref.get("max_logit"), 1) if ref else None,
                cell_text(seed["qk_norm"]["max_logit"], 1) if "qk_norm" in seed else None,
                seed["diagnose"]["cause"] if "diagnose" in seed else None,
            ]
        )
    return ["## Each seed: val bits/char at the end", "", *table(header, rows)]


LEAD_COLUMNS = (
    "signal",
    "spikes",
    "before",
    "at_onset",
    "none",
    "median_lead",
    "min_lead",
    "max_lead",
)
"""The early-warning table's keys of each lead row, in its columns' order."""


def _leads_section(config: StudyConfig, report: StudyReport) -> list[str]:
    intro = (
        f"For each of the {len(report.leads)} flagged spikes: how many steps before the loss "
        f"each signal exceeded {config.leads.ratio:g}x the mean of its previous "
        f"{config.leads.window} values (within {config.leads.lookback} steps before it)."
    )
    header = ["signal", "spikes", "warned before", "at the onset", "no warning"]
    header += ["median lead", "min", "max"]
    rows = [[r[k] for k in LEAD_COLUMNS] for r in report.lead_rows]
    return ["", "## Early warning", "", intro, "", *table(header, rows)]


def _sweep_section(report: StudyReport) -> list[str]:
    rows = [
        [
            f"{r['peak_lr']:g}",
            "yes" if r["qk_norm"] else "no",
            r["seeds"],
            r["final_loss"],
            cell_text(r["max_logit"], 1),
            cell_text(r["max_logit_max"], 1),
        ]
        for r in report.sweep
    ]
    header = ["peak LR", "QK-norm", "seeds", "final loss", "max logit (mean)"]
    header.append("max logit (largest)")
    lines = ["", "## LR sweep (Wortsman et al., 2023)", "", *table(header, rows)]
    return [*lines, "", *(f"- {line}" for line in report.sweep_lines), ""]


def write_report(
    config: StudyConfig, report: StudyReport, results: Mapping[str, Mapping[str, Any]]
) -> list[Path]:
    """``report.md``, ``findings.csv`` and ``cells.csv`` in the log root; returns them."""
    root = config.log_root
    paths = [root / "report.md", root / "findings.csv", root / "cells.csv"]
    paths[0].write_text(report.markdown)
    write_findings_csv(paths[1], report.findings)
    keys = [
        "name",
        "kind",
        "model_seed",
        "data_seed",
        "val_bpc",
        "final_loss",
        "max_logit",
        "onset",
        "cause",
    ]
    with paths[2].open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(keys)
        for name in sorted(results):
            writer.writerow([results[name].get(k, "") for k in keys])
    from lit_spikes.demo.tensorboard import LAYOUT
    from lit_spikes.shared.tb import write_summary

    write_summary(root, {"study/report": report.markdown}, LAYOUT)
    return paths
