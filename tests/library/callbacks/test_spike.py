"""``Spike``: a flagged step is a frozen dataclass wherever it travels, a plain record in
the files (a checkpoint loads with ``weights_only``), and the records older versions wrote
read back as spikes. On a module written for the test (``DropoutRegressor``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from lit_spikes import StepLoader
from lit_spikes.callbacks import ExactResume, Spike, SpikeDetector
from lit_spikes.callbacks.spike_detector import describe_spike
from tests.library.callbacks.test_spike_detector import SPIKE, planted
from tests.modules.plain_runs import BATCH, train
from tests.modules.user_modules import DropoutRegressor


def test_a_flagged_step_is_a_frozen_spike_and_a_plain_record_in_the_file(tmp_path: Path) -> None:
    detector = SpikeDetector(monitor="loss", window=5, warmup=5, ratio=3.0)
    train(
        tmp_path,
        DropoutRegressor(),
        StepLoader(planted(), BATCH, seed=7),
        11,
        [detector, ExactResume()],
    )
    (spike,) = detector.spikes
    assert isinstance(spike, Spike) and (spike.step, spike.metric) == (SPIKE, "loss")
    assert spike.value > 3.0 * spike.reference and spike.rise == spike.value - spike.reference
    with pytest.raises(dataclasses.FrozenInstanceError):
        spike.step = 1  # type: ignore[misc]
    # Code written against the dicts reads it as one
    assert spike["step"] == SPIKE and dict(spike) == spike.to_dict() and "position" not in spike
    (record,) = detector.state_dict()["spikes"]
    assert type(record) is dict and record == {
        "step": SPIKE, "metric": "loss", "value": spike.value, "reference": spike.reference
    }  # fmt: skip
    torch.save(detector.state_dict(), tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    restored = SpikeDetector(monitor="loss", window=5, warmup=5, ratio=3.0)
    restored.load_state_dict(loaded)
    assert list(restored.spikes) == [spike] and isinstance(restored.spikes[0], Spike)


def test_the_records_older_versions_wrote_read_back_as_spikes() -> None:
    """The oldest held no ``reference``; a multi-process run's its ranks' values; a
    record may carry keys this version does not know (left out)."""
    detector = SpikeDetector(monitor="loss")
    old = [
        {"step": 4, "metric": "loss", "value": 9.0},
        {"step": 5, "metric": "loss", "value": math.nan, "reference": 1, "rank_values": [1, None]},
        {"step": 6, "metric": "loss", "value": 3.0, "reference": 1.0, "note": "kept elsewhere"},
    ]  # fmt: skip
    detector.load_state_dict({"spikes": old, "num_spikes": 3, "recent": {}, "seen": 7})
    first, second, third = detector.spikes
    assert first.step == 4 and math.isnan(first.reference) and first.rank_values is None
    assert second.rank_values == (1, None) and second.rise == math.inf
    assert third.to_dict() == {"step": 6, "metric": "loss", "value": 3.0, "reference": 1.0}
    assert "spike at step 4: 9.0000 against a reference of nan" in describe_spike(first)
    with pytest.raises(ValueError, match=r"needs \['value'\]"):
        Spike.of({"step": 1, "metric": "loss"})
