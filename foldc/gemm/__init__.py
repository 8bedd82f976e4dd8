"""Affine-quantized GEMM/GEMV through the same IR, passes, proofs and backend as attention."""
from .builder import build_gemm
from .spec import GemmEncoding, GemmSpec, gemm_spec_from_table, parse_gemm_encoding

__all__ = ["GemmEncoding", "GemmSpec", "build_gemm", "gemm_spec_from_table", "parse_gemm_encoding"]
