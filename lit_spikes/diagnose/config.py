"""How far the replays of a diagnosis go, and which data the other-data one leaves out."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_spikes.detector_config import DetectorConfig


@dataclass(frozen=True)
class DiagnoseConfig:
    """How far the replays go and which data the other-data replay leaves out."""

    window_before: int = 5
    """The other-data replay skips data positions from the spike's minus this ..."""
    window_after: int = 25
    """... to the spike's plus this (PaLM skipped a few hundred batches around a spike)."""
    horizon: int = 20
    """Replays train this many steps past the spike (a state-caused spike may move)."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """What counts as a spike in a replay (``min_step`` is ignored: the window decides).
    Its state in the checkpoint, where the run had a detector of these settings, goes on
    judging the replays; its ``monitor`` names what is judged: ``loss`` (what
    ``training_step`` returns), ``grad_norm`` or a name the module logs."""
    loss_tag: str | None = None
    """The TensorBoard tag of the loss the run logged, read for the original loss at the
    spike (None: the first the run's events hold of ``train/loss``, the detector's
    monitored names and ``loss``)."""

    def __post_init__(self) -> None:
        for name in ("window_before", "window_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"DiagnoseConfig.{name}={getattr(self, name)} must be >= 0")
        if self.horizon < 1:
            raise ValueError(f"DiagnoseConfig.horizon={self.horizon} must be >= 1")
