"""The ``lit-spikes fit`` parser's own ways: its help (the project's options first,
Lightning's Trainer texts cut to their first sentence, where they say what is not so
here, their meaning here), errors that name the option a typo meant, ``nan``/``inf`` on
the command line read as in a config file, and two notes of Lightning's silenced; and
what subclass mode (``--model CLASS_PATH``) needs: which class a section builds, its
errors unwrapped, defaults merged into a section's."""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import logging
import math
import os
import re
import textwrap
import warnings
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from lit_spikes.tools.class_paths import options_listing
from lit_spikes.tools.commands import TOP_USAGE

_OWN_HELP = {
    "trainer.max_steps": "Stop after this many steps. -1 (the default here): where the LR "
    "schedule ends (--model.optim.max_steps, 400 by default); fewer stops early on the same "
    "schedule, more trains on at its final LR. Another --model: -1 is Lightning's, no limit.",
    "trainer.max_epochs": "Stop after this many epochs (the first of max_steps and max_epochs "
    "ends the run). The step stream is endless: an epoch is as many steps as it takes to "
    "draw the training text's number of tokens, or --trainer.limit_train_batches steps.",
    "trainer.gradient_clip_val": "Clip gradients at this value (0 or null: no clipping; the "
    "clipping remedy). A resume keeps the checkpoint's unless given.",
}
"""Help of Trainer options whose meaning here differs from Lightning's text."""

_NONFINITE = {"nan": ".nan", "inf": ".inf", "infinity": ".inf"}


def yaml_nonfinite(args: list[str]) -> list[str]:
    """A command-line ``nan``/``inf`` as the YAML ``.nan``/``.inf`` a config file would
    give: jsonargparse reads ``nan`` as a string and refuses it after the whole usage,
    where the YAML value gets the setting's own check ("must be finite")."""

    def spelt(value: str) -> str:
        sign, word = (value[0], value[1:]) if value[:1] in "+-" else ("", value)
        yaml_word = _NONFINITE.get(word.lower())
        return value if yaml_word is None else ("-" if sign == "-" else "") + yaml_word

    out = []
    for index, token in enumerate(args):
        option, equals, value = token.partition("=")
        if equals and option.startswith("--"):
            token = f"{option}={spelt(value)}"
        elif index and args[index - 1].startswith("--") and "=" not in args[index - 1]:
            token = spelt(token)
        out.append(token)
    return out


_UNION = re.compile(
    r'^Parser key "(?P<key>model|data)":\n\s*Does not validate against any of the Union '
    r"subtypes\n.*?Problem with given class_path '(?P<path>[^']+)':\n(?P<inner>.*?)\n"
    r"\s*- Expected a <class 'NoneType'>",
    re.DOTALL,
)


def condensed(message: str) -> str:
    """jsonargparse's account of a bad ``--model.*``/``--data.*`` value (subclass mode: a
    Union of the class and None, the whole value repeated) cut to what the class's own
    parser said, its options spelt as on the command line."""
    match = _UNION.match(message)
    if match is None:
        return message
    key, inner = match["key"], textwrap.dedent(match["inner"]).strip()
    inner = re.sub(r"(?<![\w.-])--(?=\w)", f"--{key}.", inner)
    inner = inner.replace('Parser key "', f'Parser key "{key}.')
    unknown = re.fullmatch(r"Option '(\w+)' is not accepted", inner)
    close = difflib.get_close_matches(unknown[1], _init_args(match["path"]), n=1) if unknown else []
    if close:
        inner += f" (did you mean --{key}.{close[0]}?)"
    return f"--{key} {match['path']}: {inner}"


def _init_args(path: str) -> list[str]:
    """The arguments of the class at ``path`` (none where it is not importable)."""
    module, _, name = path.rpartition(".")
    try:
        return list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


class HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with the description's line breaks kept."""


class LitSpikesParser(LightningArgumentParser):
    """LightningArgumentParser whose errors end with the closest option to one it does
    not know (a typo's fix)."""

    @override
    def format_usage(self) -> str:
        # Options before a command (-c CONFIG) reach LightningCLI's own parser, whose usage
        # line names fit and validate alone; a command's parser ("lit-spikes fit") keeps its
        # own. (Not argparse's usage= argument: the commands' names are derived from it.)
        if self.prog == "lit-spikes":
            return "usage: " + TOP_USAGE.replace("{", "[-c CONFIG] {", 1) + "\n"
        return super().format_usage()

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        parser = getattr(ex, "subcommand_parser", None) or self
        message = condensed(message)
        if message.startswith("unrecognized arguments:") and "(did you mean" not in message:
            known = [f"--{key}" for key in parser.get_defaults().keys()]  # noqa: SIM118 (nested keys)
            typos = [word for word in message.split()[2:] if word.startswith("--")]
            for typo in typos:
                close = difflib.get_close_matches(typo.partition("=")[0], known, n=1)
                if close:
                    message += f" (did you mean {close[0]}?)"
        super().error(message, ex)


_SECTIONS = {
    "model": "the LightningModule to train (any; as --model.init_args.NAME or --model.NAME)",
    "data": "the LightningDataModule (any; as --data.init_args.NAME or --data.NAME)",
}


