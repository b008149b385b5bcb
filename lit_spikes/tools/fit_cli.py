"""``lit-spikes fit`` and ``validate``: the LightningCLI for any LightningModule and
LightningDataModule, TinyGPTModule and StepDataModule by default (``lit_spikes.tools.cli``
dispatches to it, importing it only then: Lightning and torch take seconds to import,
the top-level help and the other commands need neither).

``lit-spikes fit`` takes ``--model CLASS_PATH``, ``--data CLASS_PATH`` (LightningCLI's
subclass mode: their arguments as ``--model.init_args.*`` or ``--model.*``),
``--trainer.*``, ``--config FILE`` and ``--ckpt_path PATH`` as any LightningCLI does, plus
``--checkpoint_every N`` (``step=<k>.ckpt`` every N steps, all kept), and what a user's
module gets as the demo's has it (``fit_defaults``: ExactResume, seed, threads, its run
rebuilt from config.yaml). The defaults reproduce the seed's setup (4 layers, peak LR
0.1, batch 16, 400 steps). What is TinyGPT's alone (its settings and the data's from a
checkpoint, its setup checks, the schedule's length as max_steps, epochs of its text)
applies only when the model or the data is the project's own.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_spikes.callbacks.exact_resume import clipping_from_checkpoint
from lit_spikes.callbacks.preemption import PreemptionCheckpoint
from lit_spikes.callbacks.run_lock import RunDirectoryBusy, RunDirectoryLock
from lit_spikes.checkpoints import (
    CheckpointError,
    CheckpointWriteError,
    load_checkpoint,
    newest_valid_checkpoint,
)
from lit_spikes.shared.plain import flat_config, plain_config
from lit_spikes.shared.tb import RunLogger
from lit_spikes.shared.training import (
    CHECKPOINT_DIRNAME,
    claim_run_directory,
    standard_run,
)
from lit_spikes.tool_facts import facts_of
from lit_spikes.tools import run_record
from lit_spikes.tools.class_paths import first_problem, help_classes
from lit_spikes.tools.cli_parsing import (
    DATA_KEYS,
    MODEL_KEYS,
    HelpFormatter,
    LitSpikesParser,
    arrange_help,
    first_cause,
    is_own,
    launched_rank,
    quiet_lightning_notes,
    set_merged_defaults,
    yaml_nonfinite,
)
from lit_spikes.tools.commands import DESCRIPTION
from lit_spikes.tools.defaults import DEMO_DATA, DEMO_MODEL
from lit_spikes.tools.fit_defaults import (
    add_fit_options,
    add_seed_option,
    data_given,
    data_problem,
    foreign_checkpoint,
    record_problem,
    recorded_run_config,
    resolve_module_defaults,
    stated_run_steps,
    training_callbacks,
)
from lit_spikes.tools.fit_own_data import (
    check_accumulation,
    check_run_of,
)
from lit_spikes.tools.fit_plan import (
    ResumePlan,
    already_finished,
    callbacks_once,
    ckpt_keyword_problem,
    config_problem,
    history_problem,
    recorded_classes,
    run_files,
    run_length,
    weights_problem,
)
from lit_spikes.tools.fit_start import DirectoryState, FitStart, fit_or_restore, start_anew
from lit_spikes.tools.resume_callbacks import entries_to_resume, keys_of
from lit_spikes.tools.run_record import RECORD_NAME, RecordError, announce, record_path

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "max_steps": -1,  # TinyGPT: where its schedule (--model.optim.max_steps) ends; else none
    "log_every_n_steps": 1,
    "val_check_interval": 100,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "default_root_dir": "runs/fit",
}


RESUMABLE_CHANGES = ("num_threads", "flush_denormal")
"""Model settings a resume may take from the command line rather than the checkpoint
(the module warns that the run is then not guaranteed bit-exact)."""


CLASS_BASES = {"model": LightningModule, "data": LightningDataModule}
"""What ``--model`` and ``--data`` name a subclass of."""


class LitSpikesCLI(LightningCLI):
    """LightningCLI with the project's defaults and the ``--checkpoint_every`` option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.plan = ResumePlan()  # a new run, until --ckpt_path says otherwise
        self.before: DirectoryState | None = None  # the run directory before fit wrote
        self.start = FitStart()  # whether the fit went past its start
        self._data_recorded = False  # the run's record named the data
        self.command_line: Any = None  # parsed again, on a checkpoint's settings
        given = kwargs.get("args")  # as typed: its --help lists the --model class's options
        self.argv = [str(a) for a in (sys.argv[1:] if given is None else given)]
        super().__init__(*args, **kwargs)

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        # TinyGPTModule has no test or predict step: those would only fail inside Lightning.
        return {
            name: skip
            for name, skip in LightningCLI.subcommands().items()
            if name in ("fit", "validate")
        }

    @override
    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # LightningCLI's less the Trainer's, which setup_parser adds once the parser is
        # complete: the help lists the module, the data and --ckpt_path before Lightning's
        # 80 Trainer options (argparse orders sections as they are added).
        parser.add_lightning_class_args(LightningModule, "model", subclass_mode=True)
        # not required: a module may bring its own dataloaders (--data null)
        parser.add_lightning_class_args(
            LightningDataModule, "data", subclass_mode=True, required=False
        )

    @override
    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        add_seed_option(parser)  # a default that depends on the module (fit_defaults)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Subclass mode with the project's classes as defaults: their options keep their
        # short spelling (--model.gpt.n_layer), another class is one --model away.
        parser.set_defaults(
            {"model": {"class_path": DEMO_MODEL}, "data": {"class_path": DEMO_DATA}}
        )
        parser.add_argument(
            "--checkpoint_every",
            type=int,
            default=50,
            help="Write <trainer.default_root_dir>/checkpoints/step=<k>.ckpt every N steps, "
            "keeping all of them (0: no checkpoints).",
        )
        add_fit_options(parser)

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit" and self.plan.step == run_length(config):
            already_finished(config, self.plan.step)  # a requeue: exit 0 (elsewhere: refused)
        problem = config_problem(config, self.subcommand, self.plan.step)
        if problem is not None:
            self.parser.error(problem)
        if stated_run_steps(config["model"]) is not None:
            # The run ends where the module says (TinyGPT: its schedule) unless told otherwise
            config["trainer"]["max_steps"] = run_length(config)
        if config["num_threads"] is not None:  # a user's module (the demo's sets its own)
            torch.set_num_threads(config["num_threads"])

    @override
    def instantiate_classes(self) -> None:
        # A config that parses but does not validate (a dataclass's or a callback's own
        # check) is bad input too: report it as such, before anything runs or is written.
        try:
            super().instantiate_classes()
            # What would fail at the first step, after files were written: now, instead.
            stage = self.subcommand or "fit"
            check_run_of(stage, self.model, self.datamodule, self.trainer, self.plan.checkpoint)
            if self.subcommand == "fit":
                accumulate = self.trainer.accumulate_grad_batches
                check_accumulation(self.model, self.datamodule, accumulate)
        except (ValueError, TypeError) as error:
            self.parser.error(f"invalid configuration: {first_cause(error)}")
        problem = weights_problem(self.model, self.plan.checkpoint, self.plan.path or "")
        if self.subcommand == "fit" and problem is not None:
            self.parser.error(problem)
        self._check_recorded_callbacks()
        for callback in getattr(self.trainer, "callbacks", []):
            if isinstance(callback, RunDirectoryLock):
                # Before fit: Lightning's logger writes its first file before any setup hook.
                first = launched_rank() == 0  # the rank that writes the run's files
                self.before = DirectoryState.of(callback.directory) if first else None
                claim_run_directory(callback, self.trainer)
                if self.plan.restart and first:
                    start_anew(callback.directory, self.before)

    @override
    def after_instantiate_classes(self) -> None:
        # A requeue into the run's own directory rewrites its record as it was: the run
        # continues the recorded one, so the record keeps that run's ckpt_path (null for
        # a run started afresh), not the file this requeue happened to resume.
        config = self.config[self.subcommand] if self.subcommand else self.config
        path, root = config.get("ckpt_path"), Path(config["trainer"]["default_root_dir"])
        if (
            self.subcommand == "fit"
            and path
            and record_path(Path(path)) == root.resolve() / RECORD_NAME
        ):
            config["ckpt_path"] = run_record.read_record(root / RECORD_NAME).get("ckpt_path")

    def fit(self, **kwargs: Any) -> None:
        """The subcommand (LightningCLI runs a method of the subcommand's name where the
        CLI has one): ``Trainer.fit``, whose failure before its first step leaves the run
        directory as it was."""
        fit_or_restore(self.trainer, self.before, self.start, **kwargs)

    @override
    def _parse_ckpt_path(self) -> None:
        # Before LightningCLI reads the checkpoint's hyperparameters with a bare
        # torch.load: resolve "latest", and turn a broken file into a clear error.
        self.plan = self._plan_resume()
        # The module is known now: its seed and threads, before LightningCLI seeds
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        problem = resolve_module_defaults(config, fitting=subcommand == "fit")
        if problem is not None:
            self.parser.error(problem)
        self._no_demo_data_for_a_users_module(config, subcommand or "fit")

    def _no_demo_data_for_a_users_module(self, config: Any, subcommand: str) -> None:
        """A module of the user's with no ``--data`` (none on the command line, in a
        ``--config`` or the run's record) got the demo's text as its default data, and
        crashed in its own ``training_step``: its own dataloaders instead, or a usage
        error before anything is written."""
        data = config["data"]
        if (
            is_own(config["model"], DEMO_MODEL)
            or self._data_recorded
            or data is None
            or data.get("class_path") != DEMO_DATA
            or data_given(self.command_line, config.get("config") or [], subcommand)
        ):
            return
        problem = data_problem(config["model"]["class_path"], subcommand)
        if problem is not None:
            self.parser.error(problem)
        config["data"] = None  # the module's own dataloaders, as --data null

    def _plan_resume(self) -> ResumePlan:
        """The run's ``--ckpt_path`` resolved and its file loaded, the command line parsed
        again on the checkpoint's (or the run's config.yaml's) settings."""
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand or "", None)
        path = config.get("ckpt_path") if config is not None else None
        fitting = subcommand == "fit"
        if (problem := ckpt_keyword_problem(path)) is not None:
            self.parser.error(problem)
        latest, asked = path in ("latest", "last"), path
        root = Path(config["trainer"]["default_root_dir"]) if config is not None else Path()
        if latest:
            found: Path | None = None
            try:
                _, found, _ = newest_valid_checkpoint(
                    root / CHECKPOINT_DIRNAME, refuse_nonfinite=False
                )
            except FileNotFoundError as error:
                # Lightning's "last": set and forget, from a job's first start on (a
                # requeued job's command line is the first one's): a new run, below
                if not (path == "last" and fitting and not run_files(root)[0]):
                    self.parser.error(f"--ckpt_path {path}: {error}")
            config["ckpt_path"] = path = None if found is None else str(found)
        if not path:
            restart = fitting and self._check_history(root, None, None, asked == "last")
            if fitting and asked == "last":  # a user's run killed before its first checkpoint
                self._check_record(root / RECORD_NAME)
                self._from_record("fit", root / RECORD_NAME, None)
            return ResumePlan(restart=restart)
        self._check_record(record_path(Path(path)))
        try:  # validate and test need only the weights
            checkpoint = load_checkpoint(path, weights_enough=not fitting)
        except CheckpointError as error:
            self.parser.error(f"--ckpt_path: {error}")
        step = int(checkpoint["global_step"])
        if not fitting:
            self._resume_with_checkpoint_settings(path, checkpoint, [])
            return ResumePlan(path, step)
        if not latest:
            self._check_history(root, path, step)
        # fit adds an ExactResume itself (the project's module returns its own): one
        # rebuilt from the file would be listed in config.yaml, which the run's did not
        provided = {"ExactResume"} if config["exact_resume"] else set()
        callbacks, record = entries_to_resume(Path(path), checkpoint, provided)
        self._resume_with_checkpoint_settings(path, checkpoint, callbacks)
        return ResumePlan(path, step, checkpoint, record, callbacks)

    def _check_record(self, record: Path | None) -> None:
        """The run's ``config.yaml`` (a file the command line did not name), checked before
        anything of it is used: a class path in it that is not what its entry takes is a
        usage error naming the entry and the file, before any is called; the one it reads
        is said in a line."""
        if record is None or not record.is_file():
            return
        try:
            run_record.read_record(record)
        except RecordError as error:
            self.parser.error(str(error))
        if launched_rank() == 0:
            announce(record)

    def _check_history(
        self, root: Path, path: str | None, step: int | None, restart: bool = False
    ) -> bool:
        """Refuses a fit that would mix two histories in ``root`` (``history_problem``);
        True where ``restart`` (``--ckpt_path last`` finding no checkpoint) is to remove
        the events of a run that wrote none: it has nothing to resume or protect (a job
        killed before its first checkpoint is requeued as it started)."""
        steps, events = run_files(root)
        if (steps or (path is None and events)) and launched_rank() == 0:
            # A run still training there is the first thing to say (exit 75, naming it),
            # not how to go on with its files. Asked by the first process only: under DDP
            # the others start while it holds the lock.
            probe = RunDirectoryLock(root)
            probe.acquire()
            probe.release()
        problem = history_problem(root, path, step, restart)
        if problem is not None:
            self.parser.error(problem)
        return restart and not steps and bool(events)

    @override
    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        subcommands = self.subcommands() if add_subcommands else {}
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        for parser in [self._subcommand_parser(name) for name in subcommands] or [self.parser]:
            parser.add_lightning_class_args(self.trainer_class, "trainer")
            parser.set_defaults(defaults)
        classes = help_classes(self.argv, CLASS_BASES, {"model": DEMO_MODEL, "data": DEMO_DATA})
        for subcommand in subcommands:  # complete now, the method's arguments included
            arrange_help(self._subcommand_parser(subcommand), subcommand, classes)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        problem = first_problem(self.argv, CLASS_BASES)
        if problem is not None:
            parser.error(problem)
        if args is None or isinstance(args, list):  # the command line, as LightningCLI's
            self.command_line = yaml_nonfinite(sys.argv[1:] if args is None else list(args))
            # A requeue's --model.* without --model CLASS: parsed against the recorded class
            try:
                early = recorded_classes(self.command_line, TRAINER_DEFAULTS["default_root_dir"])
            except RecordError as error:
                parser.error(str(error))
            if early is not None:
                self._subcommand_parser(self.command_line[0]).set_defaults(early)
            self.config = parser.parse_args(self.command_line)
            return
        self.command_line = args
        super().parse_arguments(parser, args)

    def _subcommand_parser(self, subcommand: str) -> LightningArgumentParser:
        # LightningCLI hands a subcommand's parser to no public method once it is complete
        # (add_arguments_to_parser sees it before the method's arguments): its accessor.
        return self._parser(subcommand)

    def _check_recorded_callbacks(self) -> None:
        """After instantiation: say which callbacks came from the checkpoint's record, and
        refuse a resume that would drop the state of one that cannot be rebuilt (a class
        of Lightning's or the user's, a RollbackRestore), unless the command line or a
        --config chose the callbacks itself (then Lightning's warning names them)."""
        record = self.plan.record
        if record is None:
            return
        present: set[str] = set()
        for callback in getattr(self.trainer, "callbacks", []):
            present |= keys_of(callback)
        given = self.config[self.subcommand]["trainer"].get("callbacks") or []
        given_paths = [getattr(entry, "class_path", entry) for entry in given]
        chosen = given_paths != [entry["class_path"] for entry in self.plan.callbacks]
        missing = [key for key in record.unrebuilt if key not in present]
        path = self.config[self.subcommand]["ckpt_path"]
        if missing and not chosen:
            self.parser.error(
                f"--ckpt_path {path} was written with callbacks that this resume lacks and "
                f"that lit-spikes cannot rebuild from the file: {'; '.join(missing)}. Their "
                "state would be dropped: give each with --trainer.callbacks+=<class> and the "
                "settings its key names (or a --config listing them), or resume from the "
                "run's own directory, whose config.yaml lists them"
            )
        used = [d for d, key in zip(record.described, record.keys, strict=True) if key in present]
        if used and launched_rank() == 0:
            print(
                f"lit-spikes: callbacks from the checkpoint's record (no config.yaml of its "
                f"run lists them): {'; '.join(used)}",
                file=sys.stderr,
            )

    def _resume_with_checkpoint_settings(
        self, path: str, checkpoint: dict[str, Any], callbacks: list[dict[str, Any]]
    ) -> None:
        """The command line parsed again with the checkpoint's model and data settings as
        the defaults: ``--ckpt_path`` alone resumes the same run, and whatever the command
        line or a ``--config`` file sets explicitly stays as given (LightningCLI itself
        puts the model's hyperparameters over everything, and leaves the data's alone).
        A model setting given that differs from the file is an error, except those a
        resume may change (``RESUMABLE_CHANGES``: the module warns); a data setting that
        differs is kept, and the data module warns. The checkpoint's gradient clipping is
        the default too (given otherwise, the module warns, unless clipping is added to a
        run that had none: the clipping remedy)."""
        subcommand = self.config["subcommand"]
        self._from_record(subcommand, record_path(Path(path)), path)
        saved: dict[str, Any] = {}
        problem = foreign_checkpoint(self.config[subcommand]["model"], checkpoint, path)
        if subcommand == "fit" and problem:  # else the module's refusal, files written
            self.parser.error(problem)
        if is_own(self.config[subcommand]["model"], DEMO_MODEL):  # another: as given
            hparams = plain_config(checkpoint.get("hyper_parameters", {}))
            saved |= {f"{MODEL_KEYS}{key}": value for key, value in flat_config(hparams).items()}
        # The demo's data keeps its settings in its state, under its class's name
        data = checkpoint.get(DEMO_DATA.rpartition(".")[2], {}).get("config")
        if data is not None and is_own(self.config[subcommand]["data"], DEMO_DATA):
            # (files from before hold only the data seed)
            saved |= {f"{DATA_KEYS}{key}": value for key, value in flat_config(data).items()}
        # A Trainer setting, kept for the same reason
        saved |= {f"trainer.{k}": v for k, v in clipping_from_checkpoint(checkpoint).items()}
        if callbacks:  # fit: the remedies, the detector
            saved["trainer.callbacks"] = callbacks
        set_merged_defaults(self._subcommand_parser(subcommand), saved)
        self.config = self.parser.parse_args(self.command_line)  # build_cli: a list or None
        config = self.config[subcommand]
        config["ckpt_path"] = path  # "latest" resolved
        callbacks_once(config)
        conflicts = []
        for key, value in saved.items():
            if not key.startswith(MODEL_KEYS) or key not in config:
                continue
            given, name = plain_config(config[key]), key.removeprefix(MODEL_KEYS)
            if given != value and name not in RESUMABLE_CHANGES:
                conflicts.append(f"--model.{name}={given!r} (the checkpoint's: {value!r})")
        if conflicts:
            self.parser.error(
                "--ckpt_path resumes the checkpoint's run with its own model settings, but "
                + "; ".join(conflicts)
                + " asks for others. Drop them to resume; start a new run to change them; "
                "to change the LR from the resume point on, add an LRScaler callback"
            )

    def _from_record(self, subcommand: str, record_file: Path | None, path: str | None) -> None:
        """The run's config.yaml (``record_file``; None: a file in no run's layout) as the
        defaults, the command line parsed on them; with no checkpoint (``path`` None: a
        run killed before its first file), its callbacks too."""
        recorded = run_record.read_record(record_file)
        record = recorded_run_config(recorded, with_callbacks=path is None)
        if record_file is not None and record:
            self._data_recorded = "data" in record
            self._subcommand_parser(subcommand).set_defaults(record)
            self.config = self.parser.parse_args(self.command_line)
            self.config[subcommand]["ckpt_path"] = path
            callbacks_once(self.config[subcommand])
            config = self.config[subcommand]
            root = Path(config["trainer"]["default_root_dir"]).resolve()
            if subcommand == "fit":  # validate may take any settings
                requeue = root == record_file.parent.resolve()
                problem = record_problem(record, config, record_file, requeue, recorded)
                if problem is not None:
                    self.parser.error(problem)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = config["trainer"]["default_root_dir"]
        section = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_config = {**section.get("trainer", {}), **kwargs}
        training = self.subcommand == "fit"  # validate trains nothing and saves nothing
        # validate: a run of its own beside the training's (its curves, its config.yaml
        # untouched), one per checkpoint; Lightning logs a validation at step 0
        checkpoint = config.get("ckpt_path")
        logger = RunLogger(
            save_dir=root,
            name="" if training else "validate",
            version="" if training else (Path(checkpoint).stem if checkpoint else "fresh"),
            purge_step=self.plan.step if training else None,
            hparams_metric=facts_of(self.model).val_metric,
        )
        configured = trainer_config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        parts = standard_run(
            trainer_config,
            root,
            checkpoint_every=config["checkpoint_every"] or None,
            given=configured,
            training=training,
            logger=logger,
        )
        own = [parts.lock] if parts.lock is not None else []  # taken in instantiate_classes
        added = [*own, *parts.callbacks]
        if training:
            added = [*training_callbacks(config, added, configured), self.start]
        # The public method's keyword arguments override the configured ones: the
        # configured callbacks, then the project's (Lightning appends its SaveConfigCallback)
        return super().instantiate_trainer(
            **{**parts.trainer_kwargs, "callbacks": [*configured, *added]}
        )


