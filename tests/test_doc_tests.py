"""Every test README.md and docs/*.md name as the proof of a claim exists: a test renamed
or moved must take its doc row along, or the row names nothing."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_REFERENCE = re.compile(r"`(?:tests/)?((?:[\w-]+/)*[\w-]+\.py)?::(test_[\w*]+)(?:\[[^\]`]*\])?`")
"""``file.py::test_name`` (under ``tests/``), or ``::test_name``: the file named above it."""


def references(text: str) -> list[tuple[str, str]]:
    """(file under tests/, test name or glob) for each reference, in the order written."""
    found, file = [], None
    for match in _REFERENCE.finditer(text):
        file = match.group(1) or file
        if file is None:
            raise AssertionError(f"`::{match.group(2)}` has no file named before it")
        found.append((file, match.group(2)))
    return found


def defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_test_a_doc_names_exists(doc: Path) -> None:
    missing = []
    for file, name in references(doc.read_text()):
        path = REPO / "tests" / file
        if not path.is_file():
            missing.append(f"{file}::{name} (no such file)")
        elif not fnmatch.filter(defined_names(path), name):
            missing.append(f"{file}::{name}")
    assert missing == [], f"{doc.name} names tests that do not exist: {missing}"


def test_the_docs_name_tests() -> None:
    """The check above sees references: survives.md's rows and a continued ``::name``."""
    assert len(references((REPO / "docs" / "survives.md").read_text())) > 100
    text = "`a/x.py::test_one`, `::test_two` then `b.py::test_*`"
    assert references(text) == [("a/x.py", "test_one"), ("a/x.py", "test_two"), ("b.py", "test_*")]
