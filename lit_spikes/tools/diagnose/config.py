"""How far the replays of a diagnosis go, which data the other-data one leaves out, and
what judges them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lit_spikes.tools.detector_config import DetectorConfig
from lit_spikes.tools.fit_defaults import check_num_threads
from lit_spikes.tools.judgement import RECURRENCE, check_bar


@dataclass(frozen=True)
class DiagnoseConfig:
    """How far the replays go and which data the other-data replay leaves out."""

    window_before: int = 5
    """The other-data replays skip data positions from the spike's minus this ..."""
    window_after: int = 25
    """... to the spike's plus this (PaLM skipped a few hundred batches around a spike),
    and each further one a window's length more: another stretch of data trains the
    spike's step in each."""
    windows: int = 3
    """Other-data replays: the verdict is the median of their rise ratios, so one replay
    that happens upon another bad batch, or upon a quiet stretch, does not decide."""
    horizon: int = 20
    """Replays train this many steps past the spike (a state-caused spike may move), never
    past the run's end (its config.yaml's or ledger's max_steps, a OneCycleLR's steps)."""
    detector: DetectorConfig | None = None
    """What counts as a spike in a replay (``min_step`` is ignored: the window decides).
    None: the run's own SpikeDetector, rebuilt from its record in the checkpoint (its
    settings and state), else the defaults. A detector the checkpoint holds the state of
    goes on from it; its ``monitor`` names what is judged: ``loss`` (what
    ``training_step`` returns), ``grad_norm`` or a name the module logs."""
    loss_tag: str | None = None
    """The TensorBoard tag of the loss the run logged, read for the original loss at the
    spike (None: the first the run's events hold of ``train/loss``, the judging
    detector's monitored names and ``loss``)."""
    recurrence: float = RECURRENCE
    """The bar of the judgement (``lit_spikes.tools.judgement``): an other-data replay
    brings the spike back where the loss (or the flagged name) rises over its median at
    least this share of the spike's own rise (same data); a smaller bump does not."""
    exact_resume: bool = True
    """Replay with ``ExactResume`` (the RNG states the checkpoint holds, StepLoader
    seeking) where neither the module nor the run's callbacks bring one; False: as given."""
    seed: int | None = 0
    """``seed_everything`` before each replay's module is built, so that a replay's draws
    the checkpoint does not fix are the same every time (None: not seeded)."""
    num_threads: int | None = 1
    """torch's intra-op threads while a replay trains, as ``fit`` sets them for a user's
    module: one thread is as fast as several on a small model on a busy machine, and the
    same every time (None: as the process has them; the built-in model sets its own)."""

    def __post_init__(self) -> None:
        check_num_threads(self.num_threads, "DiagnoseConfig")
        if isinstance(self.detector, Mapping):  # a config file's or the command line's
            object.__setattr__(self, "detector", DetectorConfig(**self.detector))
        for name in ("window_before", "window_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"DiagnoseConfig.{name}={getattr(self, name)} must be >= 0")
        if self.horizon < 1:
            raise ValueError(f"DiagnoseConfig.horizon={self.horizon} must be >= 1")
        if self.windows < 1:
            raise ValueError(f"DiagnoseConfig.windows={self.windows} must be >= 1")
        check_bar(self.recurrence, "DiagnoseConfig.recurrence")
