"""The tuning cache both attention backends read: one launch configuration type per kernel,
registered by its backend (`register_tuned_kernel`: the Triton kernel's `Config`, the
register-operand kernel's `GluonConfig`), entries keyed by GPU, versions, a fingerprint of the
kernel's sources, the spec, the query dtype and a shape bucket. Tuning itself (which times
candidates through foldc.compile) is foldc.tune.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TunedKernel:
    """A kernel the cache holds configurations for: its launch-configuration type (a frozen
    dataclass whose fields are its tuned options) and the source files whose fingerprint keys its
    entries (a changed kernel tunes again)."""

    name: str
    config_type: type
    sources: tuple


_KERNELS: dict[str, TunedKernel] = {}
_FINGERPRINTS: dict = {}


def register_tuned_kernel(kernel: TunedKernel) -> TunedKernel:
    """Called by each backend on import (foldc/backends/triton/tuning.py, foldc/backends/gluon/tuning.py)."""
    _KERNELS[kernel.name] = kernel
    _FINGERPRINTS.pop(kernel.name, None)
    return kernel


def tuned_kernel(name: str) -> TunedKernel:
    return _KERNELS[name]


def cache_path() -> Path:
    root = os.environ.get("FOLDC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldc")
    return Path(root) / "autotune.json"


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())




def kernel_fingerprint(kernel: str) -> str:
    """Eight hex digits of the kernel's source files, so that a cache tuned against an older kernel
    is not applied to a changed one (its buckets simply tune again)."""
    if kernel not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for path in _KERNELS[kernel].sources:
            digest.update(Path(path).read_bytes())
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
    """The tuned config (the registered config type of ``kernel``) of this call's bucket, or None.
    Cheap on the hot path: the key is memoised and the file is parsed once per change."""
    memo = (spec, dtype, _pow2_ceil(batch), _pow2_ceil(tokens), fold_policy, kernel)
    key = _KEYS.get(memo)
    if key is None:
        key = _KEYS[memo] = bucket_key(spec, dtype, batch, tokens, fold_policy, kernel)
    entry = load_cache().get(key)
    if not entry:
        return None
    return _KERNELS[entry.get("kernel", "triton")].config_type(**entry["config"])


def store(key: str, config, micros: float) -> None:
    data = dict(load_cache(refresh=True))  # merge with what other processes stored meanwhile
    kernel = next(k.name for k in _KERNELS.values() if isinstance(config, k.config_type))
    data[key] = {"config": asdict(config), "us": micros, "kernel": kernel}
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    _MEMO[str(path)] = data
