"""Nothing that watches a run changes it (issue 53): with ExactResume the randomness of step
k is derived from (seed, k), as its batch is, so a module that draws everywhere (dropout,
augmentation in ``__getitem__``, its own hook, a validation that draws, clipping, an LR
warm-up) ends ``torch.equal`` in every tensor and logged loss whatever checkpoints and
validations watch it, and every file resumes that same run."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lit_spikes.callbacks.exact_resume as exact_resume
import lit_spikes.callbacks.module_generators as module_generators
from tests.modules.drawing_runs import (
    SITES,
    Ended,
    GeneratorNet,
    Watch,
    differences,
    fit_drawing,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:The number of training batches:UserWarning",  # Lightning's logging interval
)
WATCHES = {
    "a file every 2 steps": Watch(every=2),
    "a file every 5 steps": Watch(every=5),
    "validation every 3 steps": Watch(val_every=3),
    "validation every 4 steps, a file every 3": Watch(every=3, val_every=4),
    "a monitor checkpoint": Watch(val_every=2, monitor=True),
    "FinalCheckpoint": Watch(final=True, val_every=5),
    "2 workers, a file every 4 steps": Watch(every=4, workers=2),
}
PLAIN_WATCHES = {
    "a file every 2 steps": Watch(every=2, plain=True),
    "validation every 3 steps": Watch(val_every=3, plain=True),
}
"""On a plain DataLoader (no augmentation): the step's own seed alone keys its draws."""


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Ended:
    """The run nothing watches: no checkpoint, no validation."""
    return fit_drawing(tmp_path_factory.mktemp("alone"), Watch())


@pytest.mark.parametrize("name", sorted(WATCHES))
def test_watching_a_run_does_not_change_it(alone: Ended, tmp_path: Path, name: str) -> None:
    assert differences(alone, fit_drawing(tmp_path, WATCHES[name])) == [], name


@pytest.mark.parametrize("name", sorted(PLAIN_WATCHES))
def test_watching_a_run_on_a_plain_dataloader_does_not_change_it(tmp_path: Path, name: str) -> None:
    alone = fit_drawing(tmp_path / "alone", Watch(plain=True))
    assert differences(alone, fit_drawing(tmp_path / "watched", PLAIN_WATCHES[name])) == [], name


AUGMENTED_WATCHES = {
    "validation every 3 steps": Watch(val_every=3, plain_augmented=True),
    "validation every 4 steps, a file every 3": Watch(every=3, val_every=4, plain_augmented=True),
}
"""On a plain DataLoader whose dataset augments in this process (issue 62, case 1)."""


@pytest.fixture(scope="module")
def alone_augmented(tmp_path_factory: pytest.TempPathFactory) -> Ended:
    """The run nothing watches, on a plain DataLoader whose dataset augments."""
    return fit_drawing(tmp_path_factory.mktemp("alone-augmented"), Watch(plain_augmented=True))


@pytest.mark.parametrize("name", sorted(AUGMENTED_WATCHES))
def test_a_validation_does_not_change_a_plain_dataloader_that_augments(
    alone_augmented: Ended, tmp_path: Path, name: str
) -> None:
    """Lightning fetches step k's batch before ``on_train_batch_start``, from the state the
    step before left: its validation's draws reached the augmentation (12 of 16 tensors
    differed by up to 2.4e-2). ExactResume keeps a validation's draws to itself."""
    watched = fit_drawing(tmp_path, AUGMENTED_WATCHES[name])
    assert differences(alone_augmented, watched) == [], name


def test_a_monitor_checkpoint_does_not_change_a_plain_dataloader_that_augments(
    alone_augmented: Ended, tmp_path: Path
) -> None:
    """ModelCheckpoint on val_loss, validated every 2 steps, the files every 3: a run that
    keeps its best file is the run nothing watched."""
    watched = fit_drawing(tmp_path, Watch(every=3, val_every=2, monitor=True, plain_augmented=True))
    assert differences(alone_augmented, watched) == []


