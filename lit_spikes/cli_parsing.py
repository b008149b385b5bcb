"""The ``lit-spikes fit`` parser's own ways: its help (the project's options first,
Lightning's Trainer texts cut to their first sentence, where they say what is not so
here, their meaning here), errors that name the option a typo meant, ``nan``/``inf`` on
the command line read as in a config file, and two notes of Lightning's silenced."""

from __future__ import annotations

import difflib
import logging
import warnings
from typing import NoReturn

from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

_OWN_HELP = {
    "trainer.max_steps": "Stop after this many steps. -1 (the default here): where the LR "
    "schedule ends (--model.optim.max_steps, 400 by default); fewer stops early on the same "
    "schedule, more trains on at its final LR.",
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


class LitSpikesParser(LightningArgumentParser):
    """LightningArgumentParser whose errors end with the closest option to one it does
    not know (a typo's fix)."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        parser = getattr(ex, "subcommand_parser", None) or self
        if message.startswith("unrecognized arguments:"):
            known = [f"--{key}" for key in parser.get_defaults().keys()]  # noqa: SIM118 (nested keys)
            typos = [word for word in message.split()[2:] if word.startswith("--")]
            for typo in typos:
                close = difflib.get_close_matches(typo.partition("=")[0], known, n=1)
                if close:
                    message += f" (did you mean {close[0]}?)"
        super().error(message, ex)


def arrange_help(parser: LightningArgumentParser, subcommand: str) -> None:
    """The help of a subcommand's parser, shortened and in the project's order."""
    # One line, not argparse's list of all 80 options (printed before every error too)
    parser.usage = f"lit-spikes {subcommand} [options]"
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
    # The project's own options first, Lightning's Trainer last. (argparse has no
    # public way to order groups: its own list of them, reordered.)
    groups = parser._action_groups
    trainer = [g for g in groups if any(a.dest.startswith("trainer.") for a in g._group_actions)]
    method = [g for g in groups if any(a.dest == "ckpt_path" for a in g._group_actions)]
    rest = [g for g in groups if g not in trainer and g not in method]
    parser._action_groups = [*rest[:2], *method, *rest[2:], *trainer]


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
