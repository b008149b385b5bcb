"""``lit-spikes study``: the demos' experiment over many seeds, the LR sweep and the
early-warning leads, as a job a rerun continues; the report in the log root."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from lit_spikes.demo.study.config import QUICK, StudyConfig
from lit_spikes.tools import command_parser, parse_config
from lit_spikes.tools.study import (
    AnotherStudy,
    StudyInterrupted,
    StudyRun,
    check_log_root,
    done_cells,
    run_study,
)

PROG = "lit-spikes study"
DESCRIPTION = (
    "The demos' experiment over many seeds: per seed the reference run, its spikes, the "
    "resumes and remedies from the checkpoint before its spike and diagnose; an LR sweep "
    "with and without QK-norm; each finding's frequency with a 95% Wilson interval. "
    "Rerun the same command to continue a stopped study. --quick: the small preset. "
    "With --model and --data (class paths, as lit-spikes fit takes them): the study of any "
    "module (lit-spikes study --model X --data Y --help lists its options)."
)


def _flat(values: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def main(argv: Sequence[str] | None = None) -> StudyRun:
    """Run the study; usage errors (a bad option or value, a log root of another study,
    one that cannot be written) exit 2 before any cell runs; a signal exits 128 + its
    number, the cells done kept."""
    args = list(sys.argv[1:] if argv is None else argv)
    if _of_a_module(args):
        # A study of any module, the demo's by its class path too: the tools' own command
        from lit_spikes.tools.study import main as study_of_module

        return study_of_module(args)
    parser = command_parser(PROG, DESCRIPTION, StudyConfig)
    parser.add_argument("--quick", action="store_true", help="the small preset (CI's)")
    parser.add_argument(
        "--report_only",
        action="store_true",
        help="write the report from the cells done so far and compute nothing",
    )
    if "--quick" in args:
        parser.set_defaults(_flat(QUICK))  # the preset first: other options override it
    config, parsed = parse_config(parser, StudyConfig, args)
    from lit_spikes.shared.training import unwritable_directory

    why = unwritable_directory(Path(config.log_root))
    if why is not None:
        parser.error(f"--log_root {config.log_root} {why}")
    from lit_spikes.demo.study.cells import plan

    study = plan(config)
    try:
        check_log_root(study)
    except AnotherStudy as error:
        parser.error(str(error))
    if parsed.report_only:
        run = done_cells(study)
        finish(config, run)
        return run
    from lit_spikes.shared.cores import usable_cores

    workers = config.workers or usable_cores()
    try:
        run = run_study(study, workers)
    except StudyInterrupted as stop:
        print(f"{PROG}: stopped by signal {stop.signum}; run it again to continue", file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None
    finish(config, run)
    return run


def _of_a_module(args: Sequence[str]) -> bool:
    """Whether the command names a module (``--model``/``--data``, or a ``--config`` file
    with a ``model`` or ``data``, as configs/study/demo.yaml): the study of any module."""
    if any(a in ("--model", "--data") or a.startswith(("--model=", "--data=")) for a in args):
        return True
    files = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    files += [a.partition("=")[2] for a in args if a.startswith("--config=")]
    for name in files:
        try:
            loaded = yaml.safe_load(Path(name).read_text())
        except (OSError, yaml.YAMLError):
            continue  # the parser below says what is wrong with it
        if isinstance(loaded, dict) and ({"model", "data"} & set(loaded)):
            return True
    return False


def finish(config: StudyConfig, run: StudyRun) -> None:
    """The report, its CSVs and the figures from every cell's result; prints the findings."""
    from lit_spikes.demo.study.figures import write_figures
    from lit_spikes.demo.study.report import build_report, write_report

    report = build_report(config, run.results, run.wall_s)
    paths = write_report(config, report, run.results)
    directories = [config.log_root] + ([Path(config.figures_dir)] if config.figures_dir else [])
    sweep = [r for r in run.results.values() if r["kind"] == "sweep"]
    paths += write_figures(report.seeds, sweep, directories)
    for finding in [f for f in report.findings if f.n]:
        print(f"- {finding.sentence()}")
    for line in report.sweep_lines:
        print(f"- sweep: {line}")
    cells = len(run.results)
    if run.computed:
        rate = len(run.computed) / (run.wall_s / 60)
        print(
            f"{cells} cells ({len(run.computed)} computed in {run.wall_s / 60:.1f} min, "
            f"{rate:.1f} cells/min, {run.workers} workers)"
        )
    print(f"report: {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
