"""The foldc IR: named axes, typed nodes, a networkx graph, a verifier and a printer."""
from .axes import BATCH, CANONICAL, CHANNEL, KV_HEAD, K, M, N, Q_PER_KV, TOKEN, GroupedAxis, base_of, canonical
from .graph import Graph
from .nodes import (FOLD_KINDS, Accumulate, Add, Codes, Contract, Correction, Dequantize, Divide,
                    GroupParam, Input, MulScalar, Node, OnlineSoftmax, Prescale, ScaleGroups)
from .printer import print_graph
from .verify import element_axes, param_axes, structural_fold, verify

__all__ = [
    "BATCH", "CANONICAL", "CHANNEL", "KV_HEAD", "K", "M", "N", "Q_PER_KV", "TOKEN", "GroupedAxis", "base_of",
    "canonical", "Graph", "FOLD_KINDS", "Accumulate", "Add", "Codes", "Contract", "Correction",
    "Dequantize", "Divide", "GroupParam", "Input", "MulScalar", "Node", "OnlineSoftmax", "Prescale",
    "ScaleGroups", "print_graph", "element_axes", "param_axes", "structural_fold", "verify",
]
