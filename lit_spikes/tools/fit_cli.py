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

import math
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_spikes.callbacks.batch_skipper import BatchSkipper
from lit_spikes.callbacks.exact_resume import clipping_from_checkpoint
from lit_spikes.callbacks.preemption import PreemptionCheckpoint
from lit_spikes.callbacks.run_lock import RunDirectoryBusy, RunDirectoryLock
from lit_spikes.checkpoints import (
    CheckpointError,
    CheckpointWriteError,
    checkpoint_files_if_any,
    load_checkpoint,
    newest_valid_checkpoint,
)
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
    trainer_setting_problem,
    yaml_nonfinite,
)
from lit_spikes.tools.commands import DESCRIPTION
from lit_spikes.tools.defaults import (
    DEMO_DATA,
    DEMO_MODEL,
    StepDataModule,
    TinyGPTModule,
    check_shard,
    check_training_setup,
    flat_config,
    plain_config,
)
from lit_spikes.tools.fit_defaults import (
    add_fit_options,
    add_seed_option,
    foreign_checkpoint,
    read_record,
    resolve_module_defaults,
    training_callbacks,
    user_run_config,
)
from lit_spikes.tools.resume_callbacks import entries_to_resume, keys_of
from lit_spikes.tools.tb import RunLogger
from lit_spikes.tools.training import (
    CHECKPOINT_DIRNAME,
    claim_run_directory,
    standard_run,
    unwritable_directory,
)

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


