"""The world, the tokenizer and step-indexed data."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lit_spikes.demo.data import DataConfig, StepDataModule, position_of_step
from lit_spikes.demo.world import ALPHABET, CharTokenizer, WorldConfig, build_world
from tests.conftest import TINY_DATA


def test_world_is_deterministic_and_in_the_alphabet() -> None:
    a, b = build_world(WorldConfig(num_chars=5_000)), build_world(WorldConfig(num_chars=5_000))
    assert a.text == b.text
    assert build_world(WorldConfig(seed=1, num_chars=5_000)).text != a.text
    assert set(a.text) <= set(ALPHABET)
    assert a.train_text() + a.val_text() == a.text
    assert a.train_text().endswith("\n") and len(a.val_text()) > 0


def test_default_world_size() -> None:
    world = build_world()
    assert 300_000 < len(world.text) < 500_000
    assert len(world.val_text()) == pytest.approx(0.1 * len(world.text), rel=0.01)


def test_tokenizer_round_trip_and_bad_character() -> None:
    tokenizer = CharTokenizer()
    assert (
        tokenizer.decode(tokenizer.encode("ada lives near the mill.\n"))
        == "ada lives near the mill.\n"
    )
    with pytest.raises(ValueError, match=r"character 'A' at position 4 is not in"):
        tokenizer.encode("ada Ada")


def test_world_config_is_validated() -> None:
    with pytest.raises(ValueError, match=r"num_people=1"):
        WorldConfig(num_people=1)
    with pytest.raises(ValueError, match=r"val_fraction=0\.7"):
        WorldConfig(val_fraction=0.7)
    with pytest.raises(ValueError, match=r"DataConfig.batch_size=0"):
        DataConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"skip position -2"):
        DataConfig(skip=(-2,))


def test_position_of_step_jumps_over_the_skip_set() -> None:
    skip = (2, 3, 7)
    positions = [position_of_step(s, skip) for s in range(8)]
    assert positions == [0, 1, 4, 5, 6, 8, 9, 10]
    assert position_of_step(5, ()) == 5


def test_batch_of_step_is_a_pure_function_of_seed_and_step() -> None:
    first = StepDataModule(TINY_DATA).stream(0)
    later = StepDataModule(TINY_DATA).stream(5)
    batches = [b for _, b in zip(range(8), first, strict=False)]
    assert torch.equal(batches[5]["x"], next(iter(later))["x"])
    assert int(batches[5]["position"]) == 5
    other = next(iter(StepDataModule(replace(TINY_DATA, seed=TINY_DATA.seed + 1)).stream(5)))
    assert not torch.equal(other["x"], batches[5]["x"])
    # targets are the inputs shifted by one character
    assert torch.equal(batches[0]["x"][:, 1:], batches[0]["y"][:, :-1])


def test_skipped_positions_are_never_served() -> None:
    dm = StepDataModule(replace(TINY_DATA, skip=(1, 2)))
    plain = StepDataModule(TINY_DATA).stream(0)
    plain_batches = [b["x"] for _, b in zip(range(5), plain, strict=False)]
    served = [b for _, b in zip(range(3), dm.stream(0), strict=False)]
    assert [int(b["position"]) for b in served] == [0, 3, 4]
    assert torch.equal(served[1]["x"], plain_batches[3])


def test_shards_of_a_step_make_up_the_global_batch() -> None:
    dm = StepDataModule(TINY_DATA)
    whole = next(iter(dm.stream(3)))["x"]
    halves = [next(iter(dm.stream(3, rank=r, world_size=2)))["x"] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), whole)


def test_poisoned_position_is_random_characters() -> None:
    dm = StepDataModule(replace(TINY_DATA, poison=(2,)))
    clean = StepDataModule(TINY_DATA)
    poisoned = [b["x"] for _, b in zip(range(3), dm.stream(0), strict=False)]
    normal = [b["x"] for _, b in zip(range(3), clean.stream(0), strict=False)]
    assert torch.equal(poisoned[1], normal[1]) and not torch.equal(poisoned[2], normal[2])


def test_datamodules_of_one_world_share_its_tokens_built_once() -> None:
    from lit_spikes.demo.data import world_tokens

    first, second = StepDataModule(TINY_DATA), StepDataModule(replace(TINY_DATA, seed=9))
    first.setup("fit")
    second.setup("fit")
    assert first.train_tokens is second.train_tokens  # built and encoded once (45 ms)
    other = StepDataModule(replace(TINY_DATA, world=replace(TINY_DATA.world, seed=1)))
    other.setup("fit")
    assert not torch.equal(other.train_tokens[:1000], first.train_tokens[:1000])
    assert world_tokens.cache_info().currsize <= 4


def test_a_cpu_batch_is_not_walked_for_a_cpu_run(tmp_path: Path) -> None:
    """StepDataModule hands a CPU batch to a CPU run as it is (Lightning's walk would only
    call .to() on each tensor), without a warning about who moves batches; for another
    device it moves it as Lightning does."""
    import warnings

    from tests.conftest import fit

    datamodule = StepDataModule(DataConfig())
    batch = datamodule.loader.batch_of_step(0)
    assert datamodule.transfer_batch_to_device(batch, torch.device("cpu"), 0) is batch
    moved = datamodule.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved is not batch and all(v.device.type == "meta" for v in moved.values())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*transfer_batch_to_device.*")
        fit(tmp_path, "run", 2)


def _trainer(**settings: object) -> pl.Trainer:
    defaults: dict[str, object] = {
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**(defaults | settings))  # type: ignore[arg-type]


def test_a_fit_only_epochs_would_end_is_refused_before_any_step() -> None:
    """The stream has no end, so neither has an epoch: Trainer(max_epochs=1) without
    max_steps trained forever."""
    from lit_spikes.demo.module import TinyGPTModule
    from tests.conftest import TINY_GPT, TINY_OPTIM

    module, data = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM), StepDataModule(TINY_DATA)
    with pytest.raises(ValueError, match=r"never ends .* Trainer\(max_steps=\.\.\.\)"):
        _trainer(max_epochs=1, limit_val_batches=0).fit(module, datamodule=data)
    assert module.history == []
    # Epochs of an int limit_train_batches do end, and go on with the next steps' data.
    _trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=0).fit(
        module, datamodule=StepDataModule(TINY_DATA)
    )
    assert [int(r["position"]) for r in module.history] == [0, 1, 2, 3, 4, 5]


def test_a_validation_at_an_epochs_end_that_never_comes_warns() -> None:
    from lit_spikes.demo.module import TinyGPTModule
    from tests.conftest import TINY_GPT, TINY_OPTIM

    module = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    with pytest.warns(UserWarning, match="this fit will not validate. Give val_check_interval"):
        _trainer(max_steps=2).fit(module, datamodule=StepDataModule(TINY_DATA))


def test_load_from_checkpoint_gives_the_data_module_the_run_trained_with(tmp_path: Path) -> None:
    """Not Lightning's default-built one (this data module saves no hyperparameters)."""
    from lit_spikes.callbacks import BatchSkipper
    from tests.conftest import fit

    data = replace(TINY_DATA, seed=3)
    run = fit(tmp_path, "run", 6, checkpoint_every=6, data=data, callbacks=[BatchSkipper([4])])
    ckpt = tmp_path / "run" / "checkpoints" / "step=6.ckpt"
    loaded = StepDataModule.load_from_checkpoint(ckpt)
    assert loaded.config == data and loaded.skip == run.datamodule.skip == (4,)
    with pytest.warns(UserWarning, match="data seed 3, this run uses 5"):
        other = StepDataModule.load_from_checkpoint(ckpt, config=replace(data, seed=5))
    assert other.config.seed == 5
    with pytest.raises(TypeError, match=r"config= only, not \['hparams_file', 'seed'\]"):
        StepDataModule.load_from_checkpoint(ckpt, hparams_file="h.yaml", seed=2)


def test_a_time_based_validation_interval_trains_and_validates() -> None:
    """Lightning sets no val_check_interval for one in time: the check must not need it."""
    from lit_spikes.demo.module import TinyGPTModule
    from tests.conftest import TINY_GPT, TINY_OPTIM

    module = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    trainer = _trainer(max_steps=3, val_check_interval={"seconds": 3600}, limit_val_batches=1)
    trainer.fit(module, datamodule=StepDataModule(TINY_DATA))
    assert len(module.history) == 3
    with pytest.warns(UserWarning, match="check_val_every_n_epoch=2 validates"):
        _trainer(max_steps=2, val_check_interval=1, check_val_every_n_epoch=2).fit(
            TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM), datamodule=StepDataModule(TINY_DATA)
        )
