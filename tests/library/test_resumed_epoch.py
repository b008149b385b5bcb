"""A resume at an epoch's start of a plain ``DataLoader`` whose dataset augments (issue 62,
case 2): the run that wrote the file builds that epoch's iterator after the epoch's
keying (its workers' base seed, a shuffle's order); the resumed fit builds its first one
before any epoch hook. ExactResume builds it anew where the run did, so the resume is the
run, ``torch.equal`` in every tensor and loss, with any workers, shuffled or not, with a
generator of the loader's own; persistent workers, whose streams go on from the epochs
before, are named before the first step with the fix."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import lit_spikes.callbacks.exact_resume as exact_resume
import lit_spikes.callbacks.resumed_epoch as resumed_epoch
from tests.modules.drawing_runs import Ended, EpochStartNet, Watch, differences, fit_drawing

pytestmark = pytest.mark.filterwarnings(
    "ignore:The number of training batches:UserWarning",  # Lightning's logging interval
    "ignore:.*does not have many workers:UserWarning",
)
EXACT = {
    "unshuffled": Watch(every=6, plain_augmented=True),
    "shuffled": Watch(every=6, plain_augmented=True, shuffle=True),
    "2 workers": Watch(every=6, plain_augmented=True, workers=2),
    "shuffled, its own generator": Watch(
        every=6, plain_augmented=True, shuffle=True, loader_generator=True
    ),
    "shuffled, 2 workers, its own generator": Watch(
        every=6, plain_augmented=True, shuffle=True, workers=2, loader_generator=True
    ),
}
"""Files every 6 steps, 6 steps an epoch: each is written at an epoch's last batch."""


def resumed_quietly(root: Path, watch: Watch, file: str) -> tuple[Ended, list[str]]:
    """The run resumed from its ``every/<file>``, and ExactResume's warnings."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = fit_drawing(
            root / "resumed", watch, steps=16, ckpt=root / "first" / "every" / file
        )
    return resumed, [str(w.message) for w in seen if "ExactResume" in str(w.message)]


@pytest.mark.parametrize("name", sorted(EXACT))
@pytest.mark.parametrize("file", ["step=6.ckpt", "step=12.ckpt"])
def test_a_resume_at_an_epochs_start_is_the_run(tmp_path: Path, name: str, file: str) -> None:
    watch = EXACT[name]
    first = fit_drawing(tmp_path / "first", watch, steps=16)
    resumed, said = resumed_quietly(tmp_path, watch, file)
    assert said == []
    assert differences(first, resumed) == [], name


def test_without_the_rebuild_a_resume_at_an_epochs_start_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: the first iterator left where Lightning built it, the
    epoch's reads come from what the resume left (and unwarned)."""
    monkeypatch.setattr(exact_resume, "rebuild_resumed_epoch", lambda *args: lambda: None)
    watch = EXACT["unshuffled"]
    first = fit_drawing(tmp_path / "first", watch, steps=16)
    resumed, said = resumed_quietly(tmp_path, watch, "step=6.ckpt")
    assert said == []
    assert differences(first, resumed) != []


def test_persistent_workers_resumed_at_an_epochs_start_are_named_with_the_fix(
    tmp_path: Path,
) -> None:
    """Their streams went on from epoch 0 in the run; a resume starts them anew: said
    before the first step, naming the loader, the setting and StepLoader (and true: the
    resumed run differs)."""
    watch = Watch(every=6, plain_augmented=True, workers=2, persistent=True)
    first = fit_drawing(tmp_path / "first", watch, steps=16)
    resumed, said = resumed_quietly(tmp_path, watch, "step=6.ckpt")
    assert len(said) == 1
    assert "DataLoader) keeps its 2 workers across epochs (persistent_workers=True)" in said[0]
    assert "fix: persistent_workers=False" in said[0] and "StepLoader" in said[0]
    assert differences(first, resumed) != []


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_file_before_an_epoch_end_validation_resumes_the_run_nothing_watched(
    tmp_path: Path, shuffle: bool
) -> None:
    """The file of step 6 comes before that step's validation: Lightning's restart builds
    the validation's iterator (its base seed drawn from torch's RNG) as it fetches the
    epoch's first batch; kept out of the epoch's reads, the resume is the run nothing
    watched."""
    watch = Watch(every=6, val_every=6, plain_augmented=True, shuffle=shuffle)
    alone = fit_drawing(tmp_path / "alone", Watch(plain_augmented=True, shuffle=shuffle), 16)
    fit_drawing(tmp_path / "first", watch, steps=16)
    resumed, said = resumed_quietly(tmp_path, watch, "step=6.ckpt")
    assert said == []
    assert differences(alone, resumed) == []


