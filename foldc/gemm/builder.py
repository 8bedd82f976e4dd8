"""Build the GEMM graph of a GemmSpec (before any fold decision).

    y[m, n] = sum_k x[m, k] * w[n, k]          (the "xw" product)

x is the activation (plain, or per-token encoded), w the weight (k-group or per-channel
encoded). Both encodings group along k (``Input.group_axis = "k"``). The passes decide the folds
with the same rules as for attention (eq. 11, 12/16, 3-6, 15).
"""
from __future__ import annotations

from ..ir import K, M, N, Contract, Graph, Input, verify
from .spec import ROWS_PER_TILE, GemmSpec

X_AXES = (M, K)
W_AXES = (N, K)
Y_AXES = (M, N)


def build_gemm(spec: GemmSpec) -> Graph:
    """``sizes`` holds what the cost model counts (eq. 16): m and n are the extents of one output
    tile (the rows sharing one dequantized tile of the other operand), k the reduced size."""
    g = Graph(f"gemm({spec.describe()})", sizes={M: spec.rows_per_tile, N: min(spec.n, ROWS_PER_TILE), K: spec.k})
    g.add(Input("x", X_AXES, role="activation", encoding=spec.activation_affine(),
                group_axis=K if spec.activation else ""))
    g.add(Input("w", W_AXES, role="weight", encoding=spec.weight_affine(), group_axis=K if spec.weight else ""))
    g.add(Contract("y", Y_AXES, lhs="x", rhs="w", reduce=K, product="xw"))
    g.output = "y"
    verify(g)
    return g
