"""The engine's parts are given what they use, not the store (issue 22): the reader, the writer and the
catch-up of owed replicas import nothing that leads back to ``kvstream.store``, so the store / reader / writer /
replica_debt import circle cannot come back unnoticed.

The graph is read from the source (``ast``: every ``import`` and ``from ... import``, those under
``if TYPE_CHECKING:`` included, since a type-only import is still a circle for a reader of the code). Importing a
module ``kvstream.a.b`` is an edge to that module only: the package's ``__init__`` re-exports the public API
(``Store`` included) and is not a part's dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PARTS = ("kvstream.reader", "kvstream.writer", "kvstream.replica_debt")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    """kvstream module -> the kvstream modules it imports (submodules named in ``from pkg import mod`` too)."""
    files = {_module_name(p): p for p in (SRC / "kvstream").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if base in files:
                    deps.add(base)
                for a in node.names:
                    if f"{base}.{a.name}" in files:
                        deps.add(f"{base}.{a.name}")
        deps.discard("kvstream")  # the package's __init__ (the public API), not a dependency of a part
        graph[name] = deps - {name}
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path of imports from ``start`` to ``goal``, or None."""
    todo: list[list[str]] = [[start]]
    seen = {start}
    while todo:
        path = todo.pop()
        for dep in sorted(graph.get(path[-1], ())):
            if dep == goal:
                return path + [dep]
            if dep not in seen:
                seen.add(dep)
                todo.append(path + [dep])
    return None


def test_the_graph_sees_the_store_importing_its_parts() -> None:
    """The check can fail: the store's own imports of its parts are found."""
    graph = _graph()
    for part in PARTS:
        assert part in graph["kvstream.store"], part
    assert _reaches(graph, "kvstream.store", "kvstream.writer") is not None


@pytest.mark.parametrize("part", PARTS)
def test_an_engine_part_does_not_import_the_store(part: str) -> None:
    path = _reaches(_graph(), part, "kvstream.store")
    assert path is None, f"{part} leads back to the store: {' -> '.join(path or [])}"


@pytest.mark.parametrize("part", PARTS)
def test_an_engine_part_is_not_handed_the_store(part: str) -> None:
    """No parameter or attribute annotated ``Store``: a part takes tiers, memory, breakers and callables."""
    path = SRC / (part.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "Store"]
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "Store"]
    assert not names and not strings, f"{part} still names Store"
