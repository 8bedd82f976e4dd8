"""Triton backend: generate a fused split-KV decode kernel from a plan (codegen.py), map the
plan's axes to register tiles (layout.py), load and launch it (launch.py)."""
from .codegen import generate
from .launch import TritonAttention, kernel_source, triton_plan
from .layout import TileGeometry, geometry

__all__ = ["TritonAttention", "TileGeometry", "generate", "geometry", "kernel_source", "triton_plan"]
