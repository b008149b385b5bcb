"""A study's report, computed from its cells' results alone: ``report.md`` (the findings
with their intervals and each seed's outcomes), ``findings.csv`` and ``cells.csv`` in the
log root. Every run is compared with doing nothing (the reference, which from the
checkpoint on the exact resume is) by recover's measure: the module's validation metric
at the last validation every run made (``ToolFacts.val_metric``), else the training loss
over the same data positions."""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_spikes.tools.recover.measure import common_measure
from lit_spikes.tools.study.cells import DIAGNOSE, REFERENCE, RESUME, SWEEP
from lit_spikes.tools.study.config import StudyConfig
from lit_spikes.tools.study.early_warning import LeadCount, early_warning, verdict
from lit_spikes.tools.study.findings import Finding, SeedCells, count, wilson
from lit_spikes.tools.study.sweep import points, summary
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
    sweep: list[dict[str, Any]]
    """The sweep's points (``sweep.points``)."""
    sweep_lines: list[str]
    """Its LR sensitivity in words."""
    warnings: dict[str, list[LeadCount]]
    """Each early-warning signal's counts at each lead."""
    warning_line: str
    """Which signal warns best, or none."""
    variant: str
    """The sweep's variant as the report names it."""
    markdown: str


def by_seed(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """Each seed's cells by their name in the seed, in seed order (the sweep's apart)."""
    seeds: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for result in results.values():
        if result["kind"] != SWEEP:
            key = (result["model_seed"], result["data_seed"])
            seeds.setdefault(key, {})[result["name"].rsplit("/", 1)[-1]] = dict(result)
    return [seeds[key] for key in sorted(seeds, key=lambda k: (k[1], k[0]))]


def seed_measure(config: StudyConfig, seed: SeedCells) -> dict[str, Any]:
    """The seed's runs measured alike: doing nothing (the reference), each rung and each
    variant."""
    names = [REFERENCE, *config.rung_names, *config.variant_cells]
    rows = {n: seed[n]["records"] for n in names if n in seed}
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
        name = rung["name"]
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
    out += _variant_findings(config, seeds, measures, metric)
    for name, changes in config.controls.items():
        text = f"{name} (resumed with {json.dumps(changes)}) gives another trajectory"
        holds = count(seeds, [name], _differs(name))
        out.append(Finding(f"{name}_differs", f"{text} (a loss differs)", *holds))
    causes = Counter(
        cell["cause"] for s in seeds for n, cell in s.items() if n.startswith(f"{DIAGNOSE}_")
    )
    for cause in sorted(causes):
        text = f"diagnose calls a flagged spike {cause}"
        out.append(
            Finding(f"diagnose_{cause}", text, causes[cause], sum(causes.values()), "spikes")
        )
    return out


def _differs(name: str) -> Callable[[SeedCells], bool]:
    return lambda seed: not seed[name]["losses_equal"]


def _variant_findings(
    config: StudyConfig, seeds: Sequence[SeedCells], measures: Sequence[Any], metric: str
) -> list[Finding]:
    """Each variant against doing nothing: by the measure, and by each column (its
    largest value over the run below the plain run's: the demo's QK-norm and logit)."""
    out = []
    for cell, variant in zip(config.variant_cells, config.facts.variants, strict=False):
        judged = [b for m in measures if (b := _better(config, cell, m)) is not None]
        text = f"{variant.label} ends better than doing nothing ({metric}; every seed)"
        out.append(Finding(f"{cell}_better", text, sum(judged), len(judged)))
        for column in config.facts.columns:
            key = column.key
            below = [
                lower
                for s in seeds
                if cell in s
                and (lower := _largest_below(s[cell]["records"], s[REFERENCE]["records"], key))
                is not None
            ]
            text = f"{variant.label} keeps the {column.header} below the plain run's"
            out.append(Finding(f"{cell}_lowers_{key}", text, sum(below), len(below)))
    return out


def _largest_below(
    records: Sequence[Mapping[str, Any]], plain: Sequence[Mapping[str, Any]], key: str
) -> bool | None:
    """Whether the largest ``key`` of ``records`` is below ``plain``'s (None: unrecorded)."""
    values = [float(r[key]) for r in records if key in r]
    others = [float(r[key]) for r in plain if key in r]
    return max(values) < max(others) if values and others else None


def _label(rung: Mapping[str, Any]) -> str:
    options = ", ".join(f"{k} {v}" for k, v in (rung.get("init_args") or {}).items())
    return f"{rung['name']} ({options})" if options else str(rung["name"])


def build_report(
    config: StudyConfig, results: Mapping[str, Mapping[str, Any]], wall_s: float | None = None
) -> StudyReport:
    seeds = [s for s in by_seed(results) if REFERENCE in s]
    measures = [seed_measure(config, s) for s in seeds]
    sign = -1.0 if config.facts.val_mode == "max" else 1.0
    swept = points(
        [r for r in results.values() if r["kind"] == SWEEP], config.facts.val_metric, sign
    )
    variant = config.sweep.variant
    named = variant if isinstance(variant, str) or variant is None else json.dumps(variant)
    lines = summary(swept, named)
    columns = [c.key for c in config.facts.columns]
    references = [s[REFERENCE] for s in seeds]
    table = early_warning(references, config.log_root, columns, config.leads, config.first_step)
    found = findings(config, seeds, measures)
    variant_name = named or ""
    report = StudyReport(
        found, seeds, measures, swept, lines, table, verdict(table), variant_name, ""
    )
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
        *_warning_section(config, report),
        *_sweep_section(config, report),
    ]
    return "\n".join(lines)


