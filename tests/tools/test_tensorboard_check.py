"""The TensorBoard check (scripts/tensorboard_check.py, tests/modules/tb_check.py): its
reader half in CI, its browser half where Chromium is installed (skipped by name where
not)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.modules.tb_check import CheckFailed, browser, browser_checks, read_checks, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return train(tmp_path_factory.mktemp("tb_check"))


@pytest.mark.slow
def test_the_reader_half_passes(trained: tuple[Path, Path]) -> None:
    lines = read_checks(*trained)
    assert len(lines) == 10 and all(line.startswith("ok: ") for line in lines)


@pytest.mark.slow
def test_the_reader_half_fails_on_marks_of_the_spikes_height(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """The control: a mark written at the spike's own value (where the old marks sat,
    cropped by TensorBoard's default scaling) fails the check, naming it."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    fit_root, recover_root = trained
    copy = tmp_path / "fit"
    shutil.copytree(fit_root, copy)
    mark = copy / "spikes" / "step_35"
    shutil.rmtree(mark)
    writer = SummaryWriter(str(mark))
    writer.add_scalar("train_loss", 1460.0, 35)
    writer.close()
    with pytest.raises(CheckFailed, match="the mark is one point on the user's train_loss"):
        read_checks(copy, recover_root)


@pytest.mark.slow
def test_the_browser_half_sees_the_mark_on_the_users_chart(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    if browser() is None:
        pytest.skip("the browser half: no Chromium installed (apt install chromium)")
    lines = browser_checks(*trained, tmp_path)
    assert lines[-1].startswith("ok: fit: the mark's dot drawn in the chart")
    assert (tmp_path / "fit.png").is_file() and (tmp_path / "recover.png").is_file()
