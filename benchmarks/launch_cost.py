"""What one kernel launch costs the host, piece by piece (H200; evidence for the lean launch path in
foldc/backends/runtime/fast_launch.py, not a test). For the INT2 decode kernel at 1 x 16K and for an
empty one-argument kernel: triton's C launcher given tensors (each pointer checked with
cuPointerGetAttribute) and given integer addresses (no check), foldc's own C launcher (fast_c) and the
`Bound` over it, the FastLaunch key, the stream
lookups, torch.empty and a small torch op for scale. Each figure: median host µs of one call made
after the GPU went idle (``foldc.timing.host_us``) and per call of 200 back-to-back calls.

    PYTHONPATH=. python3 benchmarks/launch_cost.py --out $OUT/launch_cost.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import foldc
from foldc.bench import decode_case, gluon_call_parts
from foldc.timing import host_us


def key_2026_12_02(fast, args: tuple, kwargs: dict):
    """FastLaunch's key as of 2026-12-02 (commit a1c4de1), for a side-by-side timing: per tensor its
    dtype and alignment, per integer triton's class by a Python call; the launcher then got tensors."""
    from foldc.backends.runtime.fast_launch import _I32, _I64, _getter

    types = tuple(map(type, args))
    tensors = _getter([i for i, t in enumerate(types) if issubclass(t, torch.Tensor)])
    integers = _getter([i for i, t in enumerate(types) if t is int or t is bool])
    ints = tuple([1 if v == 1 else (v & 15 == 0, -_I32 <= v < _I32, v < _I64) for v in integers(args)])
    from triton import knobs
    return (torch.cuda.current_device(), types, ints,
            tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in tensors(args)]), tuple(kwargs.items()),
            knobs.runtime.debug, knobs.compilation.instrumentation_mode)


def burst_us(fn, calls: int = 200) -> float:
    """Host µs per call of ``calls`` calls back to back (median of 5 bursts, GPU synchronised first)."""
    import statistics

    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x16384")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    b, n = (int(x) for x in args.shape.split("x"))
    enc = foldc.Affine(2, "token", 128)
    spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
    q, k, v = decode_case(spec, b, n, seed=3)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    out = attn(q, k, v)
    parts = gluon_call_parts(attn, q, k, v, 0.1)
    dargs, kwargs, grid = parts["args"], parts["kwargs"], parts["grid"]
    decode, merge = attn._launchers()
    decode[grid](*dargs, **kwargs)
    key = decode._key(dargs, kwargs)
    ready = decode.compiled[key]
    comp = ready.compiled
    values = dargs + ready.tail
    ints = tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in values)
    dev = q.device.index
    stream = triton.runtime.driver.active.get_current_stream(dev)
    g = tuple(grid) + (1,) * (3 - len(grid))

    @triton.jit
    def empty_kernel(X):
        pass

    x1 = torch.zeros(1, device="cuda")
    cempty = empty_kernel[(1,)](x1)
    erun = cempty.run

    # foldc's own C launcher over the same launch (fast_c): packed once, the addresses and token count per call
    from foldc.backends.gluon.decode_args import TOKENS_ARG
    from foldc.backends.runtime import fast_c
    from foldc.backends.runtime.fast_launch import Bound

    count = sum(isinstance(x, torch.Tensor) for x in dargs[:14])
    own = fast_c.make_launch(comp, g, ints, count, TOKENS_ARG)
    own_empty = fast_c.make_launch(cempty, (1, 1, 1), (x1.data_ptr(),), 1)
    assert own is not None and own_empty is not None, fast_c._failed
    addresses, tokens = ints[:count], ints[TOKENS_ARG]
    own_bound = Bound(own, dev)

    sig = getattr(comp.src, "signature", {})
    print("decode signature kinds:", {t: list(sig.values()).count(t) for t in set(sig.values())}, flush=True)
    print("tensors among values:", sum(isinstance(x, torch.Tensor) for x in values), "of", len(values), flush=True)

    steps = {
        "decode: C launcher, tensors": lambda: ready.direct(*g, stream, comp.function, *ready.head,
                                                             comp.packed_metadata, None, None, None, *values),
        "decode: C launcher, integer addresses": lambda: ready.direct(*g, stream, comp.function, *ready.head,
                                                                       comp.packed_metadata, None, None, None, *ints),
        "decode: foldc's C launcher (fast_c), integer addresses": lambda: own(stream, *addresses, tokens),
        "decode: foldc's Bound (fast_c), integer addresses": lambda: own_bound(addresses, (tokens,)),
        "decode: addresses of the tensors (data_ptr)": lambda: tuple(
            [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in values]),
        "decode: FastLaunch key": lambda: decode._key(dargs, kwargs),
        "decode: the 2026-12-02 key": lambda: key_2026_12_02(decode, dargs, kwargs),
        "decode: the 2026-12-02 key, then the launcher with tensors": lambda: (
            key_2026_12_02(decode, dargs, kwargs),
            ready.direct(*g, stream, comp.function, *ready.head, comp.packed_metadata, None, None, None, *values)),
        "decode: FastLaunch launch": lambda: decode[grid](*dargs, **kwargs),
        "whole call (out given)": lambda: attn(q, k, v, out=out),
        "empty kernel: C launcher, tensor": lambda: erun.launch(1, 1, 1, stream, cempty.function, *ready.head,
                                                                cempty.packed_metadata, None, None, None, x1),
        "empty kernel: C launcher, integer": lambda: erun.launch(1, 1, 1, stream, cempty.function, *ready.head,
                                                                 cempty.packed_metadata, None, None, None,
                                                                 x1.data_ptr()),
        "empty kernel: foldc's C launcher (fast_c)": lambda: own_empty(stream, x1.data_ptr()),
        "driver get_current_stream": lambda: triton.runtime.driver.active.get_current_stream(dev),
        "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(dev),
        "torch.cuda.current_device": torch.cuda.current_device,
        "torch.empty(8, 32) cuda": lambda: torch.empty(8, 32, device=q.device),
        "torch.add_(x1, 1) (a torch launch)": lambda: x1.add_(1.0),
    }
    rows = {}
    for name, fn in steps.items():
        fn()
        rows[name] = dict(idle=host_us(fn, 300), burst=burst_us(fn))
        print(f"{name:<48} idle {rows[name]['idle']:7.2f} µs   burst {rows[name]['burst']:7.2f} µs", flush=True)
    torch.cuda.synchronize()
    Path(args.out).write_text(json.dumps(dict(shape=args.shape, device=torch.cuda.get_device_name(), rows=rows),
                                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
