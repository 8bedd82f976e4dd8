"""The tuning cache both attention backends read: one launch configuration type per kernel,
registered by its backend (`register_tuned_kernel`: the Triton kernel's `Config`, the
register-operand kernel's `GluonConfig`), entries keyed by GPU, versions, a fingerprint of the
kernel's sources, the spec, the query dtype and a shape bucket. Tuning itself (which times
candidates through foldc.compile) is foldc.tune.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:   # not POSIX: stores of two processes are not serialised (one may drop the other's entry)
    fcntl = None

from ...errors import SpecError
from ...options import check_block_n, check_int, check_num_stages, check_num_warps, check_stages


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


def device_name(device=None) -> str:
    """The name of the GPU whose tuned entries a call reads: ``device``'s, the device of the call's tensors (on a host
    with two kinds of card, a call on cuda:1 while cuda:0 is current is tuned for cuda:1's); "cpu" for another
    device; None (a caller without tensors): the current GPU's; "cpu" where there is none (a launch planned for
    "cuda" on a host without a GPU, as before)."""
    device = None if device is None else torch.device(device)
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device)   # (None, or "cuda" without an index: the current GPU)


def bucket_key(spec, dtype: torch.dtype, batch: int, tokens: int, fold_policy: str = "auto",
               kernel: str = "triton", device=None) -> str:
    """The cache key of a call's bucket on ``device`` (its tensors' device; None: the current GPU, `device_name`)."""
    import triton

    gpu = device_name(device)
    policy = fold_policy if kernel == "triton" else f"{fold_policy}|{kernel}"
    return (f"{gpu}|torch {torch.__version__}|triton {triton.__version__}|kernel {kernel_fingerprint(kernel)}|"
            f"{spec.describe()}|{policy}|{str(dtype).replace('torch.', '')}|batch<={_pow2_ceil(batch)}|"
            f"tokens<={_pow2_ceil(tokens)}")


_MEMO: dict = {}  # path -> data, read once per process; `store` keeps it current


def _ignored(what: str) -> None:
    warnings.warn(f"foldc tuning cache {str(cache_path())!r}: {what}; ignored (the defaults run; `foldc.tune` "
                  "writes a fresh entry, or delete the file)", RuntimeWarning, stacklevel=3)


def load_cache(refresh: bool = False) -> dict:
    """The tuning cache. Read from disk once per process (the hot path never touches the file);
    ``refresh=True`` re-reads it, e.g. after another process tuned. A file that is not a JSON object
    (damaged, not UTF-8, a folder) reads as empty, with a warning: it only costs a re-tune."""
    path = str(cache_path())
    if refresh or path not in _MEMO:
        try:
            data = json.loads(Path(path).read_bytes())
        except FileNotFoundError:
            data = {}
        except (OSError, ValueError, RecursionError) as e:   # JSONDecodeError, UnicodeDecodeError; deep nesting
            _ignored(f"cannot be read as JSON ({type(e).__name__}: {e})")
            data = {}
        if not isinstance(data, dict):
            _ignored(f"holds a JSON {type(data).__name__}, not an object of entries")
            data = {}
        _MEMO[path] = data
    return _MEMO[path]


def _split_factor(value, kernel, spec) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 64:   # NaN too
        raise SpecError(f"split_factor={value!r} must be a number in (0, 64]")
    return value


def _pack_heads(value, kernel, spec) -> int:
    check_int("pack_heads", value, 1, spec.num_kv_heads, power_of_two=True)
    if spec.num_kv_heads % value:
        raise SpecError(f"pack_heads={value!r} does not divide num_kv_heads={spec.num_kv_heads}")
    return value


#: the rule of each tuned field (foldc/options.py's, where the launch option has one); a stored value
#: outside it was not written by `store` (a hand-edited or damaged file) and would reach the kernel unchecked
FIELD_RULES = {
    "block_n": lambda v, kernel, spec: check_block_n(v, kernel),   # (64.0 refused there, as in options)
    "num_warps": lambda v, kernel, spec: check_num_warps(v),
    "num_stages": lambda v, kernel, spec: check_num_stages(v),
    "stages": lambda v, kernel, spec: check_stages(v),
    "maxnreg": lambda v, kernel, spec: check_int("maxnreg", v, 32, 255),
    "split_factor": _split_factor,
    "pack_heads": _pack_heads,
}


def _config_of(entry, kernel: str, spec):
    """The config a cache entry holds for ``kernel``, or the reason it cannot be applied."""
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        return None, f"is {entry!r}, not {{'config': {{...}}, 'kernel': ...}}"
    if entry.get("kernel", "triton") != kernel:
        return None, f"holds kernel={entry.get('kernel')!r} under a {kernel!r} key"
    config_type = _KERNELS[kernel].config_type
    try:
        config = config_type(**entry["config"])
    except TypeError as e:
        return None, f"is not a {config_type.__name__}: {e}"
    for f in fields(config):
        value = getattr(config, f.name)
        if value is None and f.default is None:
            continue
        try:
            if value is None or isinstance(value, bool) or f.name not in FIELD_RULES:
                raise SpecError(f"{f.name}={value!r} is not a tuned value of foldc's")
            FIELD_RULES[f.name](value, kernel, spec)
        except SpecError as e:
            return None, str(e)
    return config, None


_KEYS: dict = {}


def lookup(spec, dtype, batch, tokens, fold_policy="auto", kernel: str = "triton", device=None):
    """The tuned config (the registered config type of ``kernel``) of this call's bucket on ``device`` (the device of
    the call's tensors, whose GPU keys the entry; None: the current GPU), or None.
    Cheap on the hot path: the key is memoised and the file is parsed once per change."""
    memo = (spec, dtype, _pow2_ceil(batch), _pow2_ceil(tokens), fold_policy, kernel, device)
    key = _KEYS.get(memo)
    if key is None:
        key = _KEYS[memo] = bucket_key(spec, dtype, batch, tokens, fold_policy, kernel, device)
    entry = load_cache().get(key)
    if entry is None:
        return None
    config, reason = _config_of(entry, kernel, spec)
    if reason is not None:
        _ignored(f"entry {key!r} {reason}")
    return config


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold an exclusive lock on ``path``'s sibling ``.lock`` file (POSIX flock; every opening conflicts, so threads
    and processes alike wait their turn); no lock where the folder cannot take the file (store's write warns)."""
    fd = None
    if fcntl is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)   # releases the lock


def store(key: str, config, micros: float) -> None:
    """Add one tuned entry to the cache file. Read, merge and replace run under a lock: two processes tuning at once
    each read the file, added their entry and wrote it back, and the later write dropped the earlier one's."""
    kernel = next(k.name for k in _KERNELS.values() if isinstance(config, k.config_type))
    path = cache_path()
    with _exclusive(path):
        data = dict(load_cache(refresh=True))  # merge with what other processes stored meanwhile
        data[key] = {"config": asdict(config), "us": micros, "kernel": kernel}
        _MEMO[str(path)] = data   # this process keeps the entry even where the file cannot take it
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")   # one per writing thread
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            warnings.warn(f"foldc tuning cache {str(path)!r} cannot be written ({e.strerror or e}): the tuned "
                          "config holds for this process only; set FOLDC_CACHE_DIR to a writable folder",
                          RuntimeWarning, stacklevel=2)
