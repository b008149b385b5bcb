"""The tools' one seam to the demo: the project's default model and data and the few
demo helpers the tools still use, imported here and nowhere else in lit_spikes.tools
(tests/test_layers.py checks it)."""

from lit_spikes.demo.data import (
    DataConfig,
    StepDataModule,
    check_shard,
    data_config_from_checkpoint,
    data_config_from_dict,
)
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import (
    DEFAULT_MODEL_SEED,
    OptimConfig,
    TinyGPTModule,
)
from lit_spikes.demo.setup_checks import check_training_setup

DEMO_MODEL = "lit_spikes.demo.module.TinyGPTModule"
"""The default ``--model`` of the commands: the demo's tiny GPT."""
DEMO_DATA = "lit_spikes.demo.data.StepDataModule"
"""The default ``--data`` of the commands: the demo's character world."""

__all__ = [
    "DEFAULT_MODEL_SEED",
    "DEMO_DATA",
    "DEMO_MODEL",
    "DataConfig",
    "GPTConfig",
    "OptimConfig",
    "StepDataModule",
    "TinyGPTModule",
    "check_shard",
    "check_training_setup",
    "data_config_from_checkpoint",
    "data_config_from_dict",
]
