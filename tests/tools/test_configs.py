"""The YAML configs under ``configs/``: each one trains through ``lit-spikes fit --config``
(shrunk to a tiny run), with the callbacks and settings it names, and each remedy is the
reference plus exactly its one change."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.callbacks import Callback

from lit_spikes.tools.cli import build_cli, main

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
RECOVER = CONFIG_DIR / "recover.yaml"
"""The one config for `lit-spikes recover` (RecoverConfig fields); the others are `fit`'s."""
CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if p != RECOVER)
EXPECTED = {"reference", "scale_lr", "clip", "skip_data", "qk_norm"}

TINY_OVERRIDES = [
    *("--model.gpt.n_layer", "1", "--model.gpt.d_model", "16", "--model.gpt.n_head", "2"),
    *("--model.gpt.block_size", "16", "--data.config.block_size", "16"),
    *("--data.config.batch_size", "4", "--data.config.world.num_chars", "20000"),
    *("--trainer.max_steps", "3", "--trainer.limit_val_batches", "0"),
    *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
    *("--checkpoint_every", "0"),
]

REMEDY_CHANGES: dict[str, dict[str, Any]] = {
    "scale_lr": {
        "trainer.callbacks": [
            "lit_spikes.callbacks.SpikeDetector",
            {
                "class_path": "lit_spikes.callbacks.LRScaler",
                "init_args": {"factor": 0.5, "start_step": 100},
            },
        ]
    },
    "clip": {"trainer.gradient_clip_val": 1.0},
    "skip_data": {
        "trainer.callbacks": [
            "lit_spikes.callbacks.SpikeDetector",
            {
                "class_path": "lit_spikes.callbacks.BatchSkipper",
                "init_args": {"ranges": [[120, 150]]},
            },
        ]
    },
    "qk_norm": {"model.gpt.qk_norm": True},
}
"""What each remedy adds to reference.yaml (a callbacks entry by class path alone: as in
the reference)."""


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _class(class_path: str) -> type[Callback]:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI warns when it gets `args` while sys.argv holds pytest's own arguments.
    monkeypatch.setattr("sys.argv", ["lit-spikes"])


def test_the_expected_configs_exist() -> None:
    assert {p.stem for p in CONFIGS} >= EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_has_a_header_with_its_command(path: Path) -> None:
    text = path.read_text()
    assert text.startswith(f"# {path.name}:")
    assert f"lit-spikes fit --config configs/{path.name}" in text


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_trains_through_the_cli(path: Path, tmp_path: Path) -> None:
    raw = _load(path)
    args = ["fit", "--config", str(path), *TINY_OVERRIDES]
    cli = main([*args, "--trainer.default_root_dir", str(tmp_path)])
    trainer = cli.trainer
    assert trainer.global_step == 3
    assert [int(r["step"]) for r in cli.model.history] == [0, 1, 2]
    configured = raw["trainer"].get("callbacks") or []
    assert configured, f"{path.name} configures no callbacks"
    for entry in configured:
        cls = _class(entry["class_path"])
        matching = [c for c in trainer.callbacks if isinstance(c, cls)]
        assert len(matching) == 1, f"{entry['class_path']} not in {trainer.callbacks}"
        for name, value in (entry.get("init_args") or {}).items():
            if name == "ranges":  # BatchSkipper expands its ranges into its skip set
                expected = tuple(p for start, end in value for p in range(start, end))
                assert matching[0].skip == expected
                assert cli.datamodule.skip == expected  # fed to the DataModule in setup
            else:
                assert getattr(matching[0], name) == value, name
    assert trainer.gradient_clip_val == raw["trainer"].get("gradient_clip_val")
    assert cli.model.model_config.qk_norm is raw["model"]["gpt"]["qk_norm"]
    assert (tmp_path / "config.yaml").is_file()  # LightningCLI saved the config it ran


def _parsed(args: list[str], root: Path) -> dict[str, Any]:
    cli = build_cli([*args, "--trainer.default_root_dir", str(root)], run=False)
    config = cli.config.as_dict()
    for key in ("config", "__path__"):
        config.pop(key, None)
    config["trainer"].pop("callbacks")
    return _flatten(config)


def test_reference_is_the_cli_default(tmp_path: Path) -> None:
    reference = CONFIG_DIR / "reference.yaml"
    assert _parsed(["--config", str(reference)], tmp_path) == _parsed([], tmp_path)
    detectors = _load(reference)["trainer"]["callbacks"]
    assert [d["class_path"] for d in detectors] == ["lit_spikes.callbacks.SpikeDetector"]


@pytest.mark.parametrize("name", sorted(REMEDY_CHANGES))
def test_remedy_is_the_reference_plus_one_change(name: str) -> None:
    reference = _flatten(_load(CONFIG_DIR / "reference.yaml"))
    remedy = _flatten(_load(CONFIG_DIR / f"{name}.yaml"))
    expected = dict(reference)
    expected["trainer.default_root_dir"] = f"runs/configs/{name}"
    for key, value in REMEDY_CHANGES[name].items():
        if key == "trainer.callbacks":
            detector = reference["trainer.callbacks"][0]
            value = [detector if v == "lit_spikes.callbacks.SpikeDetector" else v for v in value]
        expected[key] = value
    assert remedy == expected


def test_recover_config_runs_through_the_recover_command(tmp_path: Path) -> None:
    """configs/recover.yaml parses into the default RecoverConfig (plus the comparison rows)
    and runs: shrunk to a few steps by the command's own flags."""
    import yaml

    from lit_spikes.tools.recover import RecoverConfig

    raw = yaml.safe_load(RECOVER.read_text())
    expected = RecoverConfig(compare=True).to_dict()
    expected.pop("log_root")
    assert raw == expected
    result = main(
        [
            "recover",
            "--config",
            str(RECOVER),
            "--log_root",
            str(tmp_path),
            "--max_steps",
            "6",
            "--checkpoint_every",
            "2",
            "--val_every",
            "6",
            "--fresh",
        ]
    )
    assert result is not None and result.ledger.status == "done"
    assert [int(r["step"]) for r in result.lineage if "loss" in r] == list(range(6))
