"""The register-operand kernel's launch configuration (`GluonConfig`) and the candidates `foldc.tune`
times, registered with the shared tuning cache (foldc/backends/runtime/tuning.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..runtime.tuning import TunedKernel, register_tuned_kernel

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GluonConfig:
    """Launch options of the register-operand kernel (foldc/backends/gluon)."""

    block_n: int = 32
    stages: int = 2
    maxnreg: int | None = None
    split_factor: float = 1.0
    pack_heads: int | None = None    # None: the launcher's default_pack_heads

    def __str__(self) -> str:
        return (f"gluon block_n={self.block_n} stages={self.stages} maxnreg={self.maxnreg} "
                f"splits x{self.split_factor:g}" + (f" pack_heads={self.pack_heads}" if self.pack_heads else ""))

    def options(self) -> dict:
        opts = {"kernel": "gluon", "block_n": self.block_n, "stages": self.stages, "maxnreg": self.maxnreg,
                "split_factor": self.split_factor}
        if self.pack_heads is not None:
            opts["pack_heads"] = self.pack_heads
        return opts


# the H200 sweep (benchmarks/gluon_sweep.py, docs/perf.md): 2 stages always won; block_n 32 at INT4;
# one head per program (pack_heads=1) is tried beside the default packing for small batches
# register caps: 128 and 168 won at 32-token tiles with scales loaded at each tile's start, 192 at 64-token
# tiles (fourth session's sweep, `git show 6178656:docs/perf.md`); 128 at 64-token tiles spills
# split_factor is in waves of resident programs for this kernel (gluon/launch_defaults.py wave_splits): one full
# wave was best or within 2% of the best at every large shape (fifth session's split sweep), 2 and 3 tie at some
GLUON_CANDIDATES = tuple(GluonConfig(bn, 2, r, f, p) for p in (None, 1) for bn in (32, 64)
                         for r in ((None, 128, 168) if bn == 32 else (None, 192)) for f in (1.0, 2.0, 3.0))

# the sources that decide what the kernel does and how fast: a tuned entry is kept only for them. Every module of
# this package that kernel.py or launch.py imports is one (kernel.py's tile_* helpers, launch_defaults.py's
# constexprs and wave splits, decode_args.py's kernel arguments, lower.py's FoldKernel), except host-only ones that
# take no tuned config (eager.py's and prepared.py's bound calls, the warpgroup template's warpgroup*.py);
# tests/backends/test_autotune.py checks the list
register_tuned_kernel(TunedKernel("gluon", GluonConfig, tuple(HERE / name for name in (
    "kernel.py", "split_merge.py", "tile_scores.py", "tile_values.py", "tile_operands.py", "tile_memory.py",
    "tile_dequant.py", "tile_groups.py", "operands.py", "launch.py", "launch_defaults.py", "decode_args.py",
    "lower.py")) + (
    HERE.parent / "runtime" / "merge.py",)))
