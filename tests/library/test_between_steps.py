"""What runs between two steps (issue 62, case 4): ``ExactResume`` keys it where anything
of the user's can draw there (a module's or callback's ``on_train_batch_end``, a plain
loader's next read), so a watcher's draws reach none of it; where nothing can, it spends
no seed on it."""

from __future__ import annotations

from pathlib import Path

import pytest

import lit_spikes.callbacks.exact_resume as exact_resume
from lit_spikes.randomness import BETWEEN
from tests.modules.drawing_runs import (
    DrawingNet,
    EndDrawingNet,
    QuietEndNet,
    Watch,
    differences,
    fit_drawing,
)


def test_a_watcher_drawing_after_a_step_leaves_the_modules_own_draws_there(
    tmp_path: Path,
) -> None:
    """The module keeps a draw of its ``on_train_batch_end``; a callback listed before
    ExactResume draws from every RNG there: the run is the one nothing watched."""
    alone = fit_drawing(tmp_path / "alone", Watch(), module=EndDrawingNet)
    watched = fit_drawing(tmp_path / "watched", Watch(drawing_watcher=True), module=EndDrawingNet)
    assert differences(alone, watched) == []


def test_a_watcher_drawing_after_a_step_leaves_a_plain_loaders_next_read(tmp_path: Path) -> None:
    """A plain DataLoader augmenting in this process reads its next batch between two
    steps: a module with no hook there, and the watcher's draws reach none of it."""
    watch = Watch(plain_augmented=True)
    alone = fit_drawing(tmp_path / "alone", watch, module=QuietEndNet)
    watched = fit_drawing(
        tmp_path / "watched", Watch(plain_augmented=True, drawing_watcher=True), module=QuietEndNet
    )
    assert differences(alone, watched) == []


@pytest.mark.parametrize(
    ("module", "watch", "keyed"),
    [
        (QuietEndNet, Watch(every=4), False),  # a StepLoader, Lightning's callbacks only
        (EndDrawingNet, Watch(), True),  # the module's own hook
        (QuietEndNet, Watch(drawing_watcher=True), True),  # a callback of the user's
        (QuietEndNet, Watch(plain_augmented=True), True),  # a plain loader's next read
    ],
)
def test_the_stretch_between_steps_is_keyed_where_user_code_runs_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: type[DrawingNet], watch: Watch,
    keyed: bool,
) -> None:  # fmt: skip
    """The cost: a step of a StepLoader run with nothing of the user's after it sets the
    RNGs once, not twice (~25 us a step in a tiny step)."""
    domains: list[int] = []
    derive_in = exact_resume.derive_in

    def recording(seed: int, domain: int, *key: int) -> int:
        domains.append(domain)
        return derive_in(seed, domain, *key)

    monkeypatch.setattr(exact_resume, "derive_in", recording)
    fit_drawing(tmp_path, watch, module=module)
    assert domains.count(BETWEEN) == (12 if keyed else 0)
