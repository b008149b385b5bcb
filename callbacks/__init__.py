"""Lightning callbacks for loss spikes: detect, skip data (PaLM), scale the LR (OPT),
skip an outlier step's update (OLMo-core), and roll back to a real checkpoint."""

from callbacks.batch_skipper import BatchSkipper
from callbacks.final_checkpoint import FinalCheckpoint
from callbacks.lr_scaler import LRScaler
from callbacks.preemption import PreemptionCheckpoint
from callbacks.retention import CheckpointRetention
from callbacks.rollback import RollbackRestore
from callbacks.run_lock import AnotherHistory, RunDirectoryBusy, RunDirectoryLock
from callbacks.skip_step import SkipStep
from callbacks.spike_detector import SpikeDetector

__all__ = [
    "AnotherHistory",
    "BatchSkipper",
    "CheckpointRetention",
    "FinalCheckpoint",
    "LRScaler",
    "PreemptionCheckpoint",
    "RollbackRestore",
    "RunDirectoryBusy",
    "RunDirectoryLock",
    "SkipStep",
    "SpikeDetector",
]