def test_a_file_of_a_step_validating_mid_epoch_resumes_at_the_next_epoch_as_the_run(
    tmp_path: Path,
) -> None:
    """Validations every 4 steps (mid-epoch and across): the file of step 12 (an epoch's
    last batch, whose validation came after it) resumes the run."""
    watch = Watch(every=6, val_every=4, plain_augmented=True)
    first = fit_drawing(tmp_path / "first", watch, steps=16)
    resumed, said = resumed_quietly(tmp_path, watch, "step=12.ckpt")
    assert said == []
    assert differences(first, resumed) == []


EPOCH_END = {
    "no validation": Watch(epoch_files=True, plain_augmented=True),
    "no validation, a StepLoader": Watch(epoch_files=True),
    "validated at the epoch's end": Watch(epoch_files=True, val_every=6, plain_augmented=True),
}
"""Lightning's default ModelCheckpoint: a file at each epoch's end (at its validation's
end where one runs at the epoch's last batch)."""


@pytest.mark.parametrize("name", sorted(EPOCH_END))
@pytest.mark.parametrize("max_epochs", [None, 3])
def test_a_file_of_an_epochs_end_resumes_the_run(
    tmp_path: Path, name: str, max_epochs: int | None
) -> None:
    """Lightning's restart from a file of an epoch's end under ``max_steps`` fetched and
    trained one batch more in that epoch (Lightning issue 19403: every tensor differed,
    the epochs shifted by a step), and counted the epoch processed twice (a ``max_epochs``
    run of 18 steps ended at 12, validated or not)."""
    watch = replace(EPOCH_END[name], max_epochs=max_epochs)
    steps = 100 if max_epochs else 16  # max_epochs=3: 18 steps
    first = fit_drawing(tmp_path / "first", watch, steps=steps)
    resumed = fit_drawing(
        tmp_path / "resumed", watch, steps=steps, ckpt=tmp_path / "first" / "every" / "step=6.ckpt"
    )
    assert len(resumed.losses) == len(first.losses) - 6
    assert differences(first, resumed) == []


def test_without_finishing_the_files_epoch_a_resume_trains_a_batch_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: Lightning's restart left alone, the file's epoch trains its
    first batch again."""
    monkeypatch.setattr(resumed_epoch, "finish_without_training", lambda *args: None)
    watch = EPOCH_END["no validation"]
    first = fit_drawing(tmp_path / "first", watch, steps=16)
    resumed = fit_drawing(
        tmp_path / "resumed", watch, steps=16, ckpt=tmp_path / "first" / "every" / "step=6.ckpt"
    )
    assert differences(first, resumed) != []


def epoch_counts(file: Path) -> Any:
    """The epoch counts of Lightning's fit loop a file holds."""
    return torch.load(file, weights_only=True)["loops"]["fit_loop"]["epoch_progress"]


