"""What ``lit-spikes fit`` gives a user's module without being asked, as the project's
own module has it: an ``ExactResume`` (``--exact_resume``), a seed (``--seed_everything``,
0) and one torch thread (``--num_threads``); a run's length required up front; and a
resume from ``--ckpt_path`` alone rebuilt from the run's record (its ``config.yaml``).
The decisions are pure functions of the parsed values; ``fit_cli`` applies them."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule

from lit_spikes.shared.plain import plain_config
from lit_spikes.tools import run_record
from lit_spikes.tools.cli_parsing import is_subclass_path
from lit_spikes.tools.command_line import as_plain
from lit_spikes.tools.defaults import DEMO_DATA, DEMO_MODEL
from lit_spikes.tools.factories import import_class, stated_facts

EXACT_RESUME_HELP = "Add an ExactResume unless the module or --trainer.callbacks has one."
NUM_THREADS_HELP = "torch threads: 1 for another --model (TinyGPTModule: --model.num_threads)."
SEED_HELP = "0 for another --model (TinyGPTModule seeds itself); false: no seeding."

RECORDED_TOP = ("seed_everything", "num_threads", "exact_resume", "checkpoint_every")
"""Settings of a user's run that a resume takes from its record unless given."""

RECORDED_TRAINER = (
    "max_steps",
    "max_epochs",
    "max_time",
    "min_steps",
    "min_epochs",
    "limit_train_batches",
    "limit_val_batches",
    "val_check_interval",
    "check_val_every_n_epoch",
    "num_sanity_val_steps",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "overfit_batches",
    "sync_batchnorm",
    "use_distributed_sampler",
    "reload_dataloaders_every_n_epochs",
    "benchmark",
    "precision",
    "deterministic",
    "accelerator",
    "devices",
    "num_nodes",
    "strategy",
    "log_every_n_steps",
    "enable_progress_bar",
    "enable_model_summary",
)
"""The Trainer settings of the record that decide what a resumed run trains: its length,
numerics and clipping (the checkpoint's clipping goes over it: ``fit_cli``). Not the run
directory (the resume's own) nor the callbacks (``fit_cli`` takes them from the same file;
a requeue that adds one is refused: ``added_callbacks``)."""

RECORD_NAME = run_record.RECORD_NAME


def add_fit_options(parser: ArgumentParser) -> None:
    """``--exact_resume`` and ``--num_threads``."""
    parser.add_argument("--exact_resume", type=bool, default=True, help=EXACT_RESUME_HELP)
    parser.add_argument("--num_threads", type=int | None, default=None, help=NUM_THREADS_HELP)


def add_seed_option(parser: ArgumentParser) -> None:
    """LightningCLI's ``--seed_everything``, with None as "the default for this module"."""
    parser.add_argument("--seed_everything", type=bool | int | None, default=None, help=SEED_HELP)


def seed_for(given: bool | int | None, own_model: bool) -> bool | int:
    """The seed LightningCLI runs ``seed_everything`` with (False: none): as given, else
    none for the project's module (it seeds itself) and 0 for any other, so that two
    identical commands train identical weights."""
    if given is None:
        return False if own_model else 0
    return given


def threads_for(given: int | None, own_model: bool) -> tuple[int | None, str | None]:
    """``(threads to set, None)`` or ``(None, a usage error)``; ``(None, None)``: leave
    them to the project's module, which sets its ``num_threads`` in ``setup``."""
    if own_model:
        if given is not None:
            return None, (
                f"--num_threads={given}: TinyGPTModule sets its own threads; give "
                f"--model.num_threads {given}"
            )
        return None, None
    threads = 1 if given is None else given
    if threads < 1:
        return None, f"--num_threads={threads} must be >= 1"
    return threads, None


def check_num_threads(value: object, owner: str) -> None:
    """A ValueError naming ``owner`` unless ``value`` is None or a whole number >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"{owner}.num_threads={value!r}: give a whole number >= 1, or null for the "
            "process's own"
        )


def length_problem(model_path: str, trainer: Mapping[str, Any]) -> str | None:
    """Why a user's fit cannot start (None: it can): Lightning would train 1000 epochs
    where nothing bounds the run, and checkpoints in steps need a last step to mean
    something. A bound of -1 given explicitly is the user's choice of no limit."""
    steps, epochs = trainer.get("max_steps"), trainer.get("max_epochs")
    if (steps is None or steps == -1) and epochs is None and trainer.get("max_time") is None:
        return (
            f"--model {model_path} needs the run's length: give --trainer.max_steps N "
            "(or --trainer.max_epochs, --trainer.max_time); nothing was written"
        )
    return None


