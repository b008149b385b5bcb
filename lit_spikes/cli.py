"""``lit-spikes``: LightningCLI for TinyGPTModule and StepDataModule.

``lit-spikes fit`` takes ``--model.*``, ``--data.*``, ``--trainer.*``, ``--config FILE``
and ``--ckpt_path PATH`` as any LightningCLI does, plus ``--checkpoint_every N``: write
``<trainer.default_root_dir>/checkpoints/step=<k>.ckpt`` every N steps, keeping all.
The defaults reproduce the seed's setup (4 layers, peak LR 0.1, batch 16, 400 steps).
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from lit_spikes.data import StepDataModule
from lit_spikes.module import TinyGPTModule
from lit_spikes.training import CHECKPOINT_DIRNAME, step_checkpoint

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "max_steps": 400,  # -1 ends the run where the schedule (--model.optim.max_steps) ends
    "log_every_n_steps": 1,
    "val_check_interval": 100,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "default_root_dir": "runs/fit",
}


class LitSpikesCLI(LightningCLI):
    """LightningCLI with the project's defaults and the ``--checkpoint_every`` option."""

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
        if steps is None or steps < 1:
            # The run ends where its schedule ends unless told to stop earlier (or later).
            config["trainer"]["max_steps"] = config["model"]["optim"].max_steps

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = config["trainer"]["default_root_dir"]
        extra: dict[str, Any] = {}
        if config["trainer"].get("logger") in (None, True):
            extra["logger"] = TensorBoardLogger(save_dir=root, name="", version="")
        trainer = super().instantiate_trainer(**extra, **kwargs)
        every = config["checkpoint_every"]
        if every:
            dirpath = os.path.join(root, CHECKPOINT_DIRNAME)
            trainer.callbacks.append(step_checkpoint(dirpath, every))
        return trainer


def main(args: list[str] | None = None) -> LitSpikesCLI:
    return LitSpikesCLI(
        TinyGPTModule,
        StepDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=False,
        auto_configure_optimizers=False,
        load_from_checkpoint_support=False,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
