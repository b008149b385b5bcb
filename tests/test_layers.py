"""The library on modules that are not the project's: StepLoader, ExactResume and the
watching callbacks, with plain Lightning Trainers, ModelCheckpoint files and
``Trainer.fit(ckpt_path=...)``, as a user runs them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_library_imports_nothing_of_the_demo() -> None:
    """A user's process that imports the callbacks and the loader loads no demo world,
    model or module (and the project installs no top-level ``callbacks`` module, which a
    user's own callbacks.py would clash with)."""
    probe = (
        "import sys, lit_spikes.callbacks, lit_spikes; "
        "print(sorted(m for m in sys.modules if m.startswith(('lit_spikes', 'callbacks'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd="/", check=True, capture_output=True, text=True
    )
    loaded = result.stdout
    assert "lit_spikes.demo" not in loaded and "lit_spikes.tools" not in loaded, loaded
    assert "'callbacks" not in loaded


def test_the_tools_know_the_demo_by_class_path_alone() -> None:
    """Issue 63: the tools (fit, recover, diagnose, check-resume) load no demo code until
    a run names the demo's classes; the demo's defaults are class-path strings."""
    tools = ("fit_cli", "recover", "diagnose", "check_resume")
    probe = (
        "import sys, importlib; "
        f"[importlib.import_module('lit_spikes.tools.' + m) for m in {tools}]; "
        "print(sorted(m for m in sys.modules if m.startswith('lit_spikes.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd="/", check=True, capture_output=True, text=True
    )
    assert "lit_spikes.demo" not in result.stdout
    for seen in ("recover.loop", "diagnose.subject", "fit_cli", "check_resume"):
        assert f"lit_spikes.tools.{seen}" in result.stdout  # the probe saw the tools load


ROOT = Path(__file__).resolve().parents[1]


LAYERS = ("library", "shared", "tools", "demo")
"""The floors, from the bottom: each imports only those below it."""


LIBRARY = (
    "lit_spikes",
    "lit_spikes.loader",
    "lit_spikes.checkpoints",
    "lit_spikes.file_digest",
    "lit_spikes.randomness",
    "lit_spikes.stacklevel",
    "lit_spikes.tool_facts",
)


LIBRARY_PACKAGES = ("lit_spikes.testing", "lit_spikes.callbacks", "lit_spikes.elastic")


def source_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, callbacks/ under its installed name (lit_spikes.callbacks)."""
    found = {}
    trees = [(root / "lit_spikes", "lit_spikes"), (root / "callbacks", "lit_spikes.callbacks")]
    for top, name in trees:
        for path in top.rglob("*.py"):
            rel = path.relative_to(top)
            if rel.parts[0] == "callbacks" and name == "lit_spikes":
                continue  # the symbolic link to callbacks/
            parts = [name, *rel.with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (``from p import m`` names module p.m)."""
    modules = source_modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        edges.add(f"{base}.{alias.name}")
                    elif base in modules:
                        edges.add(base)
        graph[name] = edges - {name}
    return graph


def layer(module: str) -> str:
    for name in ("demo", "tools", "shared"):
        if module == f"lit_spikes.{name}" or module.startswith(f"lit_spikes.{name}."):
            return name
    if module in LIBRARY or module.startswith(tuple(p + "." for p in LIBRARY_PACKAGES)):
        return "library"
    if module in LIBRARY_PACKAGES:
        return "library"
    return "unplaced"


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """The imports that break the layering, as ``importer -> imported (why)``."""
    found = []
    for importer, imported in sorted(graph.items()):
        for target in sorted(imported):
            here, there = layer(importer), layer(target)
            if here == "library" and there in ("demo", "tools", "shared"):
                found.append(f"{importer} -> {target} (the library imports the {there})")
            elif here == "shared" and there in ("demo", "tools"):
                found.append(f"{importer} -> {target} (lit_spikes.shared imports the {there})")
            elif here == "tools" and there == "demo":
                found.append(f"{importer} -> {target} (a tool imports the demo)")
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Floor -> the floors its modules import (the package-level view of ``graph``)."""
    floors: dict[str, set[str]] = {}
    for importer, imported in graph.items():
        here = layer(importer)
        floors.setdefault(here, set()).update(layer(t) for t in imported if layer(t) != here)
    return floors


def upward(floors: dict[str, set[str]]) -> list[str]:
    """The floors that import a floor above them (``LAYERS``), or the same pair both ways."""
    rank = {name: index for index, name in enumerate(LAYERS)}
    found = []
    for here, imported in sorted(floors.items()):
        for there in sorted(imported):
            if rank.get(there, len(LAYERS)) > rank.get(here, len(LAYERS)):
                found.append(f"{here} -> {there}")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_source_file_is_ignored_by_git() -> None:
    """A package whose name a .gitignore pattern matches never reaches a commit
    (``lit_spikes/runs/`` under ``runs/``: the dev tree imported it, a clean clone did
    not). Checked where the tree is a git checkout."""
    paths = [str(path.relative_to(ROOT)) for path in source_modules(ROOT).values()]
    try:
        found = subprocess.run(
            ["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("no git on this machine")
    if found.returncode not in (0, 1):  # 128: not a git checkout (an installed copy)
        pytest.skip(f"not a git checkout: {found.stderr.strip()}")
    assert found.stdout.split() == [], "rename these or un-ignore them"


def test_every_module_is_in_a_layer() -> None:
    unplaced = [m for m in source_modules(ROOT) if layer(m) == "unplaced"]
    assert not unplaced, f"move these into lit_spikes/demo/ or lit_spikes/tools/: {unplaced}"


def test_library_and_tools_import_only_down() -> None:
    assert crossings(import_graph(ROOT)) == []


def test_the_packages_import_one_way_down_with_no_circle() -> None:
    """Issue 63: files apart, the floors too (library, shared, tools, demo): each pair in
    one direction, downward, so no circle runs through the packages."""
    floors = package_graph(import_graph(ROOT))
    assert upward(floors) == [] and circles(floors) == []
    assert "tools" in floors["demo"] and "library" in floors["tools"]  # the view sees edges


def public_names(root: Path, package: str) -> set[str]:
    """The names a package of the tools lists in ``__all__`` (read, not imported)."""
    path = root / Path(*package.split(".")) / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


TOOLS_PACKAGES = (
    "lit_spikes.tools",
    "lit_spikes.tools.diagnose",
    "lit_spikes.tools.forensics",
    "lit_spikes.tools.recover",
    "lit_spikes.tools.study",
)
"""The tools' packages whose ``__all__`` is their public API (the commands' packages)."""


def private_uses(sources: dict[str, str], public: dict[str, set[str]]) -> list[str]:
    """What the demo's modules (name -> source) import of the tools outside their public
    API: a name not in ``__all__`` of one of ``public``'s packages, or a tools module
    that is not such a package."""
    found = []
    for name, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                found += [
                    f"{name}: import {a.name}" for a in node.names if layer(a.name) == "tools"
                ]
            elif isinstance(node, ast.ImportFrom) and layer(node.module or "") == "tools":
                allowed = public.get(node.module or "", set())
                found += [
                    f"{name}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name not in allowed
                ]
    return found


def test_the_demo_uses_only_the_tools_public_api() -> None:
    """Issue 63: the demo, on the top floor, uses the tools as a user's script would:
    names in ``__all__`` of the tools' packages; what both build runs with is below both,
    in ``lit_spikes.shared``."""
    demo = {m: p.read_text() for m, p in source_modules(ROOT).items() if layer(m) == "demo"}
    public = {package: public_names(ROOT, package) for package in TOOLS_PACKAGES}
    assert private_uses(demo, public) == []
    assert "diagnose" in public["lit_spikes.tools.diagnose"]  # the API was read
    assert any("from lit_spikes.tools import" in text for text in demo.values())


def test_a_private_use_of_the_tools_is_seen() -> None:
    sources = {
        "lit_spikes.demo.a": "from lit_spikes.tools.fit_cli import FitCLI\n",
        "lit_spikes.demo.b": "import lit_spikes.tools.recover.loop\n",
        "lit_spikes.demo.c": "from lit_spikes.tools.diagnose import diagnose, subject\n",
        "lit_spikes.demo.d": "from lit_spikes.shared.training import RunSpec\n",
    }
    public = {"lit_spikes.tools.diagnose": {"diagnose"}}
    assert private_uses(sources, public) == [
        "lit_spikes.demo.a: from lit_spikes.tools.fit_cli import FitCLI",
        "lit_spikes.demo.b: import lit_spikes.tools.recover.loop",
        "lit_spikes.demo.c: from lit_spikes.tools.diagnose import subject",
    ]


def test_no_import_circles() -> None:
    assert circles(import_graph(ROOT)) == []


def test_the_checks_see_a_crossing_and_a_circle() -> None:
    graph = {
        "lit_spikes.loader": {"lit_spikes.demo.model"},
        "lit_spikes.shared.plain": {"lit_spikes.tools.fit_cli"},
        "lit_spikes.tools.cli": {"lit_spikes.demo.data", "lit_spikes.tools.fit_cli"},
        "lit_spikes.tools.fit_cli": {"lit_spikes.tools.cli"},
        "lit_spikes.demo.data": {"lit_spikes.tools.progress"},
        "lit_spikes.tools.progress": set(),
    }
    assert crossings(graph) == [
        "lit_spikes.loader -> lit_spikes.demo.model (the library imports the demo)",
        "lit_spikes.shared.plain -> lit_spikes.tools.fit_cli (lit_spikes.shared imports the tools)",
        "lit_spikes.tools.cli -> lit_spikes.demo.data (a tool imports the demo)",
    ]
    assert circles(graph) == [["lit_spikes.tools.cli", "lit_spikes.tools.fit_cli"]]
    floors = package_graph(graph)
    assert upward(floors) == ["library -> demo", "shared -> tools", "tools -> demo"]
    assert circles(floors) == [["demo", "tools"]]


MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80
"""Issue 63: files under 600 lines, functions under 80 (60 is a warning sign)."""


def too_long(path: Path, text: str) -> list[str]:
    """What of a source file is over the limits: the file, or a function by name."""
    lines = text.count("\n") + 1
    found = [f"{path}: {lines} lines"] if lines > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


def test_files_and_functions_stay_short() -> None:
    found = [
        problem
        for path in source_modules(ROOT).values()
        for problem in too_long(path.relative_to(ROOT), path.read_text())
    ]
    assert found == []


def test_the_size_check_sees_a_long_function_and_file() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    text = "def long():\n" + body + "\n" * MAX_FILE_LINES
    assert too_long(Path("m.py"), text) == [
        f"m.py: {MAX_FUNCTION_LINES + MAX_FILE_LINES + 2} lines",
        f"m.py:1 long: {MAX_FUNCTION_LINES + 1} lines",
    ]


def test_every_package_is_installed() -> None:
    """pyproject.toml lists its packages by name: one left out installs nowhere but an
    editable checkout (lit_spikes.shared and lit_spikes.tools.study once were)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {m for m, p in source_modules(ROOT).items() if p.name == "__init__.py"}
    assert found - listed == set() and listed - found == set()