def arrange_help(
    parser: LightningArgumentParser,
    subcommand: str,
    classes: dict[str, tuple[str, type]] | None = None,
) -> None:
    """The help of a subcommand's parser, shortened, its sections titled; ``classes``:
    the ``model`` and ``data`` classes (with ``"Given"`` or ``"Default"``) whose options
    are listed (subclass mode lists only ``--model CLASS_PATH``)."""
    # One line, not argparse's list of all 80 options (printed before every error too)
    parser.usage = f"lit-spikes {subcommand} [options]"
    groups = parser.groups or {}  # jsonargparse's named groups, titled by a docstring
    for key, title in _SECTIONS.items():
        if key in groups:
            groups[key].title = f"--{key} CLASS_PATH: {title}"
            if classes and key in classes:
                heading, klass = classes[key]
                groups[key].description = options_listing(key, klass, heading)
    # argparse has no public list of a parser's options (its help, rewritten here, is
    # public on each): the one private name of this module
    for action in parser._actions:
        if action.dest in _OWN_HELP:  # what Lightning's text says is not so here
            action.help = _OWN_HELP[action.dest]
        elif action.help and (action.dest.startswith("trainer.") or action.dest == "weights_only"):
            # Lightning's Trainer docs, 370 lines: their first sentence each
            action.help = action.help.split(". ")[0].rstrip(".") + "."
        if action.dest == "ckpt_path":  # Lightning's text names keywords refused here
            action.help = (
                "a step=<k>.ckpt file to resume from (fit) or evaluate (validate); "
                "'latest': the newest valid one in <trainer.default_root_dir>/checkpoints; "
                "'last': the same, or a new run where there is none yet (fit). The "
                "resumed run writes into --trainer.default_root_dir (default runs/fit), "
                "not necessarily the checkpoint's run directory"
            )


def is_own(section: Any, own: str) -> bool:
    """Whether a parsed ``model``/``data`` section (``class_path``, ``init_args``) builds
    the class at the class path ``own`` or a subclass of it: only then do the project's
    own steps apply (the tools know the demo's classes by class path alone)."""
    path = section.get("class_path") if section is not None else None
    return isinstance(path, str) and is_subclass_path(path, own)


def is_subclass_path(path: str, own: str) -> bool:
    """Whether the class at the class path ``path`` is the one at ``own`` or a subclass of
    it (False where either does not import: the parse has reported it)."""

    def klass(dotted: str) -> Any:
        module, _, name = dotted.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return None

    mine, base = klass(path), klass(own)
    return isinstance(mine, type) and isinstance(base, type) and issubclass(mine, base)


def first_cause(error: BaseException) -> BaseException:
    """The error a class's own check raised: subclass mode wraps it in jsonargparse's
    account of a Union (LightningModule or None), with every value of the config."""
    while isinstance(error.__cause__ or error.__context__, ValueError | TypeError):
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return error


MODEL_KEYS, DATA_KEYS = "model.init_args.", "data.init_args.config."
"""Where the project's model and data settings are in the parsed config."""


def set_merged_defaults(parser: LightningArgumentParser, saved: dict[str, Any]) -> None:
    """``saved`` (dotted keys) as the parser's defaults, those it knows. jsonargparse sets
    a subclass argument's default only as a whole (``class_path`` and ``init_args``): the
    model's and the data's are merged into theirs."""
    defaults = parser.get_defaults()
    plain, whole = {}, set()
    for key, value in saved.items():
        if key not in defaults:
            continue
        section = key.partition(".")[0]
        if section in ("model", "data"):
            defaults[key] = value
            whole.add(section)
        else:
            plain[key] = value
    parser.set_defaults(plain | {section: defaults[section].as_dict() for section in whole})


def trainer_setting_problem(trainer: Any) -> str | None:
    """Why the parsed ``trainer`` section's clipping or validation interval is refused
    (None: it is not), before anything is written."""
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not (isinstance(clip, int | float) and 0 <= clip < math.inf):
        # Lightning trains unclipped at -1, and the fingerprint would record clipping -1
        return (
            f"--trainer.gradient_clip_val={clip} must be a finite number >= 0 "
            "(0 or null: no clipping)"
        )
    interval = trainer.get("val_check_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval < 1:
        return f"--trainer.val_check_interval={interval} must be >= 1 (steps between validations)"
    by_epoch = trainer.get("check_val_every_n_epoch") is not None
    if isinstance(interval, float) and not (by_epoch and 0 < interval <= 1):
        return (
            f"--trainer.val_check_interval={interval} must be a whole number of steps "
            ">= 1 (a fraction in (0, 1] of an epoch needs --trainer.check_val_every_n_epoch "
            "and an int --trainer.limit_train_batches: the step stream has no epochs)"
        )
    return None


class _NoLitLoggerTip(logging.Filter):
    """Lightning's advert for its cloud logger, printed by every Trainer of every run."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip: For seamless cloud logging")


def quiet_lightning_notes() -> None:
    """Silence, at their source, two notes every fit printed that say nothing about it."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoLitLoggerTip) for f in logger.filters):
            logger.addFilter(_NoLitLoggerTip())
    # Lightning's own call of torch's deprecated LeafSpec() (its CombinedLoader): nothing
    # a user of Lightning can change
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def launched_rank() -> int:
    """This process's global rank as its launcher set it (Lightning's DDP launcher,
    torchrun, SLURM); 0 for a process started by hand."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0