def run(args: list[str] | None = None) -> LitSpikesCLI | None:
    """``lit-spikes fit|validate ...`` (``lit_spikes.tools.cli.main`` without a command of its
    own); the CLI object for in-process callers (``args`` given), else None."""
    try:
        cli = build_cli(args)
    except RunDirectoryBusy as error:
        # Not a crash: a scheduler may retry later (EX_TEMPFAIL), once the other run ended.
        print(f"lit-spikes: error: {error}", file=sys.stderr)
        raise SystemExit(os.EX_TEMPFAIL) from None
    except CheckpointWriteError as error:
        # A full disk is no bug to debug: one line with the file, the space left, the way on.
        print(f"lit-spikes: error: {error}", file=sys.stderr)
        raise SystemExit(os.EX_IOERR) from None
    except SIGTERMException:
        # Lightning ends a run that got SIGTERM with SystemExit(None), status 0 (with
        # --checkpoint_every 0 there is no PreemptionCheckpoint to stop it first): a job
        # scheduler must see that it did not finish.
        raise SystemExit(128 + signal.SIGTERM) from None
    preempted = [
        cb
        for cb in getattr(cli.trainer, "callbacks", [])
        if isinstance(cb, PreemptionCheckpoint) and cb.saved_path is not None
    ]
    if preempted and getattr(rank_zero_only, "rank", 0) == 0:  # once, not once per rank
        print(
            f"lit-spikes: resume with the same command and --ckpt_path "
            f"{preempted[0].saved_path} (or --ckpt_path latest)",
            file=sys.stderr,
        )
    if preempted and args is None:  # in-process callers (tests) get the CLI object back
        raise SystemExit(128 + int(preempted[0].received or 0))
    return cli if args is not None else None


def build_cli(args: list[str] | None = None, run: bool = True) -> LitSpikesCLI:
    """The project's LightningCLI; ``run=False`` parses and instantiates only."""
    quiet_lightning_notes()
    return LitSpikesCLI(
        LightningModule,  # any: TinyGPTModule and StepDataModule are the defaults
        None,  # any LightningDataModule, or --data null: the module's own dataloaders
        subclass_mode_model=True,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=False,
        auto_configure_optimizers=False,
        load_from_checkpoint_support=False,
        parser_class=LitSpikesParser,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={
            "prog": "lit-spikes",
            "description": DESCRIPTION,
            "formatter_class": HelpFormatter,
        }
        if run
        else None,
        args=args,
        run=run,
    )
