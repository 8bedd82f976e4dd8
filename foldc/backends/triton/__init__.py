"""Triton backend: generate a fused split-KV decode kernel from a plan (codegen.py), map the
plan's axes to register tiles (layout.py), load and launch it (launch.py). Registered as the
"triton" attention backend: the portable lowering (sm_90, sm_100 and Triton's interpreter)."""
from ...errors import SpecError
from ...registry import AttentionBackend, register_backend
from .codegen import generate
from .launch import TritonAttention, kernel_source, triton_plan
from .layout import TileGeometry, geometry
from .tuning import CANDIDATES, Config   # registers its tuning config


def lowerable(spec, dtype: str = "bf16") -> tuple[bool, str]:
    """Whether the generated kernel tiles ``spec`` at all (`geometry`: any block_n takes what the default takes),
    and why not; ``dtype`` changes nothing here."""
    try:
        geometry(spec)
    except SpecError as e:
        return False, str(e)
    return True, ""


register_backend(AttentionBackend("triton", ("sm_90", "sm_100", "interpret"), TritonAttention, triton_plan, lowerable))

__all__ = ["CANDIDATES", "Config", "TritonAttention", "TileGeometry", "generate", "geometry", "kernel_source",
           "lowerable", "triton_plan"]
