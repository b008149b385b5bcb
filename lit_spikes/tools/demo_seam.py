"""The tools' one seam to the demo's code: the few demo classes and helpers the tools
still use, imported here and nowhere else in lit_spikes.tools (tests/test_layers.py
checks it). Issue 63 empties it: each goes behind the module protocol (``ToolFacts``)
or below both layers (``lit_spikes.shared``); the defaults themselves are class-path
strings (``lit_spikes.tools.defaults``)."""

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

__all__ = [
    "DEFAULT_MODEL_SEED",
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
