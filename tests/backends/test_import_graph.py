"""The package's import graph (every import statement of foldc/, module level or inside a function,
read from the source with ast; networkx for the graph): neither attention backend imports the other,
and the runtime both share imports neither."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2] / "foldc"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> the foldc modules it imports (a name imported from a package resolves to the
    submodule of that name where there is one)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                targets = [f"{target}.{a.name}" for a in node.names] + [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph.add_edge(name, t)
    return graph


def _side(module: str) -> str | None:
    for side in ("gluon", "triton", "runtime"):
        if module.startswith(f"foldc.backends.{side}"):
            return side
    return None


def test_the_graph_sees_the_imports_it_should():
    graph = import_graph()
    assert graph.has_edge("foldc.backends.gluon.launch", "foldc.backends.runtime.merge")
    assert graph.has_edge("foldc.backends.triton.launch", "foldc.backends.runtime.modules")
    assert graph.has_edge("foldc.backends.gluon.kernel", "foldc.backends.gluon.tile_memory")


def test_neither_backend_imports_the_other_and_the_runtime_imports_neither():
    crossing = [(a, b) for a, b in import_graph().edges
                if {_side(a), _side(b)} == {"gluon", "triton"} or (_side(a) == "runtime" and _side(b) in ("gluon",
                                                                                                         "triton"))]
    assert crossing == []
