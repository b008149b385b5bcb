"""Every generator a module holds is keyed by the step (issue 62, case 3): a NumPy
``Generator`` or ``RandomState``, a ``random.Random``, a torch ``Generator`` in a list, a
dict or a tuple, or on a plain object the module holds. Watched and resumed, each module
is the run nothing watched, ``torch.equal`` in every tensor and loss (12 of 16 tensors
differed when only a torch ``Generator`` attribute was keyed). One made during the fit is
named, at the step it is found, with the fix."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import lit_spikes.callbacks.module_generators as module_generators
from lit_spikes.randomness import module_generators as search
from tests.modules.drawing_runs import Ended, Watch, differences, fit_drawing
from tests.modules.generator_nets import NETS, LateNet, LaterNet, Noise, SavedLateNet

pytestmark = pytest.mark.filterwarnings(
    "ignore:The number of training batches:UserWarning",  # Lightning's logging interval
)
WATCH = Watch(every=4, val_every=3)


def fit_saying(root: Path, net: type[LateNet], ckpt: Path | None = None) -> tuple[Ended, list[str]]:
    """``net`` trained watched by ``WATCH`` (from ``ckpt``), and ExactResume's warnings."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ended = fit_drawing(root, WATCH, ckpt=ckpt, module=net)
    return ended, [str(w.message) for w in seen if "ExactResume" in str(w.message)]


@pytest.mark.parametrize("holding", sorted(NETS))
def test_a_generator_held_any_way_is_keyed_by_the_step(tmp_path: Path, holding: str) -> None:
    net = NETS[holding]
    alone = fit_drawing(tmp_path / "alone", Watch(), module=net)
    watched, said = fit_saying(tmp_path / "run", net)
    resumed, said_again = fit_saying(tmp_path / "resumed", net, tmp_path / "run/every/step=4.ckpt")
    assert said == said_again == []
    assert differences(alone, watched) == []
    assert differences(alone, resumed) == []


@pytest.mark.parametrize("holding", ["a numpy Generator", "a torch.Generator on a plain object"])
def test_without_finding_it_a_resume_draws_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holding: str
) -> None:
    """The negative control: ExactResume blind to the module's generators, the resume
    draws from the generator as the new process built it."""

    monkeypatch.setattr(module_generators, "module_generators", lambda m: {})
    net = NETS[holding]
    run, _ = fit_saying(tmp_path / "run", net)
    resumed, _ = fit_saying(tmp_path / "resumed", net, tmp_path / "run/every/step=4.ckpt")
    assert differences(run, resumed) != []


def test_a_generator_made_in_a_step_is_named_with_the_fix(tmp_path: Path) -> None:
    """Made in the fit's first training_step, it drew unkeyed there: said at that step,
    with the fix; and true (a resume draws otherwise at its first step)."""
    run, said = fit_saying(tmp_path / "run", LateNet)
    assert len(said) == 1
    assert (
        "the module's torch.Generator 'late' appeared during the fit "
        "(found at the end of the fit's first batch, global step 1)" in said[0]
    )
    assert "create it in __init__ or setup" in said[0]
    resumed, _ = fit_saying(tmp_path / "resumed", LateNet, tmp_path / "run/every/step=4.ckpt")
    assert differences(run, resumed) != []


@pytest.mark.parametrize(
    ("net", "found"),
    [(LaterNet, "at epoch 1's start"), (SavedLateNet, "at the checkpoint of global step 4")],
)
def test_a_generator_made_later_is_named_where_it_is_found(
    tmp_path: Path, net: type[LateNet], found: str
) -> None:
    """Made in step 5's training_step, found at the next epoch's start (step 6); made in
    step 2's, found at the checkpoint of step 4, whose file names its seed: said there;
    and true (a resume, which makes it anew in its first step, draws otherwise)."""
    run, said = fit_saying(tmp_path / "run", net)
    assert len(said) == 1
    assert f"the module's torch.Generator 'late' appeared during the fit (found {found})" in said[0]
    state = torch.load(tmp_path / "run/every/step=4.ckpt", weights_only=True)["callbacks"]
    assert ("late" in state["ExactResume{}"]["generator_seeds_by_rank"][0]) == (net is SavedLateNet)
    resumed, _ = fit_saying(tmp_path / "resumed", net, tmp_path / "run/every/step=8.ckpt")
    assert differences(run, resumed) != []


def test_the_paths_a_search_names_and_where_it_stops() -> None:
    """By path, each generator once; not in a container of more than 64 items, nor past
    4 levels, nor inside torch's or Lightning's objects."""
    shared = torch.Generator()
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net.rngs = {"a": [shared, random.Random(1)]}  # type: ignore[assignment]
    net[0].helper = Noise(np.random.default_rng(1))  # type: ignore[assignment]
    net.again = shared  # type: ignore[assignment]
    net.many = [0.0] * 64 + [torch.Generator()]  # type: ignore[assignment]
    net.deep = [[[[[torch.Generator()]]]]]  # type: ignore[assignment]
    net.lightning = torch.optim.SGD(net.parameters(), lr=0.1)  # type: ignore[assignment]
    net.lightning.rng = torch.Generator()  # type: ignore[attr-defined]
    found = search(net)
    assert sorted(found) == ["0.helper.generator", "rngs['a'][0]", "rngs['a'][1]"]
    assert found["rngs['a'][0]"] is shared
