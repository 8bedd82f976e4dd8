"""The IR graph: nodes keyed by name in a networkx DiGraph, edges from operand to user."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Iterator

import networkx as nx

from ..errors import GraphError
from .nodes import Node


class Graph:
    """A dataflow graph of IR nodes with one output.

    ``sizes`` holds the static axis sizes the passes may read (``q_per_kv``, ``channel``);
    ``meta`` holds what passes export (decisions, tiling constraints). Graphs are treated as
    values: passes build a new graph with `copy` and edit that.
    """

    def __init__(self, title: str, sizes: dict[str, int] | None = None):
        self.title = title
        self.sizes: dict[str, int] = dict(sizes or {})
        self.meta: dict[str, object] = {}
        self.output: str | None = None
        self._g = nx.DiGraph()
        self._order: dict[str, int] = {}

    # -- building -------------------------------------------------------------------------
    def add(self, node: Node) -> str:
        if node.name in self:  # a name only used so far (a forward reference) may be defined
            raise GraphError(f"node %{node.name} is defined twice; pick a fresh name")
        self._order[node.name] = len(self._order)
        self._g.add_node(node.name, op=node)
        for operand in node.operands():
            self._g.add_edge(operand, node.name)
        return node.name

    def replace_node(self, node: Node) -> None:
        """Swap the node of the same name for ``node`` (its operands may change)."""
        if node.name not in self._g:
            raise GraphError(f"cannot replace %{node.name}: no such node")
        preds = list(self._g.predecessors(node.name))
        for pred in preds:
            self._g.remove_edge(pred, node.name)
        self._g.nodes[node.name]["op"] = node
        for operand in node.operands():
            self._g.add_edge(operand, node.name)
        self._drop_unused_placeholders(preds)

    def _drop_unused_placeholders(self, names) -> None:
        """Forget names that were only referenced (never defined) and are no longer used."""
        for n in names:
            if n in self._g and "op" not in self._g.nodes[n] and not any(True for _ in self._g.successors(n)):
                self._g.remove_node(n)

    def rename_uses(self, old: str, new: str, skip: Iterable[str] = ()) -> None:
        """Make every user of %old (except those in ``skip``) read %new instead."""
        skip = set(skip)
        for user in list(self._g.successors(old)):
            if user in skip:
                continue
            node = self[user]
            changes = {f: new for f in node.operand_fields if getattr(node, f) == old}
            self.replace_node(replace(node, **changes))
        if self.output == old:
            self.output = new

    def remove(self, name: str) -> None:
        if name not in self._g:
            raise GraphError(f"cannot remove %{name}: no such node")
        if any(True for _ in self._g.successors(name)):
            raise GraphError(f"cannot remove %{name}: still used by {sorted(self._g.successors(name))}")
        preds = list(self._g.predecessors(name))
        self._g.remove_node(name)
        self._order.pop(name, None)
        self._drop_unused_placeholders(preds)

    def copy(self) -> "Graph":
        g = Graph(self.title, self.sizes)
        g.meta = dict(self.meta)
        g.output = self.output
        g._g = self._g.copy()
        g._order = dict(self._order)
        return g

    # -- reading --------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Node:
        try:
            return self._g.nodes[name]["op"]
        except KeyError:
            raise GraphError(f"%{name} is used but never defined") from None

    def __contains__(self, name: str) -> bool:
        return name in self._g and "op" in self._g.nodes[name]

    def __iter__(self) -> Iterator[Node]:
        """Nodes in a stable topological order (ties broken by insertion order)."""
        order = nx.lexicographical_topological_sort(self._g, key=lambda n: self._order.get(n, -1))
        for name in order:
            yield self[name]

    def nodes_of(self, cls) -> list[Node]:
        return [n for n in self if isinstance(n, cls)]

    def users(self, name: str) -> list[Node]:
        return sorted((self[u] for u in self._g.successors(name)), key=lambda n: self._order[n.name])

    def ancestors(self, name: str) -> set[str]:
        return nx.ancestors(self._g, name)

    def descendants(self, name: str) -> set[str]:
        return nx.descendants(self._g, name)

    def is_acyclic(self) -> bool:
        return nx.is_directed_acyclic_graph(self._g)

    def undefined(self) -> list[str]:
        """Names used as operands but never defined."""
        return sorted(n for n in self._g.nodes if "op" not in self._g.nodes[n])

    def __str__(self) -> str:
        from .printer import print_graph

        return print_graph(self)
