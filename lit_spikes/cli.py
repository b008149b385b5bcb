"""``lit-spikes``: LightningCLI for TinyGPTModule and StepDataModule, plus two commands.

``lit-spikes recover ...`` (automatic spike recovery, ``lit_spikes.recover``) and
``lit-spikes diagnose ...`` (replay diagnosis of a spike, ``lit_spikes.diagnose``) are
plain argparse commands; every other first argument goes to the LightningCLI.

``lit-spikes fit`` takes ``--model.*``, ``--data.*``, ``--trainer.*``, ``--config FILE``
and ``--ckpt_path PATH`` as any LightningCLI does, plus ``--checkpoint_every N``: write
``<trainer.default_root_dir>/checkpoints/step=<k>.ckpt`` every N steps, keeping all.
The defaults reproduce the seed's setup (4 layers, peak LR 0.1, batch 16, 400 steps).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_spikes.callbacks.final_checkpoint import FinalCheckpoint
from lit_spikes.callbacks.preemption import PreemptionCheckpoint
from lit_spikes.callbacks.run_lock import RunDirectoryBusy, RunDirectoryLock
from lit_spikes.checkpoints import (
    CheckpointError,
    checkpoint_files_if_any,
    load_checkpoint,
    newest_valid_checkpoint,
    remove_leftovers,
)
from lit_spikes.data import StepDataModule, check_shard, flat_config, plain_config
from lit_spikes.module import TinyGPTModule, check_training_setup, clipping_from_checkpoint
from lit_spikes.progress import with_step_progress_bar
from lit_spikes.tb import TensorBoardStepLogger
from lit_spikes.training import (
    CHECKPOINT_DIRNAME,
    NoProfiler,
    ValidateAtEnd,
    step_checkpoint,
    unwritable_directory,
    with_checkpoint_io,
)

if TYPE_CHECKING:
    from lit_spikes.diagnose import Verdict
    from lit_spikes.recover import RecoverResult

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "max_steps": -1,  # -1: end where the schedule (--model.optim.max_steps) ends
    "log_every_n_steps": 1,
    "val_check_interval": 100,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "default_root_dir": "runs/fit",
}


RESUMABLE_CHANGES = ("num_threads", "flush_denormal")
"""Model settings a resume may take from the command line rather than the checkpoint
(the module warns that the run is then not guaranteed bit-exact)."""


def _run_callbacks(ckpt_path: Path) -> dict[str, Any]:
    """``trainer.callbacks`` of the run that wrote ``ckpt_path``, from the ``config.yaml``
    lit-spikes fit saved in its run directory (``<run>/checkpoints/<file>``); none when
    there is no such file or it lists no callbacks."""
    run_config = ckpt_path.resolve().parent.parent / "config.yaml"
    try:
        loaded = yaml.safe_load(run_config.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
    callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
    return {"trainer.callbacks": callbacks} if callbacks else {}


def _launched_rank() -> int:
    """This process's global rank as its launcher set it (Lightning's DDP launcher,
    torchrun, SLURM); 0 for a process started by hand."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


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
        for action in parser._actions:
            if action.dest == "ckpt_path":  # Lightning's text names keywords refused here
                action.help = (
                    "a step=<k>.ckpt file to resume from (fit) or evaluate (validate); "
                    "'latest': the newest valid one in <trainer.default_root_dir>/checkpoints; "
                    "'last': the same, or a new run where there is none yet (fit). The "
                    "resumed run writes into --trainer.default_root_dir (default runs/fit), "
                    "not necessarily the checkpoint's run directory"
                )
        return parser

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--checkpoint_every",
            type=int,
            default=50,
            help="Write <trainer.default_root_dir>/checkpoints/step=<k>.ckpt every N steps, "
            "keeping all of them (0: no checkpoints).",
        )

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
        if steps is None or steps == -1:
            # The run ends where its schedule ends unless told to stop earlier (or later).
            config["trainer"]["max_steps"] = steps = config["model"]["optim"].max_steps
        resume = getattr(self, "_resume_step", None)
        if self.subcommand == "fit" and resume is not None and resume >= steps:
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
        if devices and isinstance(nodes, int) and nodes > 0:
            # Else each of the processes Lightning starts fails in setup with its traceback
            try:
                check_shard(int(config["data"]["config"]["batch_size"]), 0, devices * nodes)
            except ValueError as error:
                self.parser.error(str(error))
        interval = config["trainer"].get("val_check_interval")
        if isinstance(interval, int) and not isinstance(interval, bool) and interval < 1:
            self.parser.error(
                f"--trainer.val_check_interval={interval} must be >= 1 (steps between validations)"
            )
        by_epoch = config["trainer"].get("check_val_every_n_epoch") is not None
        if isinstance(interval, float) and not (by_epoch and 0 < interval <= 1):
            self.parser.error(
                f"--trainer.val_check_interval={interval} must be a whole number of steps "
                ">= 1 (a fraction in (0, 1] of an epoch needs --trainer.check_val_every_n_epoch "
                "and an int --trainer.limit_train_batches: the step stream has no epochs)"
            )

    @override
    def instantiate_classes(self) -> None:
        # A config that parses but does not validate (a dataclass's or a callback's own
        # check) is bad input too: report it as such, before anything runs or is written.
        try:
            super().instantiate_classes()
            # What would fail at the first step, after files were written: now, instead.
            check_training_setup(
                self.model.model_config,
                self.datamodule,
                self.trainer.accumulate_grad_batches,
                getattr(self.trainer, "overfit_batches", 0),
            )
        except (ValueError, TypeError) as error:
            self.parser.error(f"invalid configuration: {error}")
        for callback in getattr(self.trainer, "callbacks", []):
            if isinstance(callback, RunDirectoryLock):
                # Before fit: Lightning's logger writes its first file before any setup hook.
                callback.acquire_for(self.trainer)
                remove_leftovers(callback.directory / CHECKPOINT_DIRNAME)  # now this run's

    @override
    def _parse_ckpt_path(self) -> None:
        # Before LightningCLI reads the checkpoint's hyperparameters with a bare
        # torch.load: resolve "latest", and turn a broken file into a clear error.
        config = self.config.get(self.config.get("subcommand") or "", None)
        path = config.get("ckpt_path") if config is not None else None
        if path in ("best", "hpc", "registry"):
            self.parser.error(
                f"--ckpt_path {path}: Lightning's keyword for a file lit-spikes does not write "
                "(its checkpoints are step=<k>.ckpt); use --ckpt_path latest for the newest, "
                "or last (the newest, or a new run where there is none yet)"
            )
        latest = path in ("latest", "last")
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
                self._refuse_mixed_histories(config, None, None)
            return
        try:  # validate and test need only the weights
            checkpoint = load_checkpoint(
                path, weights_enough=self.config.get("subcommand") != "fit"
            )
        except CheckpointError as error:
            self.parser.error(f"--ckpt_path: {error}")
        self._resume_step = int(checkpoint["global_step"])
        if self.config.get("subcommand") == "fit" and not latest:
            self._refuse_mixed_histories(config, path, self._resume_step)
        self._resume_with_checkpoint_settings(path, checkpoint)

    def _refuse_mixed_histories(self, config: Any, path: str | None, step: int | None) -> None:
        """A fit whose checkpoint directory holds another history's files would write its
        own beside them (``step=<k>-v1.ckpt``, a second TensorBoard curve over the same
        steps), and ``--ckpt_path latest`` would later find the other: refused, unless it
        resumes that directory's run from its newest file (``latest`` always does)."""
        root = config["trainer"]["default_root_dir"]
        directory = Path(root) / CHECKPOINT_DIRNAME
        steps = [s for s, _ in checkpoint_files_if_any(directory)]
        if not steps:
            events = sorted(Path(root).glob("events.out.tfevents.*"))
            if path is None and events:  # a run of no checkpoints (--checkpoint_every 0)
                self.parser.error(
                    f"{root} holds the TensorBoard events of a run ({events[0].name}"
                    f"{' and more' if len(events) > 1 else ''}): a new run there would log "
                    "the same steps again into its curves; choose another "
                    "--trainer.default_root_dir"
                )
            return
        # A run still training there is the first thing to say (exit 75, naming it), not
        # how to go on with its files. Asked by the first process only: under DDP the
        # others start while it holds the lock.
        if _launched_rank() == 0:
            probe = RunDirectoryLock(root)
            probe.acquire()
            probe.release()
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
        self._args = args  # parsed again, on the checkpoint's settings, by a resume
        super().parse_arguments(parser, args)

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
        saved = {
            f"model.{key}": value
            for key, value in flat_config(
                plain_config(checkpoint.get("hyper_parameters", {}))
            ).items()
        }
        data = checkpoint.get(StepDataModule.__qualname__, {}).get("config")
        if data is not None:  # files from before hold only the data seed
            saved |= {f"data.config.{key}": value for key, value in flat_config(data).items()}
        # A Trainer setting, kept for the same reason
        saved |= {f"trainer.{k}": v for k, v in clipping_from_checkpoint(checkpoint).items()}
        if self.config["subcommand"] == "fit":
            # The callbacks (remedies, the detector) are in no checkpoint field that builds
            # them: the run's own config.yaml, beside its checkpoints, has them.
            saved |= _run_callbacks(Path(path))
        subcommand = self.config["subcommand"]
        parser = self._parser(subcommand)
        known = parser.get_defaults()
        parser.set_defaults({key: value for key, value in saved.items() if key in known})
        self.config = self.parser.parse_args(self._args)  # (build_cli passes a list or None)
        config = self.config[subcommand]
        config["ckpt_path"] = path  # "latest" resolved
        conflicts = []
        for key, value in saved.items():
            if not key.startswith("model.") or key not in config:
                continue
            given = plain_config(config[key])
            if given != value and key.removeprefix("model.") not in RESUMABLE_CHANGES:
                conflicts.append(f"--{key}={given!r} (the checkpoint's: {value!r})")
        if conflicts:
            self.parser.error(
                "--ckpt_path resumes the checkpoint's run with its own model settings, but "
                + "; ".join(conflicts)
                + " asks for others. Drop them to resume; start a new run to change them; "
                "to change the LR from the resume point on, add an LRScaler callback"
            )

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = config["trainer"]["default_root_dir"]
        every = config["checkpoint_every"]
        callbacks = [
            self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys
        ]
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        training = self.subcommand == "fit"  # validate trains nothing and saves nothing
        if training:
            callbacks.append(RunDirectoryLock(root))  # taken in instantiate_classes
        if every and training:
            dirpath = os.path.join(root, CHECKPOINT_DIRNAME)
            callbacks.append(PreemptionCheckpoint(dirpath))
            callbacks.append(step_checkpoint(dirpath, every))
            callbacks.append(FinalCheckpoint(dirpath, every))  # the last step, if off-interval
        interval, steps = trainer_config.get("val_check_interval"), trainer_config["max_steps"]
        if training and ValidateAtEnd.needed(interval, steps):
            callbacks.append(ValidateAtEnd())  # the final model's val/bpc
        if not (every and training):
            trainer_config["enable_checkpointing"] = False  # no default ModelCheckpoint either
        if trainer_config.get("enable_progress_bar", True) is not False:
            configured = trainer_config.get("callbacks") or []
            configured = configured if isinstance(configured, list) else [configured]
            callbacks = with_step_progress_bar([*configured, *callbacks])[len(configured) :]
        if trainer_config.get("logger") in (None, True):
            # validate: a run of its own beside the training's (its curves, its config.yaml
            # untouched), one per checkpoint; Lightning logs a validation at step 0
            checkpoint = config.get("ckpt_path")
            trainer_config["logger"] = TensorBoardStepLogger(
                save_dir=root,
                name="" if training else "validate",
                version="" if training else (Path(checkpoint).stem if checkpoint else "fresh"),
                purge_step=getattr(self, "_resume_step", None) if training else None,
            )
        trainer_config["plugins"] = with_checkpoint_io(trainer_config)
        if trainer_config.get("profiler") is None:  # Lightning's default, cheaper
            trainer_config["profiler"] = NoProfiler()
        return self._instantiate_trainer(trainer_config, callbacks)


