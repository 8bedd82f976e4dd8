"""Stable text form of a graph, used by golden tests and `foldc explain --ir`."""
from __future__ import annotations


def print_graph(graph) -> str:
    lines = [f"graph {graph.title}"]
    if graph.sizes:
        lines.append("  sizes " + " ".join(f"{k}={v}" for k, v in sorted(graph.sizes.items())))
    for node in graph:
        lines.append(f"  {node}")
    lines.append(f"  return %{graph.output}")
    for key in sorted(graph.meta):
        value = graph.meta[key]
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            lines.append(f"  {key}: {item}")
    return "\n".join(lines)
