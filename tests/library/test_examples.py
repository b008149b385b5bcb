"""``examples/own_model.py``: the library on a user's own model trains, resumes bit-exactly
and remedies a spike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_the_example_trains_resumes_and_remedies(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "examples/own_model.py", "--root", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "equals the uninterrupted one, bit for bit" in result.stdout
    assert "flagged at step 30" in result.stdout and "without a spike" in result.stdout
