"""``lit-spikes study --model X --data Y``: a study of any module over many seeds, as a job
a rerun continues; the report in the log root."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl

from lit_spikes.tools.command_line import (
    CommandParser,
    add_class_path,
    command_parser,
    parse_config,
)
from lit_spikes.tools.recover.config import default_data, default_model
from lit_spikes.tools.study.config import QUICK, StudyConfig
from lit_spikes.tools.study.jobs import (
    AnotherStudy,
    StudyInterrupted,
    StudyRun,
    check_log_root,
    done_cells,
    run_study,
)

PROG = "lit-spikes study"
DESCRIPTION = (
    "How often a recipe spikes, whether its resume is exact, which remedy helps: per seed "
    "the reference run, the exact resume and each rung of the remedy ladder from the "
    "checkpoint before its first spike, and diagnose on each flagged spike; each finding "
    "as k of n with a 95%% Wilson interval. --model/--data: any LightningModule and "
    "LightningDataModule by class path, as lit-spikes fit takes them. Rerun the same "
    "command to continue a stopped study. With --sweep.lr_arg model.<name>: an LR sweep "
    "over two decades with and without --sweep.variant, and each one's LR sensitivity "
    "(Wortsman et al., 2023). --quick: two seeds, three LRs."
)


def build_parser() -> CommandParser:
    parser = command_parser(PROG, DESCRIPTION, StudyConfig, skip={"model", "data"})
    add_class_path(parser, "model", pl.LightningModule, default_model())
    add_class_path(parser, "data", pl.LightningDataModule, default_data())
    parser.add_argument("--quick", action="store_true", help="two seeds (" + str(QUICK) + ")")
    parser.add_argument(
        "--report_only",
        action="store_true",
        help="write the report from the cells done so far and compute nothing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> StudyRun:
    """Run the study; usage errors (a bad option or value, a log root of another study,
    one that cannot be written) exit 2 before any cell runs; a signal exits 128 + its
    number, the cells done kept."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "--quick" in args:
        parser.set_defaults(QUICK)  # the preset first: other options override it
    config, parsed = parse_config(parser, StudyConfig, args)
    from lit_spikes.shared.training import unwritable_directory
    from lit_spikes.tools.study.cells import plan

    why = unwritable_directory(Path(config.log_root))
    if why is not None:
        parser.error(f"--log_root {config.log_root} {why}")
    study = plan(config)
    try:
        check_log_root(study)
    except AnotherStudy as error:
        parser.error(str(error))
    if parsed.report_only:
        run = done_cells(study)
    else:
        from lit_spikes.shared.cores import usable_cores

        try:
            run = run_study(study, config.workers or usable_cores())
        except StudyInterrupted as stop:
            print(
                f"{PROG}: stopped by signal {stop.signum}; run it again to continue",
                file=sys.stderr,
            )
            raise SystemExit(128 + stop.signum) from None
    finish(config, run)
    return run


def finish(config: StudyConfig, run: StudyRun) -> None:
    """The report and its CSVs from every cell's result; prints the findings."""
    from lit_spikes.tools.study.figures import write_figures
    from lit_spikes.tools.study.report import build_report, write_report

    report = build_report(config, run.results, run.wall_s)
    paths = write_report(config, report)
    directories = [config.log_root] + ([Path(config.figures_dir)] if config.figures_dir else [])
    rungs = [*config.rung_names, *config.variant_cells]
    higher = config.facts.val_mode == "max"
    paths += write_figures(report, rungs, higher, report.variant, directories)
    from lit_spikes.shared.tb import write_summary

    write_summary(config.log_root, {"study/report": report.markdown})  # TensorBoard's TEXT
    for finding in [f for f in report.findings if f.n]:
        print(f"- {finding.sentence()}")
    print(f"- early warning: {report.warning_line}")
    for line in report.sweep_lines:
        print(f"- {line}")
    if run.computed:
        print(
            f"{len(run.results)} cells ({len(run.computed)} computed in "
            f"{run.wall_s / 60:.1f} min, {run.workers} workers)"
        )
    print(f"report: {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
