"""The runtime's modules import one another one way: no circle, function-level imports included
(a circle hides which module a piece belongs to, and breaks when one of them is imported first)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.launch_utils import REPO

RUNTIME = REPO / "swbert" / "runtime"


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The swbert.runtime modules `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & modules


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import path that comes back to where it started, as the modules along it."""
    circles = []

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == path[0]:
                circles.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each circle once, from its smallest module
                walk([*path, nxt])

    for start in sorted(graph):
        walk([start])
    return circles


def test_the_runtime_modules_import_one_another_without_a_circle():
    files = {f"swbert.runtime.{p.stem}": p for p in RUNTIME.glob("*.py") if p.stem != "__init__"}
    graph = {name: _runtime_imports(path, set(files)) - {name} for name, path in files.items()}
    assert "swbert.runtime.extensions" in graph["swbert.runtime.dist"]  # the check sees imports
    assert not _circles(graph), _circles(graph)


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]
