"""``lit_spikes.ChecksItsRun``: a module's and a data module's own checks, which
``lit-spikes fit`` runs once the classes are built and before it writes a file (the
demo's row, vocabulary, shard and skip checks travel this way, by no import of the tools).
On modules written for the test (tests/modules/fit_modules.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_spikes import ChecksItsRun
from lit_spikes.tools.cli import main
from tests.modules.fit_modules import CHECKED, CheckedData, CheckedNet, DropoutNet

NET, DATA = (f"tests.modules.fit_modules.{n}" for n in ("CheckedNet", "CheckedData"))
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def fit(root: Path, *args: str) -> object:
    return main(["fit", "--model", NET, "--data", DATA, *args, *QUIET,
                 "--trainer.default_root_dir", str(root)])  # fmt: skip


@pytest.fixture(autouse=True)
def _calls() -> None:
    CHECKED.clear()


def test_the_protocol_is_the_method() -> None:
    assert isinstance(CheckedNet(), ChecksItsRun) and isinstance(CheckedData(), ChecksItsRun)
    assert not isinstance(DropoutNet(), ChecksItsRun)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.hidden", "64"], "invalid configuration: CheckedNet.hidden=64 exceeds 32"),
        (["--trainer.max_steps", "90"], "CheckedData: max_steps=90 is too long"),
    ],
)
def test_a_check_of_the_module_or_data_refuses_the_run_before_any_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path / "run", "--trainer.max_steps", "4", *args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_checks_see_the_stage_and_the_resumed_checkpoint(tmp_path: Path) -> None:
    """The module's first, then the data's; a resume hands them the file it restores."""
    root = tmp_path / "run"
    fit(root, "--trainer.max_steps", "4", "--checkpoint_every", "2")
    assert CHECKED == [("net", "fit", None), ("data", "fit", None)]
    CHECKED.clear()
    fit(root, "--trainer.max_steps", "6", "--ckpt_path", "latest")
    assert CHECKED == [("net", "fit", 4), ("data", "fit", 4)]