def _seeds_section(config: StudyConfig, report: StudyReport) -> list[str]:
    names = [*config.rung_names, *config.variant_cells]
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


def _warning_section(config: StudyConfig, report: StudyReport) -> list[str]:
    leads = config.leads
    intro = (
        f"Each reference run's signals from step {config.first_step}: a signal crosses where "
        f"it exceeds {leads.ratio:g}x the mean of its previous {leads.window} values. At "
        "lead L a crossing is a true alarm where a spike's onset follows within L steps, "
        "else a false alarm; the steps judged are the stretches between spikes (not a "
        "flagged step, which is the spike itself, nor one whose window holds a spike's "
        "onset, its aftermath); "
        "chance is the share of the steps judged that a spike follows within L steps, the "
        "precision of alarms raised at random; a spike is warned where a crossing came in "
        "the L steps before its onset."
    )
    lines = ["## Early warning", "", intro, "", report.warning_line, ""]
    header = ["lead", "alarms", "false alarms", "precision (95%)", "chance", "spikes warned"]
    for name, counts in report.warnings.items():
        rows = []
        for c in counts:
            lo, hi = wilson(c.true_alarms, c.alarms)
            precision = f"{c.precision:.2f} ({lo:.2f}-{hi:.2f})" if c.alarms else "-"
            rows.append([c.lead, c.alarms, c.alarms - c.true_alarms, precision, c.chance])
            rows[-1].append(f"{c.warned} of {c.spikes}")
        lines += [f"**{name}**", "", *table(header, rows), ""]
    return lines


def _sweep_section(config: StudyConfig, report: StudyReport) -> list[str]:
    if not report.sweep:
        return []
    sweep = config.sweep
    lrs = (
        f"{sweep.peak_lrs} as --sweep.peak_lrs gives them"
        if sweep.peak_lrs is not None
        else f"the model's own {config.own_lr():.3g} times {sweep.factors}"
    )
    intro = (
        f"From scratch at each peak LR ({sweep.lr_arg}: {lrs}), {sweep.seeds} seed(s) a point, "
        f"{sweep.steps or config.steps} steps; the loss at initialization and at the end: "
        f"{report.sweep[0]['measure']}. LR sensitivity (Wortsman et al., 2023): the mean "
        "over the LRs of min(final loss, initial loss) - the best final loss (docs/study.md)."
    )
    header = ["peak LR", "variant", "seeds", "initial loss", "final loss", "runs spiked"]
    keys = ("seeds", "initial_loss", "final_loss", "spiked")
    rows = [
        [f"{p['peak_lr']:.3g}", "yes" if p["variant"] else "no", *(p[k] for k in keys)]
        for p in report.sweep
    ]
    lines = ["## LR sensitivity (Wortsman et al., 2023)", "", intro, "", *table(header, rows)]
    return [*lines, "", *(f"- {line}" for line in report.sweep_lines), ""]


def write_report(config: StudyConfig, report: StudyReport) -> list[Path]:
    """``report.md``, ``findings.csv`` and ``cells.csv`` in the log root; returns them."""
    root = config.log_root
    paths = [root / "report.md", root / "findings.csv", root / "cells.csv", root / "sweep.csv"]
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
    with paths[3].open("w", newline="") as handle:
        columns = ["peak_lr", "variant", "seeds", "initial_loss", "final_loss", "measure"]
        columns.append("spiked")
        points_writer = csv.DictWriter(handle, columns)
        points_writer.writeheader()
        points_writer.writerows(report.sweep)
    return paths