class LitSpikesCLI(LightningCLI):
    """LightningCLI with the project's defaults and the ``--checkpoint_every`` option."""

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
    def _prepare_subcommand_parser(
        self, klass: type, subcommand: str, **kwargs: Any
    ) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        arrange_help(parser, subcommand, {"model": TinyGPTModule, "data": StepDataModule})
        return parser

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
        every = config["checkpoint_every"]
        if every < 0:
            self.parser.error(f"--checkpoint_every={every} must be >= 0 (0 turns checkpoints off)")
        steps = config["trainer"]["max_steps"]
        if steps is not None and (steps == 0 or steps < -1):
            self.parser.error(
                f"--trainer.max_steps={steps} must be positive, or -1 to end with the schedule"
            )
        if (steps is None or steps == -1) and is_own(config["model"], TinyGPTModule):
            # The run ends where its schedule ends unless told to stop earlier (or later).
            steps = config["model"]["init_args"]["optim"].max_steps
            config["trainer"]["max_steps"] = steps
        steps = -1 if steps is None else steps  # another module: Lightning's -1, no limit
        resume = getattr(self, "_resume_step", None)
        if self.subcommand == "fit" and resume is not None and 0 < steps <= resume:
            self.parser.error(
                f"--ckpt_path is at step {resume}, not before --trainer.max_steps={steps}: "
                "there is nothing left to train; raise max_steps or pick an earlier checkpoint"
            )
        no_checkpoints = config["trainer"]["enable_checkpointing"] is False
        if self.subcommand == "fit" and every and no_checkpoints:
            self.parser.error(
                "--trainer.enable_checkpointing=false: lit-spikes writes its checkpoints as "
                f"--checkpoint_every says ({every}); give --checkpoint_every 0 for none"
            )
        root = Path(config["trainer"]["default_root_dir"])
        problem = unwritable_directory(root)
        if problem is not None:
            self.parser.error(
                f"--trainer.default_root_dir={root} {problem}: choose a writable directory"
            )
        checkpoints = root / CHECKPOINT_DIRNAME
        problem = unwritable_directory(checkpoints) if self.subcommand == "fit" and every else None
        if problem is not None:  # a read-only checkpoints/ left by another user or a copy
            self.parser.error(
                f"{checkpoints} {problem}: the run could not write its checkpoints there; "
                "make it writable or choose another --trainer.default_root_dir"
            )
        devices, nodes = config["trainer"].get("devices"), config["trainer"].get("num_nodes")
        devices = int(devices) if str(devices).isdigit() else None  # "3" as parsed
        own_data = is_own(config["data"], StepDataModule)
        if own_data and devices and isinstance(nodes, int) and nodes > 0:
            # Else each of the processes Lightning starts fails in setup with its traceback
            try:
                batch = config["data"]["init_args"]["config"]["batch_size"]
                check_shard(int(batch), 0, devices * nodes)
            except ValueError as error:
                self.parser.error(str(error))
        problem = trainer_setting_problem(config["trainer"])
        if problem is not None:
            self.parser.error(problem)
        if config["num_threads"] is not None:  # a user's module (the demo's sets its own)
            torch.set_num_threads(config["num_threads"])

    @override
    def instantiate_classes(self) -> None:
        # A config that parses but does not validate (a dataclass's or a callback's own
        # check) is bad input too: report it as such, before anything runs or is written.
        try:
            super().instantiate_classes()
            if isinstance(self.model, TinyGPTModule):
                # What would fail at the first step, after files were written: now, instead.
                own_data = isinstance(self.datamodule, StepDataModule)
                check_training_setup(
                    self.model.model_config,
                    self.datamodule if own_data else None,
                    self.trainer.accumulate_grad_batches,
                    getattr(self.trainer, "overfit_batches", 0),
                )
            self._check_skip_at_resume()
        except (ValueError, TypeError) as error:
            self.parser.error(f"invalid configuration: {first_cause(error)}")
        self._check_recorded_callbacks()
        self._epochs_of_the_stream()
        if isinstance(self.model, TinyGPTModule) and self.model.example_input_array is None:
            # Lightning's model summary counts FLOPs on an example input: without one its
            # table said FLOPs 0. (A forward in eval mode, no grad: no RNG, no state.)
            rows = self.model.model_config.block_size
            self.model.example_input_array = torch.zeros((1, rows), dtype=torch.long)
        for callback in getattr(self.trainer, "callbacks", []):
            if isinstance(callback, RunDirectoryLock):
                # Before fit: Lightning's logger writes its first file before any setup hook.
                claim_run_directory(callback, self.trainer)
                if getattr(self, "_restart_events", False) and launched_rank() == 0:
                    self._start_anew(callback.directory)

    def _start_anew(self, root: Path) -> None:
        """``--ckpt_path last`` in a directory whose run wrote no checkpoint: that run's
        TensorBoard events go (the new run logs the same steps from 0), said in a line."""
        events = sorted(root.glob("events.out.tfevents.*"))
        for event_file in events:
            event_file.unlink()
        print(
            f"lit-spikes: --ckpt_path last: {root} has no checkpoint to resume, only the "
            f"TensorBoard events of a run that wrote none ({len(events)} file(s), removed): "
            "starting it anew from step 0",
            file=sys.stderr,
        )

    def _check_skip_at_resume(self) -> None:
        """A skip position the checkpoint's run already passed is refused by the data
        module's ``load_state_dict``, but only once the fit restores it, after config.yaml
        and the events were written: the same check now (``ValueError``)."""
        checkpoint = getattr(self, "_resume_checkpoint", None)
        state = None if checkpoint is None else checkpoint.get(StepDataModule.__qualname__)
        if self.subcommand != "fit" or not state or not isinstance(self.datamodule, StepDataModule):
            return
        probe = StepDataModule(self.datamodule.config)
        for callback in getattr(
            self.trainer, "callbacks", []
        ):  # a BatchSkipper adds its positions in setup
            if isinstance(callback, BatchSkipper):
                probe.add_skip(callback.skip)
        with warnings.catch_warnings():  # its seed and config warnings come at the real load
            warnings.simplefilter("ignore")
            probe.load_state_dict(state)

    def _epochs_of_the_stream(self) -> None:
        """``--trainer.max_epochs`` honoured as Lightning does (the run ends at the first of
        max_steps and max_epochs): the step stream is endless, so an epoch here is as many
        steps as it takes to draw the training text's number of tokens, unless an int
        ``--trainer.limit_train_batches`` sets its length."""
        if self.subcommand != "fit" or not isinstance(self.datamodule, StepDataModule):
            return
        epochs = self.config[self.subcommand]["trainer"].get("max_epochs")
        trainer = self.trainer
        if epochs is None or epochs < 1 or isinstance(trainer.limit_train_batches, int):
            return
        config = self.datamodule.config
        tokens = int(self.datamodule.train_tokens.numel())
        steps = max(1, math.ceil(tokens / (config.batch_size * config.block_size)))
        trainer.limit_train_batches = steps  # a Trainer attribute its fit loop reads
        if launched_rank() == 0:
            print(
                f"lit-spikes: --trainer.max_epochs {epochs}: an epoch here is {steps} steps "
                f"(the training text's {tokens} tokens / batch {config.batch_size} x "
                f"{config.block_size}); the run ends at step "
                f"{min(trainer.max_steps, epochs * steps)}, the first of max_steps and "
                "max_epochs",
                file=sys.stderr,
            )

    @override
    def _parse_ckpt_path(self) -> None:
        # Before LightningCLI reads the checkpoint's hyperparameters with a bare
        # torch.load: resolve "latest", and turn a broken file into a clear error.
        self._resolve_ckpt_path()
        # The module is known now: its seed and threads, before LightningCLI seeds
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        problem = resolve_module_defaults(config, fitting=subcommand == "fit")
        if problem is not None:
            self.parser.error(problem)

    def _resolve_ckpt_path(self) -> None:
        config = self.config.get(self.config.get("subcommand") or "", None)
        path = config.get("ckpt_path") if config is not None else None
        if path in ("best", "hpc", "registry"):
            self.parser.error(
                f"--ckpt_path {path}: Lightning's keyword for a file lit-spikes does not write "
                "(its checkpoints are step=<k>.ckpt); use --ckpt_path latest for the newest, "
                "or last (the newest, or a new run where there is none yet)"
            )
        latest, asked = path in ("latest", "last"), path
        if latest:
            directory = Path(config["trainer"]["default_root_dir"]) / CHECKPOINT_DIRNAME
            found: Path | None = None
            try:
                _, found, _ = newest_valid_checkpoint(directory, refuse_nonfinite=False)
            except FileNotFoundError as error:
                fitting = self.config.get("subcommand") == "fit"
                # Lightning's "last": set and forget, from a job's first start on (a
                # requeued job's command line is the first one's): a new run, below
                if not (path == "last" and fitting and not checkpoint_files_if_any(directory)):
                    self.parser.error(f"--ckpt_path {path}: {error}")
            config["ckpt_path"] = path = None if found is None else str(found)
        if not path:
            if self.config.get("subcommand") == "fit":
                self._refuse_mixed_histories(config, None, None, restart=asked == "last")
                if asked == "last":  # a user's run killed before its first checkpoint
                    self._from_record("fit", Path(config["trainer"]["default_root_dir"]), None)
            return
        try:  # validate and test need only the weights
            checkpoint = load_checkpoint(
                path, weights_enough=self.config.get("subcommand") != "fit"
            )
        except CheckpointError as error:
            self.parser.error(f"--ckpt_path: {error}")
        self._resume_step = int(checkpoint["global_step"])
        if self.config.get("subcommand") == "fit":
            self._resume_checkpoint = checkpoint  # its data state and callbacks, checked
        if self.config.get("subcommand") == "fit" and not latest:
            self._refuse_mixed_histories(config, path, self._resume_step)
        self._resume_with_checkpoint_settings(path, checkpoint)

    def _refuse_mixed_histories(
        self, config: Any, path: str | None, step: int | None, restart: bool = False
    ) -> None:
        """A fit whose checkpoint directory holds another history's files would write its
        own beside them (``step=<k>-v1.ckpt``, a second TensorBoard curve over the same
        steps), and ``--ckpt_path latest`` would later find the other: refused, unless it
        resumes that directory's run from its newest file (``latest`` always does).
        ``restart`` (``--ckpt_path last`` finding no checkpoint): a run that wrote none
        has nothing to resume or protect, its events are removed once the directory is
        this run's (a job killed before its first checkpoint is requeued as it started)."""
        root = config["trainer"]["default_root_dir"]
        directory = Path(root) / CHECKPOINT_DIRNAME
        steps = [s for s, _ in checkpoint_files_if_any(directory)]
        events = sorted(Path(root).glob("events.out.tfevents.*"))
        if not steps and not (path is None and events):
            return
        # A run still training there is the first thing to say (exit 75, naming it), not
        # how to go on with its files, also before its first checkpoint. Asked by the
        # first process only: under DDP the others start while it holds the lock.
        if launched_rank() == 0:
            probe = RunDirectoryLock(root)
            probe.acquire()
            probe.release()
        if not steps:  # a run of no checkpoints (--checkpoint_every 0), or cut short
            self._restart_events = restart
            if not restart:
                self.parser.error(
                    f"{root} holds the TensorBoard events of a run ({events[0].name}"
                    f"{' and more' if len(events) > 1 else ''}): a new run there would log "
                    "the same steps again into its curves; choose another "
                    "--trainer.default_root_dir (or start that run anew, its events "
                    "removed, with --ckpt_path last)"
                )
            return
        held = f"{directory} holds the checkpoints of a run (step={steps[0]} to step={steps[-1]})"
        elsewhere = "or choose another --trainer.default_root_dir"
        if path is None:
            self.parser.error(
                f"{held}; a new run there would mix its files and TensorBoard steps with "
                f"that run's. Go on with it (--ckpt_path latest), {elsewhere}"
            )
        if Path(path).resolve().parent != directory.resolve():
            self.parser.error(f"--ckpt_path {path} is not one of them: {held}; {elsewhere}")
        later = [s for s in steps if step is not None and s > step]
        if later:
            self.parser.error(
                f"--ckpt_path {path} is at step {step}, but {held}, later ones included: "
                f"a run resumed there would mix two histories, and --ckpt_path latest would "
                f"find the other one. Resume into another --trainer.default_root_dir"
            )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is None or isinstance(args, list):  # the command line, as LightningCLI's
            args = yaml_nonfinite(sys.argv[1:] if args is None else list(args))
            self._args = args  # parsed again, on the checkpoint's settings, by a resume
            self.config = parser.parse_args(args)
            return
        self._args = args
        super().parse_arguments(parser, args)

    def _callbacks_to_resume(self, path: Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """A fit resume's default ``trainer.callbacks``: those of the run's config.yaml
        beside the file (every setting, also of callbacks that keep no state), then each
        stateful one the file's own record names that those lack, rebuilt from its state
        key (a copied or archived file has no config.yaml beside it)."""
        entries, self._record = entries_to_resume(path, checkpoint)
        self._default_callbacks = entries
        return {"trainer.callbacks": self._default_callbacks} if self._default_callbacks else {}

    def _check_recorded_callbacks(self) -> None:
        """After instantiation: say which callbacks came from the checkpoint's record, and
        refuse a resume that would drop the state of one that cannot be rebuilt (a class
        of Lightning's or the user's, a RollbackRestore), unless the command line or a
        --config chose the callbacks itself (then Lightning's warning names them)."""
        record = getattr(self, "_record", None)
        if record is None:
            return
        present: set[str] = set()
        for callback in getattr(self.trainer, "callbacks", []):
            present |= keys_of(callback)
        given = self.config[self.subcommand]["trainer"].get("callbacks") or []
        given_paths = [getattr(entry, "class_path", entry) for entry in given]
        chosen = given_paths != [entry["class_path"] for entry in self._default_callbacks]
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

    def _resume_with_checkpoint_settings(self, path: str, checkpoint: dict[str, Any]) -> None:
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
        self._from_record(subcommand, Path(path).resolve().parent.parent, path)
        saved: dict[str, Any] = {}
        problem = foreign_checkpoint(self.config[subcommand]["model"], checkpoint, path)
        if subcommand == "fit" and problem:  # else the module's refusal, files written
            self.parser.error(problem)
        if is_own(self.config[subcommand]["model"], TinyGPTModule):  # another: as given
            hparams = plain_config(checkpoint.get("hyper_parameters", {}))
            saved |= {f"{MODEL_KEYS}{key}": value for key, value in flat_config(hparams).items()}
        data = checkpoint.get(StepDataModule.__qualname__, {}).get("config")
        if data is not None and is_own(self.config[subcommand]["data"], StepDataModule):
            # (files from before hold only the data seed)
            saved |= {f"{DATA_KEYS}{key}": value for key, value in flat_config(data).items()}
        # A Trainer setting, kept for the same reason
        saved |= {f"trainer.{k}": v for k, v in clipping_from_checkpoint(checkpoint).items()}
        if subcommand == "fit":  # the remedies, the detector
            saved |= self._callbacks_to_resume(Path(path), checkpoint)
        set_merged_defaults(self._parser(subcommand), saved)
        self.config = self.parser.parse_args(self._args)  # (build_cli passes a list or None)
        config = self.config[subcommand]
        config["ckpt_path"] = path  # "latest" resolved
        given = config["trainer"].get("callbacks")
        if isinstance(given, list):
            # The run's command again (what a preempted run says to do): its
            # --trainer.callbacks+= come after the same ones of its config.yaml, taken once
            config["trainer"]["callbacks"] = [c for i, c in enumerate(given) if c not in given[:i]]
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

    def _from_record(self, subcommand: str, run_dir: Path, path: str | None) -> None:
        """A user's run's config.yaml as the defaults, the command line parsed on them."""
        if record := user_run_config(read_record(run_dir)):
            self._parser(subcommand).set_defaults(record)
            self.config = self.parser.parse_args(self._args)
            self.config[subcommand]["ckpt_path"] = path

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = config["trainer"]["default_root_dir"]
        callbacks = [
            self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys
        ]
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        training = self.subcommand == "fit"  # validate trains nothing and saves nothing
        # validate: a run of its own beside the training's (its curves, its config.yaml
        # untouched), one per checkpoint; Lightning logs a validation at step 0
        checkpoint = config.get("ckpt_path")
        logger = RunLogger(
            save_dir=root,
            name="" if training else "validate",
            version="" if training else (Path(checkpoint).stem if checkpoint else "fresh"),
            purge_step=getattr(self, "_resume_step", None) if training else None,
        )
        configured = trainer_config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        parts = standard_run(
            trainer_config,
            root,
            checkpoint_every=config["checkpoint_every"] or None,
            given=[*configured, *callbacks],
            training=training,
            logger=logger,
        )
        own = [parts.lock] if parts.lock is not None else []  # taken in instantiate_classes
        added = [*callbacks, *own, *parts.callbacks]
        if training:
            added = training_callbacks(config, added, configured)
        return self._instantiate_trainer(parts.trainer_kwargs, added)


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
