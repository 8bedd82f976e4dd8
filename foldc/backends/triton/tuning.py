"""The generated Triton kernel's launch configuration (`Config`) and the candidates `foldc.tune`
times, registered with the shared tuning cache (foldc/backends/runtime/tuning.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..runtime.tuning import TunedKernel, register_tuned_kernel

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Config:
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    split_factor: float = 1.0

    def __str__(self) -> str:
        return f"block_n={self.block_n} warps={self.num_warps} stages={self.num_stages} splits x{self.split_factor:g}"


# 8 warps was 3x slower than 4 at every block_n on the H200 (docs/perf.md), 2 warps can win at 128
CANDIDATES = tuple(Config(bn, w, s, f) for bn in (32, 64, 128) for w in (2, 4) for s in (2, 3)
                   for f in (1.0, 2.0))

# the sources that decide what the kernel does and how fast: a tuned entry is kept only for them (codegen.py and
# launch.py, and the modules of this package they import: layout.py's tiles, paging.py's paged variant; checked by
# tests/backends/test_autotune.py)
register_tuned_kernel(TunedKernel("triton", Config, (HERE / "codegen.py", HERE / "launch.py", HERE / "layout.py",
                                                     HERE / "paging.py", HERE.parent / "runtime" / "merge.py")))
