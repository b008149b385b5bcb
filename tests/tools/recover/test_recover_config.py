"""``lit-spikes recover``'s configuration, command line and log root: bad values and
bad directories refused by name before anything is trained or deleted."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lit_spikes.tools.cli import main as cli_main
from lit_spikes.tools.recover import (
    HISTORY_NAME,
    LEDGER_NAME,
    RecoverConfig,
    RecoveryLoop,
    read_history,
    read_ledger,
)
from tests.conftest import (
    TINY_GPT,
    lock_probe,
)
from tests.modules.recover_setup import (
    RUNGS,
    ladder,
    tiny_config,
)

ROOT = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"ladder": (*ladder("skip_data"), "pray")},
            r"ladder='pray' is not a class path",
        ),
        ({"names": ("clip", "clip")}, r"ladder=\['clip', 'clip'\]: .* each class once"),
        ({"ladder": ()}, r"ladder=\[\]"),
        ({"rung_options": {"lr_factor": 1.5}}, r"LRScaler .*: factor must be in \(0, 1\)"),
        ({"checkpoint_every": 0}, r"checkpoint_every=0 must be >= 1"),
        ({"rollback_distance": -1}, r"rollback_distance=-1 must be >= 1"),
        ({"rollback_distance": 0}, r"rollback_distance=0 must be >= 1: the checkpoint of"),
        (
            {"ladder": [{"class_path": RUNGS["clip"], "init_args": {"value": 0.0}}]},
            r"ClipGradients {'value': 0.0}: value must be > 0",
        ),
        ({"max_steps": 0}, r"max_steps=0 must be >= 1"),
        ({"val_every": 25}, r"val_every=25 must be None or divide the run's 60 steps"),
        ({"gpt": replace(TINY_GPT, block_size=64)}, r"gpt.block_size=64 and data.block_size=16"),
        ({"ladder": ("scale_lr",)}, r"'scale_lr' is now named by its class: 'lit_spikes"),
        ({"compare": "qk"}, r"compare=\['qk'\]: give true, false or some of \['do_nothing'"),
        ({"compare": ("qk_norm", "qk_norm")}, r"compare=\['qk_norm', 'qk_norm'\]: .* each once"),
    ],
)
def test_config_rejects_bad_values(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, **changes)


@pytest.mark.parametrize(
    ("flag", "rows"),
    [
        ("false", ()),
        ("true", ("do_nothing", "qk_norm")),
        ("do_nothing", ("do_nothing",)),
        ("[qk_norm, do_nothing]", ("do_nothing", "qk_norm")),  # in the report's order
    ],
)
def test_compare_takes_true_or_the_rows_by_name(flag: str, rows: tuple[str, ...]) -> None:
    from lit_spikes.tools.recover import parse

    config = parse(["--compare", flag])[0]
    assert config.compare_rows == rows
    assert RecoverConfig.from_dict(config.to_dict()) == config  # as a ledger holds it


def test_config_round_trips_through_json(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    again = RecoverConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    with pytest.raises(ValueError, match=r"unknown RecoverConfig keys \['ladders'\]"):
        RecoverConfig.from_dict({"ladders": ["clip"]})


def test_cli_recover_help_lists_every_field_with_its_docstring(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dataclasses import fields

    from lit_spikes.tools.recover import DetectorConfig

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["recover", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for cls, prefix in ((RecoverConfig, "--"), (DetectorConfig, "--detector.")):
        for f in fields(cls):
            if f.name == "detector":
                continue
            assert f"{prefix}{f.name}" in text, f.name
    for said in ("Every branch writes ``step=<k>.ckpt`` every this many steps.", "--fresh"):
        assert said in text
    for option in ("--model CONFIG | CLASS_PATH_OR_NAME", "--data CONFIG | CLASS_PATH_OR_NAME"):
        assert option in text


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--checkpoint-every", "10"], "did you mean --checkpoint_every?"),
        (["--log-root", "x"], "did you mean --log_root?"),
        (["--checkpoint_every", "0"], "RecoverConfig.checkpoint_every=0 must be >= 1"),
        (
            [
                "--ladder",
                '[{"class_path": "lit_spikes.callbacks.LRScaler", "init_args": {"factor": 2}}]',
            ],
            "factor must be in (0, 1)",
        ),
        (
            ["--model", "tests.modules.spiky_modules.JumpRegressor"],
            "max_steps is required for model",
        ),
    ],
    ids=["typo", "old-spelling", "refused", "rung-option", "needs-max-steps"],
)
def test_a_cli_mistake_gets_two_lines(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["recover", *argv])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("usage: lit-spikes recover")
    assert lines[1].startswith("lit-spikes recover: error:") and said in lines[1], lines


def test_print_config_round_trips_through_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lit_spikes.tools.recover import parse

    argv = [
        "--model.init_args.optim.peak_lr",
        "0.05",
        "--data.init_args.config.seed",
        "3",
        "--checkpoint_every",
        "25",
        "--detector.ratio",
        "2.5",
        "--ladder",
        '["lit_spikes.callbacks.LRScaler"]',
    ]
    config, _ = parse(argv)
    assert config.model["init_args"]["optim"]["peak_lr"] == 0.05
    assert config.data["init_args"]["config"]["seed"] == 3
    assert config.model["init_args"]["optim"]["warmup_steps"] == 100  # filled in
    assert (config.checkpoint_every, config.detector.ratio) == (25, 2.5)
    assert config.ladder == ({"class_path": RUNGS["scale_lr"], "init_args": {"factor": 0.5}},)
    with pytest.raises(SystemExit):
        parse([*argv, "--print_config"])
    path = tmp_path / "recover.yaml"
    path.write_text(capsys.readouterr().out)
    assert parse(["--config", str(path)])[0] == config
    assert parse(["--config", str(ROOT / "configs" / "recover.yaml")])[0] == RecoverConfig(
        compare=True
    )


def test_recover_takes_any_model_and_data_by_class_path() -> None:
    from lit_spikes.tools.recover import parse

    config, _ = parse(
        [
            "--model",
            "tests.modules.spiky_modules.JumpRegressor",
            "--model.init_args.jump_step",
            "30",
            "--data",
            "tests.modules.spiky_modules.StepRegressionData",
            "--data.init_args.poison",
            "[30]",
            "--max_steps",
            "60",
            "--val_every",
            "null",
        ]
    )
    assert config.model["class_path"] == "tests.modules.spiky_modules.JumpRegressor"
    assert config.model["init_args"]["jump_step"] == 30
    assert config.data["init_args"]["poison"] == [30]
    assert (config.steps, config.val_every) == (60, None)


def test_fresh_refuses_a_directory_that_is_no_log_root_and_deletes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--fresh clears a log root: pointed at another directory (a typo, `runs`, `.`), it
    must not wipe it."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "important.txt").write_text("data")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["recover", "--log_root", str(tmp_path), "--fresh"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--fresh would delete everything in {tmp_path}, but it holds no ledger.json" in err
    assert "important.txt, sub" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["important.txt", "sub"]


def test_a_first_start_refuses_a_directory_with_files_and_deletes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --fresh too: a new loop restarts (deletes) its branch directories, and a
    directory that holds no ledger is not a loop's."""
    notes = tmp_path / "base" / "my_notes.txt"
    notes.parent.mkdir()
    notes.write_text("data")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["recover", "--log_root", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{tmp_path} holds no ledger.json but 1 entries (base)" in capsys.readouterr().err
    assert notes.read_text() == "data"


def test_log_root_comes_from_the_config_file_unless_the_flag_gives_one(tmp_path: Path) -> None:
    from lit_spikes.tools.recover import parse

    config_file = tmp_path / "recover.yaml"
    config_file.write_text(f"log_root: {tmp_path / 'from_file'}\n")
    assert parse(["--config", str(config_file)])[0].log_root == tmp_path / "from_file"
    flag = ["--config", str(config_file), "--log_root", str(tmp_path / "flag")]
    assert parse(flag)[0].log_root == tmp_path / "flag"
    assert parse([])[0].log_root == RecoverConfig().log_root
    assert parse(["--val_every", "null"])[0].val_every is None


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("yaml", "Problems parsing config: while parsing a flow mapping"),
        ("list", "Unexpected config: - 1 2"),
        ("ledger_version", "ledger.json has format version 1; this lit-spikes reads version 2"),
        ("ledger_torn", "is unreadable"),
        ("file_root", "is a file, not a directory"),
        ("gpt_list", "RecoverConfig model.init_args.gpt: [1, 2] is not a mapping of its fields"),
    ],
)
def test_recover_bad_input_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, message: str
) -> None:
    config, root = tmp_path / "recover.yaml", tmp_path / "root"
    config.write_text("max_steps: 20\nval_every: 10\n")
    root.mkdir()
    if setup == "yaml":
        config.write_text("gpt: {n_layer: 2\n")
    elif setup == "list":
        config.write_text("- 1\n- 2\n")
    elif setup == "ledger_version":
        (root / LEDGER_NAME).write_text('{"version": 1}')
    elif setup == "ledger_torn":
        (root / LEDGER_NAME).write_text('{"version": 2, "config": {')
    elif setup == "file_root":
        root.rmdir()
        root.write_text("not a directory")
    elif setup == "gpt_list":
        config.write_text(
            "model: {init_args: {gpt: [1, 2]}, class_path: lit_spikes.demo.module.TinyGPTModule}\n"
        )
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["recover", "--config", str(config), "--log_root", str(root)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_ledger_or_history_of_an_unknown_format_version_is_refused_by_name(
    tmp_path: Path,
) -> None:
    """Each file names its format version; one this code does not read is refused with the
    file, the version found and the versions it reads, before anything else is trusted."""
    from lit_spikes.tools.recover import LedgerUnreadable

    (tmp_path / LEDGER_NAME).write_text('{"version": 1, "config": {}}')  # an older one too
    with pytest.raises(LedgerUnreadable) as ledger_error:
        read_ledger(tmp_path)
    expected = f"{tmp_path / LEDGER_NAME} has format version 1; this lit-spikes reads version 2"
    assert expected in str(ledger_error.value)
    history = tmp_path / HISTORY_NAME
    history.write_text('{"history_version": 7}\n{"step": 0, "loss": 1.0}\n')
    with pytest.raises(LedgerUnreadable) as history_error:
        read_history(history)
    expected = f"{history} has format version 7; this lit-spikes reads version 1, 2, 3"
    assert expected in str(history_error.value)


def test_a_history_file_begins_with_its_format_version(tmp_path: Path) -> None:
    from lit_spikes.tools.recover.history import write_history

    history, records = tmp_path / HISTORY_NAME, [{"step": 0, "loss": 1.5}, {"val_step": 1}]
    write_history(history, records)
    assert history.read_text().splitlines()[0] == '{"history_version": 3}'
    assert read_history(history) == records
    history.write_text('{"step": 0, "loss": 1.5}\n')  # written before the version line
    assert read_history(history) == [{"step": 0, "loss": 1.5}]


def test_one_remedy_or_metric_alone_is_a_list_of_one_not_of_letters() -> None:
    config = RecoverConfig.from_dict(
        {"ladder": "lit_spikes.callbacks.LRScaler", "detector": {"monitor": "grad_norm"}}
    )
    assert config.ladder == ({"class_path": RUNGS["scale_lr"], "init_args": {"factor": 0.5}},)
    assert config.detector.monitor == ("grad_norm",)


def test_fresh_clears_the_log_root_but_keeps_it_locked(tmp_path: Path) -> None:
    config = tiny_config(tmp_path / "fresh")
    (config.log_root / "spike9" / "checkpoints").mkdir(parents=True)
    (config.log_root / LEDGER_NAME).write_text('{"stale": true}')
    loop = RecoveryLoop(config, fresh=True)
    try:
        assert not (config.log_root / "spike9").exists()
        assert "stale" not in (config.log_root / LEDGER_NAME).read_text()
        assert lock_probe(config.log_root) == "busy"  # held all along
    finally:
        loop.close()
    assert lock_probe(config.log_root) == "free"


def test_a_log_root_that_cannot_be_created_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["recover", "--log_root", str(tmp_path / "afile" / "sub")])
    assert exit_info.value.code == 2
    assert "cannot be created" in capsys.readouterr().err
