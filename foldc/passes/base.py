"""The pass protocol: a pass is a small frozen dataclass with a name, the equation of
docs/derivation.md it applies, and ``apply(graph) -> (graph, changed)``. `run_pipeline` runs
passes in order and the verifier after every one (requires -> call -> ensures)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..ir import Graph, verify


@dataclass(frozen=True)
class Pass:
    name: ClassVar[str] = "pass"
    equation: ClassVar[str] = ""

    def apply(self, graph: Graph) -> tuple[Graph, bool]:  # pragma: no cover - interface
        raise NotImplementedError(f"pass {self.name} does not implement apply()")


@dataclass(frozen=True)
class PassRecord:
    name: str
    equation: str
    changed: bool

    def __str__(self) -> str:
        return f"{self.name} (eq. {self.equation}): {'changed' if self.changed else 'no change'}"


def run_pipeline(graph: Graph, passes) -> tuple[Graph, list[PassRecord]]:
    verify(graph)
    log = []
    for p in passes:
        graph, changed = p.apply(graph)
        verify(graph)
        log.append(PassRecord(p.name, p.equation, changed))
    return graph, log
