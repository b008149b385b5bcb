"""A handed-over run imports no code the user did not name (issue 61, item 1): a class
path in a run's ``config.yaml`` or a recover ledger is located before anything of it is
imported, and refused where its module would come from the run directory, the working
directory that ``python -m`` puts on ``sys.path``, or the standard library. Each case is
watched by a sentinel file the module writes when its code runs
(lit_spikes/tools/import_guard.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lit_spikes.tools.cli import main
from lit_spikes.tools.diagnose.run import _ledger_steps
from lit_spikes.tools.import_guard import first_refusal, named_by_user, refusal
from lit_spikes.tools.recover.ledger import LedgerUnreadable
from lit_spikes.tools.run_record import record_path
from tests.conftest import REPO

NET = "tests.modules.fit_modules.DropoutNet"
DATA = "tests.modules.fit_modules.StepData"
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]

ZEN = "Beautiful is better than ugly"


@pytest.fixture(scope="module")
def their_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's run of ``lit-spikes fit``: checkpoints/step=3.ckpt and step=6.ckpt."""
    root = tmp_path_factory.mktemp("theirs") / "run"
    main(["fit", "--model", NET, "--data", DATA, "--trainer.max_steps", "6",
          "--checkpoint_every", "3", *QUIET, "--trainer.default_root_dir", str(root)])  # fmt: skip
    return root


def plant(folder: Path, name: str, sentinel: Path) -> None:
    """A module ``name`` in ``folder`` that writes ``sentinel`` when imported, and holds
    the test's module as ``Model``."""
    (folder / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('ran')\n"
        f"from tests.modules.fit_modules import DropoutNet as Model\n"
    )


def handed_over(their_run: Path, tmp_path: Path, model: str) -> tuple[Path, Path]:
    """A copy of the run whose record names ``model``, with ``evil.py`` beside it."""
    run, sentinel = tmp_path / "handed", tmp_path / "SENTINEL"
    shutil.copytree(their_run, run)
    record = yaml.safe_load((run / "config.yaml").read_text())
    record["model"]["class_path"] = model
    (run / "config.yaml").write_text(yaml.safe_dump(record))
    plant(run, "evil", sentinel)
    return run, sentinel


def lit_spikes(*args: str, cwd: Path, script: bool = False) -> subprocess.CompletedProcess[str]:
    """The CLI in a new process: ``python -m`` (the working directory on sys.path), or the
    installed ``lit-spikes`` script; the repository on PYTHONPATH for the test's modules."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    head = [str(Path(sys.executable).parent / "lit-spikes")] if script else [
        sys.executable, "-m", "lit_spikes.tools.cli"]  # fmt: skip
    quiet = QUIET if args[0] in ("fit", "validate") else []
    return subprocess.run([*head, *args, *quiet], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300, check=False)  # fmt: skip


def in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cwd: Path, *args: str
) -> tuple[object, str]:
    """The CLI in this process as ``python -m`` runs it from ``cwd`` (first on sys.path):
    its exit status and its stderr."""
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))
    quiet = QUIET if args[0] in ("fit", "validate") else []
    with pytest.raises(SystemExit) as exit_info:
        main([*args, *quiet])
    return exit_info.value.code, capsys.readouterr().err


COMMANDS = {
    "fit": ["fit", "--ckpt_path", "checkpoints/step=3.ckpt"],
    "validate": ["validate", "--ckpt_path", "checkpoints/step=3.ckpt"],
    "diagnose": ["diagnose", "--ckpt_path", "checkpoints/step=3.ckpt", "--spike_step", "5"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_module_beside_a_handed_over_record_is_refused_and_never_runs(
    their_run: Path,
    tmp_path: Path,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run, sentinel = handed_over(their_run, tmp_path, "evil.Model")
    before = sorted(p.name for p in run.rglob("*"))
    if command == "fit":  # from inside it, in a new process: evil.py is importable
        done = lit_spikes(*COMMANDS[command], cwd=run)
        code, err = done.returncode, done.stderr
    else:
        code, err = in_process(monkeypatch, capsys, run, *COMMANDS[command])
    assert code == 2, err[-3000:]
    assert not sentinel.exists() and "evil" not in sys.modules
    last = err.strip().splitlines()[-1]
    assert f"{run / 'config.yaml'}: entry model names 'evil.Model'" in last
    assert f"{run / 'evil.py'}, inside the run directory" in last
    assert "give --model evil.Model yourself" in last
    assert sorted(p.name for p in run.rglob("*")) == before


def test_the_module_named_on_the_command_line_is_the_users_choice(
    their_run: Path, tmp_path: Path
) -> None:
    run, sentinel = handed_over(their_run, tmp_path, "evil.Model")
    args = ["fit", "--model", "evil.Model", "--data", DATA, "--ckpt_path"]
    done = lit_spikes(*args, "checkpoints/step=3.ckpt", cwd=run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sentinel.read_text() == "ran"


@pytest.mark.parametrize("place", ["model", "callback"])
def test_a_standard_library_module_in_a_record_is_never_imported(
    their_run: Path,
    tmp_path: Path,
    place: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    shutil.copytree(their_run, run)
    record = yaml.safe_load((run / "config.yaml").read_text())
    if place == "model":
        record["model"]["class_path"] = "this.X"
    else:
        record["trainer"]["callbacks"] = [{"class_path": "this.Y"}]
    (run / "config.yaml").write_text(yaml.safe_dump(record))
    ckpt = run / "checkpoints" / "step=3.ckpt"
    if place == "model":  # through the installed script, in a new process
        done = lit_spikes("fit", "--ckpt_path", str(ckpt), cwd=tmp_path, script=True)
        code, out = done.returncode, done.stdout + done.stderr
    else:
        monkeypatch.delitem(sys.modules, "this", raising=False)
        code, out = in_process(monkeypatch, capsys, tmp_path, "fit", "--ckpt_path", str(ckpt))
        assert "this" not in sys.modules
    assert code == 2, out[-3000:]
    assert ZEN not in out
    assert "whose module 'this' would be imported from" in out
    assert "in the standard library" in out


def test_no_record_is_read_from_a_grandparent_that_is_no_run_directory(
    their_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shared = tmp_path / "shared"  # a shared temporary folder, writable by anyone
    (shared / "a").mkdir(parents=True)
    shutil.copy(their_run / "checkpoints" / "step=3.ckpt", shared / "a" / "x.ckpt")
    record = yaml.safe_load((their_run / "config.yaml").read_text())
    record["model"]["class_path"] = "evil.Model"
    (shared / "config.yaml").write_text(yaml.safe_dump(record))
    sentinel = tmp_path / "SENTINEL"
    plant(shared, "evil", sentinel)
    assert record_path(shared / "a" / "x.ckpt") is None
    assert record_path(their_run / "checkpoints" / "step=3.ckpt") == their_run / "config.yaml"
    _, err = in_process(monkeypatch, capsys, shared, "diagnose", "--ckpt_path", "a/x.ckpt",
                        "--spike_step", "5")  # fmt: skip
    assert not sentinel.exists() and "evil" not in sys.modules
    assert str(shared / "config.yaml") not in err, err[-3000:]


@pytest.fixture
def working_directory_on_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """As ``python -m`` runs: the working directory first on sys.path, no PYTHONPATH."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    yield folder
    for name in [n for n in sys.modules if n.split(".")[0] in ("evilpkg", "evil")]:
        del sys.modules[name]


