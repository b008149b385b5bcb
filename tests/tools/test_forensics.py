"""The forensics replay (issue 67) on modules written for it (tests/modules/forensic_modules.py):
its instruments change nothing the run computes; a fault planted in one named layer is
named first, a poisoned batch shows the input side first, an LR jump moves every layer's
update at once; a replay that is not the run is refused; the reading's rules."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lit_spikes.callbacks import ExactResume
from lit_spikes.shared.training import quiet_branches, step_checkpoint
from lit_spikes.tools.cli import main as lit_spikes
from lit_spikes.tools.diagnose.run import Sources
from lit_spikes.tools.forensics import (
    Band,
    Exit,
    ForensicsConfig,
    LayerInstruments,
    ReplayNotExact,
    find_checkpoint,
    forensics,
    read,
    verdict_lines,
)
from tests.conftest import REPO
from tests.modules.forensic_modules import InputData, PlantedMLP, PlantedTower

STEPS, FAULT = 90, 80
TOWER = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
"""``PlantedTower``'s layers, found by its structure."""
CONFIG = ForensicsConfig(window=10, band_steps=20)
"""Bands from the replay's first 20 steps (from step=50.ckpt), the window 70-80."""


def train(
    root: Path, model: Callable[[], pl.LightningModule], data: Callable[[], Any], **extra: Any
) -> tuple[Path, pl.LightningModule, list[float]]:
    """A plain Lightning run of ``STEPS`` steps on one thread (as ``lit-spikes fit`` runs a
    user's module): ``ExactResume``, ``step=<k>.ckpt`` every 10 steps, the loss logged to
    TensorBoard every step. Its directory, its module and its losses."""
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *a: Any):
            losses.append(float(outputs["loss"]))

    callbacks = [ExactResume(), Losses(), step_checkpoint(root / "checkpoints", 10)]
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=TensorBoardLogger(root.parent, name=root.name, version=""),
        callbacks=[*callbacks, *extra.pop("callbacks", [])],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        **extra,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    module = model()
    try:
        with warnings.catch_warnings(), quiet_branches():
            warnings.simplefilter("ignore")
            trainer.fit(module, datamodule=data())
    finally:
        torch.set_num_threads(threads)
    return root, module, losses