def data_given(command_line: Any, config_files: list[Any], subcommand: str) -> bool:
    """Whether the command line (a list of arguments, or a mapping given in-process) or
    one of its ``--config`` files names the data (``--data ...``, a ``data:`` key)."""
    if isinstance(command_line, Mapping):
        nested = [v for v in command_line.values() if isinstance(v, Mapping)]
        return "data" in command_line or any("data" in v for v in nested)
    tokens = [str(token) for token in command_line or []]
    if any(t == "--data" or t.startswith(("--data.", "--data=")) for t in tokens):
        return True
    for path in config_files:
        try:
            loaded = yaml.safe_load(Path(str(path)).read_text())
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue  # the parse read it: a config given as a string, say
        if isinstance(loaded, Mapping) and (
            "data" in loaded or "data" in (loaded.get(subcommand) or {})
        ):
            return True
    return False


def data_problem(model_path: str, subcommand: str) -> str | None:
    """Why a module of the user's given no ``--data`` cannot run ``subcommand`` (None: it
    brings its own ``train_dataloader``, or ``val_dataloader`` to validate): the project's
    text is the default data of its own module alone."""
    import lightning.pytorch as pl

    hook = "train_dataloader" if subcommand == "fit" else "val_dataloader"
    try:
        klass = import_class(model_path, pl.LightningModule, "--model")
    except ValueError:
        return None  # the parse reports it
    if getattr(klass, hook) is not getattr(pl.LightningModule, hook):
        return None
    return (
        f"--model {model_path} has no {hook} and no --data was given: give --data "
        f"CLASS_PATH (your LightningDataModule; {DEMO_DATA} for the project's text, "
        "explicitly); nothing was written"
    )


def resolve_module_defaults(config: Any, fitting: bool) -> str | None:
    """The parsed config's seed and threads resolved for its module (the project's or a
    user's), in place (so that config.yaml records them); else the text of a usage
    error: a user's fit without a length, threads refused."""
    own_model = is_subclass_path(_class_path(config["model"]), DEMO_MODEL)
    if fitting and not own_model and stated_run_steps(config["model"]) is None:
        problem = length_problem(_class_path(config["model"]), config["trainer"])
        if problem is not None:
            return problem
    config["seed_everything"] = seed_for(config.get("seed_everything"), own_model)
    config["num_threads"], problem = threads_for(config.get("num_threads"), own_model)
    return problem


def adds_exact_resume(config: Any, configured: list[Any]) -> bool:
    """Whether ``fit`` adds an ``ExactResume`` to the parsed ``config``'s run: asked
    (``exact_resume``), for a module not the project's (its ``configure_callbacks``
    returns one) and none among the ``configured`` callbacks. A user's module returning
    one from ``configure_callbacks`` replaces the added one, as Lightning replaces a
    Trainer callback of a type the module returns."""
    from lit_spikes.callbacks import ExactResume

    if not config["exact_resume"] or is_subclass_path(_class_path(config["model"]), DEMO_MODEL):
        return False
    return not any(isinstance(c, ExactResume) for c in configured)


def training_callbacks(config: Any, added: list[Any], configured: list[Any]) -> list[Any]:
    """The callbacks ``fit`` adds to the ``configured`` ones when it trains: ``added``,
    a ``TrainingCurves`` (``lr`` and ``grad_norm`` in TensorBoard for any module) unless
    one is there, and last an ``ExactResume`` where ``adds_exact_resume`` says so (last,
    where a module's own would come)."""
    from lit_spikes.callbacks import TrainingCurves
    from lit_spikes.tools.resume_callbacks import with_exact_resume

    if not any(isinstance(c, TrainingCurves) for c in [*configured, *added]):
        added = [*added, TrainingCurves()]
    return with_exact_resume(added) if adds_exact_resume(config, [*configured, *added]) else added


