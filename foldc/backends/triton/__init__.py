"""Triton backend: generate a fused split-KV decode kernel from a plan (codegen.py), map the
plan's axes to register tiles (layout.py), load and launch it (launch.py). Registered as the
"triton" attention backend: the portable lowering (sm_90, sm_100 and Triton's interpreter)."""
from ...registry import AttentionBackend, register_backend
from .codegen import generate
from .launch import TritonAttention, kernel_source, triton_plan
from .layout import TileGeometry, geometry
from .tuning import CANDIDATES, Config   # registers its tuning config

register_backend(AttentionBackend("triton", ("sm_90", "sm_100", "interpret"), TritonAttention, triton_plan))

__all__ = ["CANDIDATES", "Config", "TritonAttention", "TileGeometry", "generate", "geometry", "kernel_source", "triton_plan"]