DESCRIPTION = """lit-spikes: train a tiny GPT that resumes bit-exactly and survives loss spikes.

Commands:
  fit       train (LightningCLI: --model.*, --data.*, --trainer.*, --config, --ckpt_path,
            --checkpoint_every); also validate (val/bpc of a checkpoint or a fresh model)
  recover   train with automatic spike recovery (lit-spikes recover --help)
  diagnose  replay a spike from a checkpoint: data-caused, state-caused or not
            reproducible (lit-spikes diagnose --help)"""

COMMANDS = {"recover": "lit_spikes.recover", "diagnose": "lit_spikes.diagnose"}


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with the description's line breaks kept."""


"""Sub-commands outside the LightningCLI: name -> module with ``main(argv)``."""


def main(args: list[str] | None = None) -> LitSpikesCLI | RecoverResult | Verdict | None:
    """Run the CLI; a run stopped by SIGTERM/SIGINT exits with 128 + the signal number
    (after writing its checkpoint), so a job scheduler sees it did not finish.

    ``recover`` and ``diagnose`` go to their own modules' ``main``: in-process callers
    (``args`` given) get their result back, the console script (``sys.exit(main())``)
    gets None, so exit status 0. Anything else goes to the LightningCLI."""
    argv = sys.argv[1:] if args is None else args
    if not argv or not (argv[0].startswith("-") or argv[0] in {"fit", "validate", *COMMANDS}):
        # LightningCLI's own message names only its commands (fit, validate)
        what = "no command given" if not argv else f"unknown command {argv[0]!r}"
        print(
            f"usage: lit-spikes {{fit,validate,recover,diagnose}} ...\nlit-spikes: error: "
            f"{what}: choose from fit, validate, recover, diagnose (lit-spikes --help)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if argv[0] in COMMANDS:
        result = importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
        return result if args is not None else None
    try:
        cli = build_cli(args)
    except RunDirectoryBusy as error:
        # Not a crash: a scheduler may retry later (EX_TEMPFAIL), once the other run ended.
        print(f"lit-spikes: error: {error}", file=sys.stderr)
        raise SystemExit(os.EX_TEMPFAIL) from None
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
    # The console script does sys.exit(main()): anything but None would exit with 1.
    return cli if args is not None else None


def build_cli(args: list[str] | None = None, run: bool = True) -> LitSpikesCLI:
    """The project's LightningCLI; ``run=False`` parses and instantiates only."""
    return LitSpikesCLI(
        TinyGPTModule,
        StepDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=False,
        auto_configure_optimizers=False,
        load_from_checkpoint_support=False,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": DESCRIPTION, "formatter_class": _HelpFormatter}
        if run
        else None,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