def recorded_run_config(record: Mapping[str, Any], with_callbacks: bool = False) -> dict[str, Any]:
    """The defaults a requeue takes from its run's record (a parsed ``config.yaml``), for
    the project's module as for any: its ``model`` and ``data`` sections whole,
    ``RECORDED_TOP`` and ``RECORDED_TRAINER`` (dotted keys), and ``with_callbacks`` its
    ``trainer.callbacks`` (a resume takes those with the checkpoint's record instead:
    ``resume_callbacks``); nothing from a record that is not one. (A checkpoint's own
    settings go over these: ``fit_cli``.)"""
    model = record.get("model")
    if not isinstance(model, Mapping) or not isinstance(model.get("class_path"), str):
        return {}
    saved: dict[str, Any] = {"model": dict(model)}
    data = record.get("data")
    if data is None or isinstance(data, Mapping):
        saved["data"] = None if data is None else dict(data)
    saved |= {key: record[key] for key in RECORDED_TOP if key in record}
    trainer = record.get("trainer")
    if isinstance(trainer, Mapping):
        plain = (str, int, float, bool, type(None))
        saved |= {
            f"trainer.{key}": trainer[key]
            for key in RECORDED_TRAINER
            if key in trainer and isinstance(trainer[key], plain)
        }
        if with_callbacks and trainer.get("callbacks"):
            saved["trainer.callbacks"] = trainer["callbacks"]
    return saved


REQUEUE_MAY_CHANGE = frozenset(
    {"trainer.max_steps", "trainer.log_every_n_steps", "trainer.enable_progress_bar"}
    | {"trainer.enable_model_summary", "model.num_threads", "model.flush_denormal"}
)
"""Settings a requeue may give otherwise than its record: the run's end (to extend it),
what is logged and shown, and the project's module's process settings (it warns)."""


def requeue_conflicts(saved: Mapping[str, Any], config: Any) -> list[str]:
    """``"--<setting>=<given> (the record's: <recorded>)"`` for each setting of a run's
    record (``saved``: ``recorded_run_config``'s) that the parsed ``config`` (the record's
    values as defaults, the command line over them) gives otherwise, but those a requeue
    may change."""
    from lit_spikes.tools.command_line import as_plain

    given: dict[str, Any] = {}
    recorded: dict[str, Any] = {}
    for key, value in saved.items():
        if key in ("model", "data"):
            now = as_plain(config[key])
            for part, section in (("given", now), ("recorded", value)):
                flat = _flat_section(key, section)
                (given if part == "given" else recorded).update(flat)
        elif key != "trainer.callbacks":
            section, _, name = key.rpartition(".")
            given[key] = config[section][name] if section else config[key]
            recorded[key] = value
    return [
        f"--{key}={plain_config(given.get(key))!r} (the record's: {plain_config(value)!r})"
        for key, value in recorded.items()
        if key not in REQUEUE_MAY_CHANGE and _differs(given.get(key), value)
    ]


def _differs(given: Any, recorded: Any) -> bool:
    """Whether a setting's value differs from the record's. A set (a module's
    ``frozenset`` argument) is recorded as a list in the order it iterated in the run's
    process, which string hashing changes from one process to the next."""
    if isinstance(given, set | frozenset) and isinstance(recorded, list | set | frozenset):
        return sorted(map(repr, given)) != sorted(map(repr, recorded))
    return bool(plain_config(given) != plain_config(recorded))


def added_callbacks(record: Mapping[str, Any], config: Any) -> list[str]:
    """``"--trainer.callbacks+=<class> (the record's: [...])"`` for each callback the parsed
    ``config`` gives that the run's ``record`` (its config.yaml) does not list with the same
    settings: an EarlyStopping added on a requeue stops another run. (A requeue's defaults
    hold none of the record's callbacks yet: the resume takes them with the checkpoint.)"""
    from lit_spikes.tools.command_line import as_plain

    trainer = record.get("trainer")
    listed = trainer.get("callbacks") if isinstance(trainer, Mapping) else None
    recorded = [plain_config(entry) for entry in listed or []]
    given = [plain_config(as_plain(entry)) for entry in config["trainer"].get("callbacks") or []]
    names = [_class_path(entry) or repr(entry) for entry in recorded]
    added = [_class_path(entry) or repr(entry) for entry in given if entry not in recorded]
    return [
        f"--trainer.callbacks+={name}{' with other settings' if name in names else ''} "
        f"(the record's: {', '.join(names) or 'none'})"
        for name in added
    ]