def test_a_ledger_above_a_branch_names_no_module_that_runs(
    working_directory_on_the_path: Path,
) -> None:
    root, sentinel = working_directory_on_the_path, working_directory_on_the_path / "SENTINEL"
    plant(root, "evil", sentinel)
    ckpt = root / "spike1" / "continue" / "checkpoints" / "step=3.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    ledger = {"config": {"model": {"class_path": "evil.Model"}, "max_steps": 9}}
    (root / "ledger.json").write_text(json.dumps(ledger))
    with pytest.raises(
        LedgerUnreadable, match=r"ledger.json names 'evil.Model', whose module 'evil'"
    ):
        _ledger_steps(ckpt)
    assert not sentinel.exists()
    assert _ledger_steps(root / "elsewhere" / "step=3.ckpt") is None  # no branch's layout


def test_a_module_is_located_without_running_its_package(
    working_directory_on_the_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, sentinel = working_directory_on_the_path, working_directory_on_the_path / "SENTINEL"
    (folder / "evilpkg").mkdir()
    (folder / "evilpkg" / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('ran')\n"
    )
    (folder / "evilpkg" / "models.py").write_text("class Net: ...\n")
    run_dir = folder.parent / "elsewhere"
    why = refusal("evilpkg.models.Net", run_dir)
    assert why is not None and "the working directory or the script's directory" in why
    assert not sentinel.exists() and "evilpkg" not in sys.modules
    with named_by_user(["fit", "--model=evilpkg.models.Net"]):
        assert refusal("evilpkg.models.Net", run_dir) is None
    assert refusal("evilpkg.models.Net", run_dir) is not None  # the command's alone
    monkeypatch.setenv("PYTHONPATH", str(folder))  # the user put it on their path
    assert refusal("evilpkg.models.Net", run_dir) is None
    assert first_refusal({"ladder": [{"class_path": "this.Y"}]}, run_dir / "ledger.json")
    assert refusal("lit_spikes.callbacks.SpikeDetector", run_dir) is None  # installed
    assert not sentinel.exists()


def test_a_file_outside_a_run_resumes_without_its_grandparents_record(
    their_run: Path, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    (shared / "a").mkdir(parents=True)
    shutil.copy(their_run / "checkpoints" / "step=3.ckpt", shared / "a" / "x.ckpt")
    (shared / "config.yaml").write_text(yaml.safe_dump({"model": {"class_path": "evil.Model"}}))
    out = tmp_path / "out"
    main(["fit", "--model", NET, "--data", DATA, "--ckpt_path", str(shared / "a" / "x.ckpt"),
          "--trainer.max_steps", "6", "--checkpoint_every", "3", *QUIET,
          "--trainer.default_root_dir", str(out)])  # fmt: skip
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step=6.ckpt"]


def test_a_handed_over_recover_ledger_names_no_module_that_runs(
    working_directory_on_the_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, sentinel = working_directory_on_the_path, working_directory_on_the_path / "SENTINEL"
    plant(root, "evil", sentinel)
    ledger = {"version": 2, "config": {"model": {"class_path": "evil.Model"}}}
    (root / "ledger.json").write_text(json.dumps(ledger))
    with pytest.raises(SystemExit) as exit_info:
        main(["recover", "--log_root", str(root), "--model", NET, "--data", DATA,
              "--max_steps", "8", "--val_every", "null"])  # fmt: skip
    assert exit_info.value.code == 2 and not sentinel.exists()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{root / 'ledger.json'} names 'evil.Model', whose module 'evil'" in last
