"""The package's import graph (every import statement of foldc/, module level or inside a function,
read from the source with ast; networkx for the graph): no cycles, neither attention backend imports
the other, the runtime both share imports neither, and the layers of docs/architecture.md import only
downwards. ``python3 tests/backends/test_import_graph.py`` prints that page's layer table."""
from __future__ import annotations

import ast
import re
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
                names = [f"{target}.{a.name}" for a in node.names]
                # `from . import kernel` imports the submodule; the package only where a name is not one
                targets = names + ([target] if any(n not in modules for n in names) else [])
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


def test_the_package_has_no_import_cycles():
    """foldc/ imports one way: core <- workloads and backends <- drivers (compile, tune, the CLI)."""
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1)
    assert cycles == []


def test_no_backend_imports_compile_and_the_core_imports_no_backend_or_workload():
    """Backends are below foldc.compile; the attention core reaches a backend or the GEMM workload
    only through foldc/registry.py (no isinstance branches on GemmSpec there)."""
    graph = import_graph()
    assert [a for a in graph.predecessors("foldc.compile") if a.startswith("foldc.backends")] == []
    core = ("foldc.spec", "foldc.options", "foldc.plan", "foldc.proof", "foldc.explain", "foldc.compile",
            "foldc.registry", "foldc.validate", "foldc.targets")
    reached = sorted((a, b) for a in core for b in graph.successors(a)
                     if b.startswith(("foldc.backends", "foldc.gemm")))
    assert reached == []
    for name in core:
        source = (ROOT.parent / (name.replace(".", "/") + ".py")).read_text()
        assert re.search(r"isinstance\([^)]*Gemm", source) is None, name


def test_every_backend_and_workload_registers_on_import():
    import foldc
    from foldc.registry import attention_backend, workload_of

    assert attention_backend("gluon").targets == ("sm_90", "sm_100")
    assert "interpret" in attention_backend("triton").targets
    from foldc.gemm import parse_gemm_encoding

    gemm = foldc.GemmSpec(64, 128, weight=parse_gemm_encoding("k-group:4:32", "weight"))
    assert workload_of(gemm).name == "gemm" and workload_of(foldc.AttentionSpec(8, 2, 64)) is None
    assert foldc.plan(gemm).kind == "gemm"


# the layers of docs/architecture.md, bottom to top; a module not named here is in its package's layer,
# and a top-level module of foldc/ in "core"
LAYERS = {
    "compile": {"foldc.compile", "foldc.tune", "foldc.gemm", "foldc.gemm.compile", "foldc.gemm.workload",
                "foldc.backends", "foldc.nn", "foldc.linear_state"},
    "serving": {"foldc.ops"},   # the torch custom ops: decode attention and appends (integrations build on them)
    "tools": {"foldc", "foldc.__main__", "foldc.cli", "foldc.demo", "foldc.bench", "foldc.bench_layouts",
              "foldc.layout_grid", "foldc.gemm.bench", "foldc.serving.bench", "foldc.layout_compile"},
}
PACKAGES = (("backends.gluon", "foldc.backends.gluon"), ("backends.triton", "foldc.backends.triton"),
            ("backends.runtime", "foldc.backends.runtime"), ("gemm", "foldc.gemm"), ("serving", "foldc.serving"),
            ("integrations", "foldc.integrations"))
ORDER = ("core", "gemm", "backends.runtime", "backends.gluon", "backends.triton", "compile", "serving",
         "integrations", "tools")


def layer(module: str) -> str:
    for name, members in LAYERS.items():
        if module in members:
            return name
    for name, prefix in PACKAGES:
        if module == prefix or module.startswith(prefix + "."):
            return name
    return "core"


def layer_table() -> str:
    """One line per layer, bottom up: the layers it imports."""
    graph = import_graph()
    below = {name: set() for name in ORDER}
    for a, b in graph.edges:
        if layer(a) != layer(b):
            below[layer(a)].add(layer(b))
    width = max(map(len, ORDER))
    return "\n".join(f"{name:<{width}}  imports: {', '.join(sorted(below[name], key=ORDER.index)) or '-'}"
                     for name in ORDER)


def test_layers_import_only_downwards_and_the_page_shows_them():
    graph = import_graph()
    upward = sorted((a, b) for a, b in graph.edges if ORDER.index(layer(a)) < ORDER.index(layer(b)))
    assert upward == []
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = "\n".join("    " + line for line in layer_table().split("\n"))   # a code block of the page
    assert block in page, "docs/architecture.md: paste `python3 tests/backends/test_import_graph.py`"


def test_nothing_in_the_package_or_the_tests_loads_a_benchmark_script():
    """benchmarks/ are experiments on top of foldc; what the tests check lives in the package."""
    hits = []
    for path in [*ROOT.rglob("*.py"), *(ROOT.parent / "tests").rglob("*.py")]:
        if path == Path(__file__).resolve():   # this check's own patterns
            continue
        text = path.read_text()
        if re.search(r"""["']benchmarks["']\s*/|benchmarks/\w+\.py["']|from benchmarks|import benchmarks""", text):
            hits.append(str(path.relative_to(ROOT.parent)))
    assert hits == []


if __name__ == "__main__":
    print(layer_table())