def test_without_the_isolation_a_validation_changes_a_plain_dataloader_that_augments(
    alone_augmented: Ended, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: the validation loop not wrapped, its draws reach the next
    step's augmentation."""
    monkeypatch.setattr(exact_resume, "isolate_validations", lambda trainer: lambda: None)
    watched = fit_drawing(tmp_path, Watch(val_every=3, plain_augmented=True))
    assert differences(alone_augmented, watched) != []


@pytest.mark.parametrize(("watch", "file"), [
    (Watch(every=3, val_every=2), "step=6.ckpt"),  # a file of a validating step
    (Watch(every=3, val_every=2), "step=9.ckpt"),
    (Watch(every=5, workers=2), "step=5.ckpt"),
])  # fmt: skip
def test_every_file_resumes_the_run_nothing_watched(
    alone: Ended, tmp_path: Path, watch: Watch, file: str
) -> None:
    fit_drawing(tmp_path / "first", watch)
    resumed = fit_drawing(tmp_path / "resumed", watch, ckpt=tmp_path / "first" / "every" / file)
    step = int(file.removeprefix("step=").removesuffix(".ckpt"))
    assert len(resumed.losses) == 12 - step
    assert differences(alone, resumed) == []


def test_a_validation_at_a_step_is_the_same_whichever_interval_brought_it(
    tmp_path: Path,
) -> None:
    """Validations every 3 and every 6 steps, with files every 2 steps or none: the
    validations at steps 6 and 12 are the same, to the bit (dropout left on, a sampled
    metric, the validation loader's base seed)."""
    runs = [
        fit_drawing(tmp_path / "3", Watch(val_every=3)),
        fit_drawing(tmp_path / "6", Watch(val_every=6, every=2, monitor=True)),
    ]
    assert sorted(runs[0].validations) == [3, 6, 9, 12] and sorted(runs[1].validations) == [6, 12]
    for step in (6, 12):
        pairs = zip(runs[0].validations[step], runs[1].validations[step], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), step


def test_the_files_of_a_monitor_checkpoint_and_final_checkpoint_resume_the_run(
    tmp_path: Path,
) -> None:
    """The best val_loss's file (written after its validation) and FinalCheckpoint's (at
    the end, off its interval) resume the run nothing watched; FinalCheckpoint's extends
    it to 16 steps."""
    watch = Watch(val_every=2, monitor=True, final=True)
    fit_drawing(tmp_path / "first", watch)
    (best,) = (tmp_path / "first" / "best").iterdir()
    alone_16 = fit_drawing(tmp_path / "alone", Watch(), steps=16)
    resumed = fit_drawing(tmp_path / "from-best", watch, steps=16, ckpt=best)
    assert differences(alone_16, resumed) == [], best.name
    final = tmp_path / "first" / "final" / "step=12.ckpt"
    extended = fit_drawing(tmp_path / "from-final", Watch(), steps=16, ckpt=final)
    assert len(extended.losses) == 4 and differences(alone_16, extended) == []


def test_without_the_per_step_seeds_a_validation_changes_the_run(
    alone: Ended, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: with ExactResume's derivation turned off, the validation's
    draws move the stream the next steps draw from (as in a plain Lightning run)."""
    monkeypatch.setattr(exact_resume, "seed_all", lambda seed: None)
    assert differences(alone, fit_drawing(tmp_path, Watch(val_every=3))) != []


def test_a_modules_own_generator_is_keyed_by_the_step_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``torch.Generator`` held by a submodule (drawn in training and in validation):
    watched and resumed, the same run. The negative control: with ExactResume blind to
    the module's generators, the resume draws from the generator as the new process built
    it."""
    watch = Watch(every=4, val_every=3)
    alone = fit_drawing(tmp_path / "alone", Watch(), module=GeneratorNet)
    assert differences(alone, fit_drawing(tmp_path / "run", watch, module=GeneratorNet)) == []
    file = tmp_path / "run" / "every" / "step=4.ckpt"
    resumed = fit_drawing(tmp_path / "resumed", watch, ckpt=file, module=GeneratorNet)
    assert differences(alone, resumed) == []
    with pytest.warns(UserWarning, match="only the checkpoint's run has a generator 'noise.gen'"):
        fit_drawing(tmp_path / "without", watch, ckpt=file)  # a module without it
    monkeypatch.setattr(module_generators, "module_generators", lambda module: {})
    blind = fit_drawing(tmp_path / "blind", watch, module=GeneratorNet)
    file = tmp_path / "blind" / "every" / "step=4.ckpt"
    again = fit_drawing(tmp_path / "again", watch, ckpt=file, module=GeneratorNet)
    assert differences(blind, again) != []


@st.composite
def watched(draw: st.DrawFn) -> tuple[Watch, int | None, frozenset[str], int | None]:
    every = draw(st.sampled_from([None, 2, 3, 5]))
    val_every = draw(st.sampled_from([None, 2, 3, 4]))
    resume_at = draw(st.sampled_from([None, *range(every, 12, every)])) if every else None
    sites = draw(st.frozensets(st.sampled_from(sorted(SITES)), min_size=1))
    sigterm_at = draw(st.sampled_from([None, *range(1, 12)]))  # validating steps or not
    return Watch(every=every, val_every=val_every), resume_at, sites, sigterm_at


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(watched())
def test_any_cadence_validation_resume_and_draw_sites_give_one_run(
    case: tuple[Watch, int | None, frozenset[str], int | None],
) -> None:
    """Resumes from the every-k files and from a SIGTERM's file (issue 54: at a validating
    step the file came before the validation, which the resume skipped)."""
    watch, resume_at, sites, sigterm_at = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        alone = fit_drawing(root / "alone", Watch(), sites=sites)
        ended = fit_drawing(root / "watched", watch, sites=sites)
        assert differences(alone, ended) == [], (watch, sites)
        if resume_at is not None:
            file = root / "watched" / "every" / f"step={resume_at}.ckpt"
            resumed = fit_drawing(root / "resumed", watch, ckpt=file, sites=sites)
            assert differences(alone, resumed) == [], (watch, resume_at, sites)
        if sigterm_at is not None:
            signaled = replace(watch, sigterm_at=sigterm_at)
            fit_drawing(root / "signaled", signaled, sites=sites)
            (file,) = (root / "signaled" / "preempted").iterdir()
            resumed = fit_drawing(root / "requeued", watch, ckpt=file, sites=sites)
            assert differences(alone, resumed) == [], (watch, sigterm_at, sites)