def record_problem(
    saved: Mapping[str, Any],
    config: Any,
    record: Path,
    requeue: bool,
    recorded: Mapping[str, Any] | None = None,
) -> str | None:
    """Why a fit cannot go on from the run ``record`` describes (None: it can): a requeue
    (into the run's own directory) asking for another run (``requeue_conflicts``, and
    ``added_callbacks`` of the ``recorded`` config.yaml); a
    resume elsewhere with another module class, whose weights would load into it without
    a word where the shapes match."""
    if requeue:
        conflicts = requeue_conflicts(saved, config) + added_callbacks(recorded or {}, config)
        if not conflicts:
            return None
        return (
            f"a requeue continues the run {record} records, but {'; '.join(conflicts)} asks "
            "for another run. Drop them to continue it, or start a new run in another "
            "--trainer.default_root_dir (a requeue may change max_steps, to extend it, "
            "log_every_n_steps and the progress bar)"
        )
    trained, given = _class_path(saved.get("model")), _class_path(config["model"])
    if trained == given:
        return None
    return (
        f"--model {given}, but the checkpoint's run trained {trained} ({record}): a resume "
        f"continues that module. Give --model {trained} (or leave --model out), or train "
        f"{given} in a new run without --ckpt_path"
    )


def _flat_section(key: str, section: Any) -> dict[str, Any]:
    """A ``model``/``data`` section as ``{"model": class path, "model.<arg>": value}``."""
    if not isinstance(section, Mapping):
        return {key: section}
    flat: dict[str, Any] = {key: section.get("class_path")}
    stack = [(f"{key}.", section.get("init_args") or {})]
    while stack:
        prefix, values = stack.pop()
        for name, value in values.items():
            if isinstance(value, Mapping) and "class_path" not in value:
                stack.append((f"{prefix}{name}.", value))
            else:
                flat[f"{prefix}{name}"] = value
    return flat


def foreign_checkpoint(model: Any, checkpoint: Mapping[str, Any], path: str) -> str | None:
    """Why the project's module (``model``: the parsed section, by default it) cannot
    resume ``checkpoint`` (None: it can): a file it did not write, with no run record
    beside it to name the classes that did."""
    if "lit_spikes" in checkpoint or not is_subclass_path(_class_path(model), DEMO_MODEL):
        return None
    record = run_record.record_path(path)
    where = f"at {record}" if record is not None else "beside it (it is in no <run>/checkpoints/)"
    return (
        f"--ckpt_path {path} was not written by TinyGPTModule (no 'lit_spikes' entry) and "
        f"no {RECORD_NAME} of its run is {where}: give the run's "
        "--model CLASS_PATH and --data CLASS_PATH (and its --trainer.max_steps)"
    )


def _class_path(section: Any) -> str:
    """A parsed ``model`` section's class path (a Namespace or a dict; "" for none)."""
    path = section.get("class_path") if section is not None else None
    return path if isinstance(path, str) else ""


def stated_run_steps(section: Any) -> int | None:
    """The ``ToolFacts.run_steps`` of the parsed ``--model`` (None: none stated)."""
    plain = as_plain(section)
    if not isinstance(plain, dict) or not isinstance(plain.get("class_path"), str):
        return None
    return _run_steps(json.dumps(plain, sort_keys=True, default=_jsonable))


def _jsonable(value: Any) -> Any:
    """A parsed value JSON holds: a dataclass (a config built in Python) as its fields."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return str(value)


@functools.lru_cache(maxsize=8)
def _run_steps(spec: str) -> int | None:
    """Read from the module's stated facts (``stated_facts``), once per settings."""
    try:
        facts = stated_facts(json.loads(spec), LightningModule, "--model")
    except Exception:  # a bad class or setting: the parse or the instantiation reports it
        return None
    run_steps: int | None = facts.run_steps
    return run_steps
