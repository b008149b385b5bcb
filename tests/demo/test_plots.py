"""``lit_spikes.demo.plots.plot_comparison``: a PNG of the expected size, and clear errors."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest

from lit_spikes.demo.plots import DPI, FIGSIZE, plot_comparison

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPECTED_SIZE = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))


def _history(
    steps: range, base: float, spike_at: int | None = None, height: float = 1.5
) -> list[dict[str, float]]:
    """A smoothly falling loss and rising max logit, with an optional spike in both."""
    records = []
    for step in steps:
        loss = base * math.exp(-step / 150) + 0.5
        logit = 5.0 + step * 0.8
        if spike_at is not None and spike_at <= step < spike_at + 10:
            loss *= height
            logit *= 3.0
        records.append({"step": step, "loss": loss, "max_logit": logit, "lr": 0.1})
    return records


def _png_size(data: bytes) -> tuple[int, int]:
    # The IHDR chunk comes first: length (4), b"IHDR" (4), width (4), height (4), ...
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture
def results() -> dict[str, list[dict[str, float]]]:
    return {
        "reference": _history(range(0, 400), 3.0, spike_at=150),
        "halve the LR": _history(range(100, 400), 2.6),
        "clipping at 1.0": _history(range(100, 400), 2.8, spike_at=160, height=1.2),
    }


@pytest.mark.parametrize("log_logit", [True, False])
def test_writes_a_png_of_the_fixed_size(
    results: dict[str, list[dict[str, float]]], tmp_path: Path, log_logit: bool
) -> None:
    target = tmp_path / "sub" / "remedies.png"
    written = plot_comparison(
        results,
        target,
        "Remedies from the step-100 checkpoint",
        ckpt_step=100,
        spike_window=(150, 160),
        log_logit=log_logit,
    )
    assert written == target and target.is_file()
    data = target.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert _png_size(data) == EXPECTED_SIZE == (1000, 700)


def test_marks_are_optional(tmp_path: Path) -> None:
    written = plot_comparison({"only": _history(range(5), 3.0)}, str(tmp_path / "a.png"), "one")
    assert _png_size(written.read_bytes()) == EXPECTED_SIZE


def test_empty_results_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"at least one row.*empty mapping"):
        plot_comparison({}, tmp_path / "empty.png", "nothing")
    assert not (tmp_path / "empty.png").exists()


def test_bad_rows_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="row 'b' has no records"):
        plot_comparison({"a": _history(range(3), 3.0), "b": []}, tmp_path / "x.png", "t")
    with pytest.raises(ValueError, match=r"record 1 of row 'a' lacks \['max_logit'\]"):
        records = [{"step": 0, "loss": 1.0, "max_logit": 2.0}, {"step": 1, "loss": 1.0}]
        plot_comparison({"a": records}, tmp_path / "x.png", "t")
    with pytest.raises(ValueError, match="spike_window"):
        plot_comparison(
            {"a": _history(range(3), 3.0)}, tmp_path / "x.png", "t", spike_window=(5, 2)
        )
    assert not (tmp_path / "x.png").exists()
