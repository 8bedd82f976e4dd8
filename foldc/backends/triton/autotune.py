"""Autotuning of the generated kernel's launch configuration, cached per shape bucket.

A configuration is (block_n, num_warps, num_stages, split factor). `tune` times each candidate
with triton's do_bench on the caller's tensors and stores the best under a key made of the GPU
name, the torch and triton versions, a fingerprint of the kernel's sources (a changed kernel
tunes again), the spec, the query dtype and a shape bucket (batch
rounded up to a power of two, tokens to a power of two). The cache is a JSON file under
$FOLDC_CACHE_DIR (default ~/.cache/foldc) and survives restarts; `TritonAttention` looks it up
when no configuration was given explicitly.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
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
KERNEL_SOURCES = {"triton": ("codegen.py", "launch.py"),
                  "gluon": ("../gluon/kernel.py", "../gluon/tile_operands.py", "../gluon/tile_memory.py",
                            "../gluon/operands.py", "../gluon/launch.py")}
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


def _progress(i: int, n: int, label: str) -> None:
    width = 24
    done = int(width * i / n)
    sys.stderr.write(f"\r  tuning {label:<40.40} [{'#' * done}{'.' * (width - done)}] {i}/{n}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


# candidates within CONFIRM_WITHIN of the fastest first reading (at most CONFIRM_FINALISTS) are timed
# CONFIRM_ROUNDS more times before one is picked
CONFIRM_FINALISTS, CONFIRM_WITHIN, CONFIRM_ROUNDS = 3, 0.05, 2


def tune(spec, q, k, v, seq_lens=None, fold_policy="auto", candidates=CANDIDATES, label: str = "",
         rep_ms: int = 40) -> tuple[Config, float]:
    """Time every candidate on these tensors, store and return (best config, its microseconds)."""
    from ...compile import compile as compile_attention

    kernel = "gluon" if candidates and isinstance(candidates[0], GluonConfig) else "triton"
    key = bucket_key(spec, q.dtype, q.shape[0], k.shape[2] if hasattr(k, "shape") else k.num_tokens, fold_policy,
                     kernel)
    timed = []         # [microseconds, config, call] of every candidate that ran
    launches = set()   # what the register-operand candidates launch: equal launches are timed once
    for i, cfg in enumerate(candidates):
        _progress(i, len(candidates), label or spec.describe())
        try:
            if isinstance(cfg, GluonConfig):
                attn = compile_attention(spec, target="sm_90", **cfg.options())
                launch = _gluon_launch(attn, q, k, seq_lens)
                if launch in launches:   # e.g. 1, 2 and 3 waves at batch 1, where every split count is capped
                    continue
                launches.add(launch)
            else:
                attn = compile_attention(spec, target="auto", kernel="triton", fold_policy=fold_policy,
                                         **launch_options(cfg, spec, q, k))
            call = (lambda attn=attn: attn(q, k, v, seq_lens=seq_lens))
            us = _time_us(call, rep_ms)
        except Exception as e:  # a config the compiler rejects (e.g. out of shared memory) is skipped
            print(f"\n  skipped {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
            continue
        timed.append([us, cfg, call])
    _progress(len(candidates), len(candidates), label or spec.describe())
    if not timed:
        raise RuntimeError(f"no launch configuration compiled for {spec.describe()}")
    best_us, best, _ = min(timed, key=lambda t: t[0])
    # the closest few are timed again, in alternating rounds, and ranked by the median of their
    # readings: one lucky first reading should not pick the config (readings of one launch differ
    # by a few percent, docs/perf.md)
    finalists = [t for t in sorted(timed, key=lambda t: t[0])[:CONFIRM_FINALISTS]
                 if t[0] <= best_us * (1 + CONFIRM_WITHIN)]
    if len(finalists) > 1:
        readings = [[t[0]] for t in finalists]
        for _ in range(CONFIRM_ROUNDS):
            for t, seen in zip(finalists, readings):
                seen.append(_time_us(t[2], rep_ms))
        medians = [statistics.median(seen) for seen in readings]
        j = min(range(len(finalists)), key=medians.__getitem__)
        best_us, best = medians[j], finalists[j][1]
    store(key, best, best_us)
    return best, best_us


def _time_us(fn, rep_ms: int) -> float:
    """Median microseconds of ``fn``, replayed as a CUDA graph where it captures: what serving
    engines run and what the benchmark reports. Eager calls of small shapes time the host's launch
    path (80-190 µs at batch 1 on the H200, docs/perf.md), which would pick configs at random."""
    from triton.testing import do_bench

    from ...timing import capture_graph

    if torch.cuda.is_available():
        try:
            graph = capture_graph(fn, warmup_calls=2)
            return do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median") * 1e3
        except Exception as e:  # not capturable: time eager calls
            print(f"\n  (CUDA graph capture failed, timing eager calls: {type(e).__name__})", file=sys.stderr)
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def _gluon_launch(attn, q, k, seq_lens) -> tuple:
    """What a register-operand launch runs for these tensors: tile, stages, register cap, packed
    heads, scale schedule and split count."""
    batch, tokens = q.shape[0], k.shape[2] if hasattr(k, "shape") else k.num_tokens
    launch = attn.launch_config(q.dtype, batch, tokens)
    splits, _ = attn.split_plan(launch, batch, tokens, q.device, q.dtype, seq_lens is not None)
    return (launch["block_n"], launch["stages"], launch["maxnreg"], launch["heads"], launch["scale_ahead"], splits)


def launch_options(cfg: Config, spec, q, k) -> dict:
    """compile() options for a config: the split count is the default heuristic x split_factor."""
    from .launch import choose_splits, num_sms
    from .layout import token_block

    tokens = k.shape[2] if hasattr(k, "shape") else k.num_tokens
    block = token_block(spec, cfg.block_n)
    splits, _ = choose_splits(q.shape[0], spec.num_kv_heads, tokens, block, num_sms(q.device))
    return {"block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "splits": max(1, int(round(splits * cfg.split_factor)))}
