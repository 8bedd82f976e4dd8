"""Affine-quantized GEMM/GEMV through the same IR, passes, proofs and backend as attention."""
from .builder import build_gemm
from .reference import gemm_reference, quantize_2d
from .spec import GemmEncoding, GemmSpec, gemm_spec_from_table, parse_gemm_encoding
from .workload import WORKLOAD   # registers GEMM with the core (foldc/registry.py)

__all__ = ["GemmEncoding", "GemmSpec", "build_gemm", "gemm_reference", "gemm_spec_from_table",
           "parse_gemm_encoding", "quantize_2d", "WORKLOAD"]
