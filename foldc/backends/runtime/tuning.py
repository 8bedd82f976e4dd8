"""The tuning cache both attention backends read: one launch configuration type per kernel
(`Config` for the generated Triton kernel, `GluonConfig` for the register-operand kernel), keyed
by GPU, versions, a fingerprint of the kernel's sources, the spec, the query dtype and a shape
bucket. Tuning itself (which times candidates through foldc.compile) is foldc.tune.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


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
# tiles (fourth session's sweep, docs/perf.md); 128 at 64-token tiles spills
# split_factor is in waves of resident programs for this kernel (gluon/launch.py wave_splits): one full
# wave was best or within 2% of the best at every large shape (fifth session's split sweep), 2 and 3 tie at some
GLUON_CANDIDATES = tuple(GluonConfig(bn, 2, r, f, p) for p in (None, 1) for bn in (32, 64)
                         for r in ((None, 128, 168) if bn == 32 else (None, 192)) for f in (1.0, 2.0, 3.0))


def cache_path() -> Path:
    root = os.environ.get("FOLDC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldc")
    return Path(root) / "autotune.json"


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# the sources that decide what a kernel does and how fast: a tuned entry is kept only for them
KERNEL_SOURCES = {"triton": ("../triton/codegen.py", "../triton/launch.py", "merge.py"),
                  "gluon": ("../gluon/kernel.py", "../gluon/tile_operands.py", "../gluon/tile_memory.py",
                            "../gluon/operands.py", "../gluon/launch.py", "merge.py")}
_FINGERPRINTS: dict = {}


def kernel_fingerprint(kernel: str) -> str:
    """Eight hex digits of the kernel's source files, so that a cache tuned against an older kernel
    is not applied to a changed one (its buckets simply tune again)."""
    if kernel not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for name in KERNEL_SOURCES[kernel]:
            digest.update((Path(__file__).parent / name).read_bytes())
        _FINGERPRINTS[kernel] = digest.hexdigest()[:8]
    return _FINGERPRINTS[kernel]


def bucket_key(spec, dtype: torch.dtype, batch: int, tokens: int, fold_policy: str = "auto",
               kernel: str = "triton") -> str:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    policy = fold_policy if kernel == "triton" else f"{fold_policy}|{kernel}"
    return (f"{gpu}|torch {torch.__version__}|triton {triton.__version__}|kernel {kernel_fingerprint(kernel)}|"
            f"{spec.describe()}|{policy}|{str(dtype).replace('torch.', '')}|batch<={_pow2_ceil(batch)}|"
            f"tokens<={_pow2_ceil(tokens)}")


_MEMO: dict = {}  # path -> data, read once per process; `store` keeps it current


def load_cache(refresh: bool = False) -> dict:
    """The tuning cache. Read from disk once per process (the hot path never touches the file);
    ``refresh=True`` re-reads it, e.g. after another process tuned."""
    path = str(cache_path())
    if refresh or path not in _MEMO:
        try:
            _MEMO[path] = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError):
            _MEMO[path] = {}  # missing or damaged: only costs a re-tune
    return _MEMO[path]


_KEYS: dict = {}


def lookup(spec, dtype, batch, tokens, fold_policy="auto", kernel: str = "triton"):
    """The tuned config (Config, or GluonConfig for kernel="gluon") of this call's bucket, or None.
    Cheap on the hot path: the key is memoised and the file is parsed once per change."""
    memo = (spec, dtype, _pow2_ceil(batch), _pow2_ceil(tokens), fold_policy, kernel)
    key = _KEYS.get(memo)
    if key is None:
        key = _KEYS[memo] = bucket_key(spec, dtype, batch, tokens, fold_policy, kernel)
    entry = load_cache().get(key)
    if not entry:
        return None
    return GluonConfig(**entry["config"]) if entry.get("kernel") == "gluon" else Config(**entry["config"])


def store(key: str, config, micros: float) -> None:
    data = dict(load_cache(refresh=True))  # merge with what other processes stored meanwhile
    data[key] = {"config": asdict(config), "us": micros,
                 "kernel": "gluon" if isinstance(config, GluonConfig) else "triton"}
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    _MEMO[str(path)] = data