@pytest.mark.parametrize("every", [6, None])
def test_the_resumed_runs_files_hold_the_runs_epoch_counts(
    tmp_path: Path, every: int | None
) -> None:
    """A file of an epoch's last batch (every 6 steps) or of its end: the resumed run's
    file of the next epoch holds the epoch counts the run's does (Lightning's restart
    counted the epoch it went on with neither ready nor started, or the file's epoch
    processed twice)."""
    watch = Watch(every=every, epoch_files=every is None, plain_augmented=True)
    fit_drawing(tmp_path / "first", watch, steps=16)
    fit_drawing(
        tmp_path / "resumed", watch, steps=16, ckpt=tmp_path / "first" / "every" / "step=6.ckpt"
    )
    run, resumed = (
        epoch_counts(tmp_path / r / "every" / "step=12.ckpt") for r in ("first", "resumed")
    )
    assert resumed == run


@pytest.mark.parametrize("every", [6, None])
def test_a_resumed_runs_file_resumes_the_run_again(tmp_path: Path, every: int | None) -> None:
    """Resumed twice under ``max_epochs=3`` (18 steps): from the run's file of step 6, then
    from the resumed run's of step 12, the run (the second resume trained 24 steps)."""
    watch = Watch(every=every, epoch_files=every is None, plain_augmented=True, max_epochs=3)
    first = fit_drawing(tmp_path / "first", watch, steps=100)
    fit_drawing(
        tmp_path / "second", watch, steps=100, ckpt=tmp_path / "first" / "every" / "step=6.ckpt"
    )
    third = fit_drawing(
        tmp_path / "third", watch, steps=100, ckpt=tmp_path / "second" / "every" / "step=12.ckpt"
    )
    assert len(third.losses) == 6
    assert differences(first, third) == []


@pytest.mark.parametrize("plain", [True, False])
def test_a_callbacks_epoch_start_the_restart_skips_runs(tmp_path: Path, plain: bool) -> None:
    """A file of an epoch's last batch: Lightning's restart begins the next epoch with no
    on_train_epoch_start; a callback that lowers the dropout there runs (the resumed
    epoch trained at the epoch before's dropout), plain loader or StepLoader."""
    watch = Watch(every=6, plain_augmented=plain, at_epoch_start="dropout")
    first = fit_drawing(tmp_path / "first", watch, steps=16)
    resumed, said = resumed_quietly(tmp_path, watch, "step=6.ckpt")
    assert said == []
    assert differences(first, resumed) == []


def test_an_accumulation_schedule_resumes_at_its_epoch(tmp_path: Path) -> None:
    """Lightning's GradientAccumulationScheduler sets epoch 1's accumulation at its start:
    resumed there, epoch 1 accumulates 2 batches a step, as the run did (it trained 1)."""
    watch = Watch(every=6, plain_augmented=True, at_epoch_start="accumulation")
    first = fit_drawing(tmp_path / "first", watch, steps=10)
    resumed = fit_drawing(
        tmp_path / "resumed", watch, steps=10, ckpt=tmp_path / "first" / "every" / "step=6.ckpt"
    )
    assert len(resumed.losses) == len(first.losses) - 6 == 8  # 4 steps of 2 batches
    assert differences(first, resumed) == []


def test_a_modules_own_epoch_start_the_restart_skips_is_named(tmp_path: Path) -> None:
    """The module's own on_train_epoch_start cannot be called outside Lightning's loop (it
    may log): named, and true (the resumed epoch trains at the epoch before's dropout)."""
    watch = Watch(every=6, plain_augmented=True)
    first = fit_drawing(tmp_path / "first", watch, steps=16, module=EpochStartNet)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ckpt = tmp_path / "first" / "every" / "step=6.ckpt"
        resumed = fit_drawing(
            tmp_path / "resumed", watch, steps=16, ckpt=ckpt, module=EpochStartNet
        )
    said = [str(w.message) for w in seen if "on_train_epoch_start" in str(w.message)]
    assert len(said) == 1
    assert "start of epoch 1 (global step 6)" in said[0]
    assert "EpochStartNet's own does not run for that epoch" in said[0]
    assert differences(first, resumed) != []
