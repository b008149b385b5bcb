"""Lightning callbacks for loss spikes: detect, skip data (PaLM), scale the LR (OPT),
skip an outlier step's update (OLMo-core), and roll back to a real checkpoint."""

from lit_spikes.callbacks.batch_skipper import BatchSkipper
from lit_spikes.callbacks.clip import ClipGradients
from lit_spikes.callbacks.curves import TrainingCurves
from lit_spikes.callbacks.exact_resume import ExactResume
from lit_spikes.callbacks.final_checkpoint import FinalCheckpoint
from lit_spikes.callbacks.lr_scaler import LRScaler
from lit_spikes.callbacks.preemption import PreemptionCheckpoint
from lit_spikes.callbacks.retention import CheckpointRetention
from lit_spikes.callbacks.rollback import RollbackRestore
from lit_spikes.callbacks.run_lock import AnotherHistory, RunDirectoryBusy, RunDirectoryLock
from lit_spikes.callbacks.skip_step import SkipStep
from lit_spikes.callbacks.spike import Episode, Spike
from lit_spikes.callbacks.spike_detector import SpikeDetector
from lit_spikes.callbacks.watch import Watcher

__all__ = [
    "AnotherHistory",
    "BatchSkipper",
    "CheckpointRetention",
    "ClipGradients",
    "Episode",
    "ExactResume",
    "FinalCheckpoint",
    "LRScaler",
    "PreemptionCheckpoint",
    "RollbackRestore",
    "RunDirectoryBusy",
    "RunDirectoryLock",
    "SkipStep",
    "Spike",
    "SpikeDetector",
    "TrainingCurves",
    "Watcher",
]
