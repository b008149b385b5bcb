"""``scripts/gpu_check.py`` (`make gpu-check`): without a GPU it proves the resume on the
CPU and says what it skips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.slow
def test_the_gpu_check_runs(tmp_path: Path) -> None:
    """Without a GPU (CI) `make gpu-check` still proves the resume on the CPU and says what
    it skips; on a GPU it also resumes 16-mixed (GradScaler) and measures the rest."""
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if torch.cuda.is_available():
        assert result.stdout.count(": bit-equal") == 6, result.stdout  # 16-mixed too
        assert "steps/s without / with the callbacks" in result.stdout
        assert "host syncs per steady step" in result.stdout
        assert "no CUDA device" not in result.stdout
    else:
        assert result.stdout.count(": bit-equal") == 4, result.stdout
        assert "no CUDA device: skipping" in result.stdout
