"""The tools' one seam to the demo's code: the demo classes and helpers that ``diagnose``
still uses to rebuild the demo's run from its checkpoint, imported here and nowhere else
in lit_spikes.tools (tests/test_layers.py checks it). Issue 63 empties it; ``fit`` left
it for ``lit_spikes.ChecksItsRun``, recover for class paths (``lit_spikes.tools.defaults``)."""

from lit_spikes.demo.data import (
    DataConfig,
    StepDataModule,
    data_config_from_checkpoint,
    data_config_from_dict,
)
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import OptimConfig, TinyGPTModule

__all__ = [
    "DataConfig",
    "GPTConfig",
    "OptimConfig",
    "StepDataModule",
    "TinyGPTModule",
    "data_config_from_checkpoint",
    "data_config_from_dict",
]