def test_the_instruments_change_nothing_the_run_computes(tmp_path: Path) -> None:
    """The same run with every layer instrumented ends with every parameter and every
    loss ``torch.equal`` (SGD with momentum, a residual tower), and the instruments saw
    each layer at each step."""
    make = lambda: PlantedTower()  # noqa: E731
    _, plain, plain_losses = train(tmp_path / "plain", make, InputData)
    instruments = LayerInstruments()
    _, watched, losses = train(tmp_path / "watched", make, InputData, callbacks=[instruments])
    assert losses == plain_losses
    for (name, a), (_, b) in zip(
        plain.state_dict().items(), watched.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert list(instruments.layers) == TOWER
    stats = instruments.records[STEPS - 1]["blocks.2"]
    assert {"grad_norm", "update_norm", "state_momentum_buffer_norm", "act_kurtosis"} <= set(stats)
    assert stats["update_ratio"] == stats["update_norm"] / stats["weight_norm"]


CASES = {
    "mlp weights": (
        lambda: PlantedMLP("weights", "net.2", FAULT),
        InputData,
        80,
        "net.2",
        "forward",
    ),
    "mlp gradient": (
        lambda: PlantedMLP("grad", "net.2", FAULT, fault_factor=1000.0),
        InputData,
        84,
        "net.2",
        "backward",
    ),
    "mlp lr": (lambda: PlantedMLP("lr", "net.0", FAULT, 30.0), InputData, 81, None, "optimizer"),
    "mlp poisoned batch": (PlantedMLP, lambda: InputData(poison=[FAULT]), 80, "net.0", "forward"),
    "tower weights": (
        lambda: PlantedTower("weights", "blocks.2.up", FAULT),
        InputData,
        80,
        "blocks.2",
        "forward",
    ),
    "tower gradient": (
        lambda: PlantedTower("grad", "blocks.1.down", FAULT, 1000.0),
        InputData,
        81,
        "blocks.1",
        "backward",
    ),
    "tower lr": (lambda: PlantedTower("lr", "head", FAULT, 30.0), InputData, 81, None, "optimizer"),
    "tower poisoned batch": (
        PlantedTower,
        lambda: InputData(poison=[FAULT]),
        80,
        "embed",
        "forward",
    ),
}
"""Each planted fault: the module, the data, the loss onset the run's own detector flags
(ratio 2), the layer to be named first (None: every layer at once) and how it left."""


@pytest.mark.parametrize("case", list(CASES))
def test_a_planted_fault_is_named(tmp_path: Path, case: str) -> None:
    model, data, onset, origin, kind = CASES[case]
    run_dir, _, _ = train(tmp_path / "run", model, data)
    result = forensics(run_dir, onset, CONFIG, sources=Sources(model=model, data=data))
    assert result.ckpt_step == 50 and result.checked == list(range(50, onset + 6))
    assert (result.reading.origin, result.reading.kind) == (origin, kind), verdict_lines(result)
    assert result.reading.first_step == FAULT
    text = "\n".join(verdict_lines(result))
    assert f"at step {FAULT}, {onset - FAULT} step" in text and "to the bit" in text


def test_a_replay_that_is_not_the_run_is_refused(tmp_path: Path) -> None:
    """A replay given data the run did not train on (position 55 poisoned, which no
    checkpoint records) computes another loss there: refused by name, no per-layer numbers
    of another run."""
    run_dir, _, _ = train(tmp_path / "run", PlantedMLP, InputData)
    other = Sources(model=PlantedMLP, data=lambda: InputData(poison=[55]))
    with pytest.raises(ReplayNotExact, match=r"replayed loss at step 55 is .* the run logged"):
        forensics(run_dir, 80, CONFIG, sources=other)


def test_the_checkpoint_is_the_newest_early_enough(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "checkpoints"
    directory.mkdir(parents=True)
    for step in (10, 20, 30, 40):
        (directory / f"step={step}.ckpt").write_bytes(b"")
    assert find_checkpoint(tmp_path / "run", 55, 20).name == "step=30.ckpt"
    assert find_checkpoint(directory, 60, 20).name == "step=40.ckpt"
    with pytest.raises(ValueError, match=r"steps found: \[10, 20, 30, 40\]"):
        find_checkpoint(tmp_path / "run", 25, 20)
    with pytest.raises(ValueError, match="is neither a checkpoint nor a directory"):
        find_checkpoint(tmp_path / "typo", 55, 20)


def _exit(layer: str, stat: str, step: int = 7, value: float = 9.0) -> Exit:
    return Exit(layer, stat, step, value, Band(1.0, 0.1))


LAYERS = ["in", "mid", "out"]


@pytest.mark.parametrize(
    ("found", "origin", "kind"),
    [
        # a later layer's weights and every output after: the first forward one
        (
            [_exit("out", "act_std"), _exit("mid", "weight_norm"), _exit("in", "grad_norm")],
            "mid",
            "forward",
        ),
        # gradients alone: backward runs output first, so the last one is where it entered
        ([_exit("in", "grad_norm"), _exit("mid", "grad_norm")], "mid", "backward"),
        # every layer's update at once, nothing before it: the optimizer
        ([_exit(n, "update_norm") for n in LAYERS], None, "optimizer"),
        # one layer's update alone
        ([_exit("mid", "update_norm"), _exit("in", "update_norm", step=9)], "mid", "update"),
        ([], None, "none"),
    ],
)
def test_the_reading_follows_the_order_a_step_computes_in(
    found: list[Exit], origin: str | None, kind: str
) -> None:
    reading = read(sorted(found, key=lambda e: e.step), LAYERS)
    assert (reading.origin, reading.kind) == (origin, kind)


def test_a_band_has_a_floor_and_ignores_what_is_not_finite() -> None:
    from lit_spikes.tools.forensics.verdict import band_of

    flat = band_of([2.0] * 10, floor=0.1)
    assert flat is not None and flat.spread == pytest.approx(0.2)
    assert flat.distance(2.5) == pytest.approx(2.5) and flat.distance(float("nan")) == float("inf")
    assert band_of([1.0, float("nan"), 2.0], floor=0.1) is None  # two finite values


def _forensics_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``lit-spikes forensics`` in a new process, the tests' modules on its path."""
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "lit_spikes.tools.cli", "forensics", *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_the_command_on_a_users_fit_run(tmp_path: Path) -> None:
    """A ``lit-spikes fit`` run of the residual tower, its block 2 corrupted at step 80,
    read by ``lit-spikes forensics`` in a new process from the run's own record: the
    verdict on the terminal, a TensorBoard run per layer (a chart per statistic), the
    figure and the JSON; a window the files cannot serve is a usage error."""
    model = ["--model", "tests.modules.forensic_modules.PlantedTower", "--model.fault", "weights"]
    model += ["--model.fault_layer", "blocks.2.up", "--model.fault_step", str(FAULT)]
    fit = [*model, "--data", "tests.modules.forensic_modules.InputData"]
    fit += ["--trainer.max_steps", str(STEPS), "--checkpoint_every", "10"]
    fit += ["--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(tmp_path)]
    assert lit_spikes(["fit", *fit, "--trainer.enable_progress_bar", "false"]) is not None
    done = _forensics_cli("--run", str(tmp_path), "--spike_step", "80", "--window", "10")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "First: blocks.2 at step 80, 0 steps before the loss onset" in done.stdout
    assert "to the bit at all 26 steps" in done.stdout  # steps 60-85: step=60.ckpt is 20 before
    assert re.search(r"The replay took [\d.]+ s for 25 steps, [\d.]+ s of it in the", done.stdout)
    out = tmp_path / "forensics" / "step80"
    runs = {p.name for p in out.iterdir() if p.is_dir()}
    assert runs == {f"{i:02d}.{layer}" for i, layer in enumerate(TOWER)} | {"run", "summary"}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    block = EventAccumulator(str(out / "03.blocks.2"))
    block.Reload()
    assert {"forensics/weight_norm", "forensics/act_kurtosis"} <= set(block.Tags()["scalars"])
    saved = json.loads((out / "forensics.json").read_text())
    assert (saved["origin"], saved["kind"], saved["first_step"]) == ("blocks.2", "forward", 80)
    assert len(saved["series"]["blocks.2"]["grad_norm"]) == 26  # every step, every layer
    assert (out / "forensics.png").stat().st_size > 10_000
    late = _forensics_cli("--run", str(tmp_path), "--spike_step", "25")
    assert late.returncode == 2 and "steps found: [10, 20, 30" in late.stderr


@pytest.mark.slow
def test_the_demo_by_its_class_path(tmp_path: Path) -> None:
    """The demo's tiny GPT, fit by ``lit-spikes fit``: replayed to the bit, its layers
    found by structure (embeddings, each block, the final norm and head), its largest
    attention logit among the run's series."""
    from tests.conftest import TINY_CLI

    fit = [*TINY_CLI, "--model.optim.max_steps", "40", "--trainer.max_steps", "40"]
    fit += ["--checkpoint_every", "10", "--trainer.log_every_n_steps", "1"]
    assert lit_spikes(["fit", *fit, "--trainer.default_root_dir", str(tmp_path)]) is not None
    config = ForensicsConfig(window=5, band_steps=10)
    result = forensics(tmp_path, 35, config)
    assert result.ckpt_step == 20 and result.checked == list(range(20, 40))
    assert [n for n in result.layers if ".blocks." in n] == ["model.blocks.0", "model.blocks.1"]
    assert result.layers[0].startswith("model.") and ("(run)", "max_logit") in result.series


def test_every_logged_step_is_compared_to_the_bit() -> None:
    """Each replayed step the run logged is compared (NaN equal to NaN) and the last bit
    counts."""
    import math

    from lit_spikes.tools.forensics.run import _check_exact

    records = {5: {"loss": 1.5}, 6: {"loss": math.nan}, 7: {"loss": 2.0}}
    assert _check_exact(records, {5: 1.5, 6: math.nan}) == [5, 6]
    with pytest.raises(ReplayNotExact, match=re.escape("at step 7 is 2.0, the run logged 2.00000")):
        _check_exact(records, {5: 1.5, 7: math.nextafter(2.0, 3.0)})


def test_a_run_on_several_processes_is_refused_by_name(tmp_path: Path) -> None:
    """A file whose run trained on 2 processes (its ExactResume fingerprint says so): its
    logged loss is rank 0's rows', a replay in one process trains the whole batch; refused
    before any replay, naming the process count."""
    from lit_spikes.callbacks.exact_resume import STATE_KEY

    run_dir, _, _ = train(tmp_path / "run", PlantedMLP, InputData)
    path = run_dir / "checkpoints" / "step=50.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["callbacks"][STATE_KEY]["fingerprint"]["world_size"] = 2
    torch.save(checkpoint, path)
    replays = tmp_path / "replays"
    with pytest.raises(ReplayNotExact, match="trained on 2 processes"):
        sources = Sources(model=PlantedMLP, data=InputData)
        forensics(path, 80, CONFIG, sources=sources, log_root=replays)
    assert not (replays / "forensics").exists()  # no replay ran


def test_layers_can_be_named_and_a_wrong_name_is_refused() -> None:
    """``--layers``: the submodules named, in that order; a name the module lacks is an
    error naming what it has."""
    from lit_spikes.shared.layers import named_layers

    module = PlantedTower()
    assert list(named_layers(module, ["head", "blocks.1.up"])) == ["head", "blocks.1.up"]
    with pytest.raises(ValueError, match=r"\['blocks.9'\] are not submodules .*'embed'"):
        named_layers(module, ["blocks.9"])
