"""The Python of a serving cache's decode step, with stand-in kernels that launch nothing (CPU, no GPU): what is
left of a step's host time once its launches are taken out. Evidence for docs/perf.md, not a test.

    python3 benchmarks/step_python.py [--out step_python.json]

A `QuantizedKVCache` shaped as a ~1B Llama's layer (16 query / 4 KV heads of 128, INT4 token-wise, 8K tokens), its
body attention the register-operand launcher with stand-in decode and merge kernels, its appends' kernel a stand-in
too; each figure the median µs of one call over 2000 calls. "cold" rows: other Python runs between the calls (a
walk over 30,000 dicts), as a model's other layers run between one layer's steps: the interpreter's caches no
longer hold the step's code and objects, which is what a step costs inside a whole forward (a step takes 2-4x its
time in a tight loop there, on this CPU and in the H200 runs of docs/perf.md). Last, a `PagedKVCache` straight to
pages (its append kernel and its page-table launches standing in): one layer's decode append and attention
at batch 1 and 64.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


class _Bound:
    def __call__(self, addresses, values=()) -> bool:
        return True

    def then(self, addresses, values, second, addresses2) -> int:   # as fast_launch.Bound.then
        return 2 if second(addresses2) else 1


class _Kernel:
    """Stands in for a `FastLaunch`: launches nothing, binds a `_Bound`."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def bind(self, grid, args, kwargs, dynamic=()):
        return _Bound()


_JUNK = [{"a": i, "b": str(i)} for i in range(210000)]


def _other_python() -> int:
    """What a model's other layers do to the interpreter's caches between two steps of one layer."""
    total = 0
    for d in _JUNK[::7]:
        total += d["a"]
    return total


def median_us(fn, calls: int = 2000, cold: bool = False) -> float:
    took = []
    for _ in range(calls):
        if cold:
            _other_python()
        start = time.perf_counter()
        fn()
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    import foldc
    from foldc.backends.gluon.launch import GluonAttention
    from foldc.serving import append as append_module
    from foldc.serving.cache import QuantizedKVCache

    class StandIn(GluonAttention):
        def resident(self, *args):   # no GPU to compile on
            return 12

        def _launchers(self):
            return self._stand_ins

    enc = foldc.Affine(4, "token", 128)
    spec = foldc.AttentionSpec(16, 4, 128, enc, enc)
    append_module._fast = lambda name, interpret: _Kernel()
    cache = QuantizedKVCache(spec, 1, 20000, target="interpret")
    cache._append_mode = "native"   # as on a GPU, the launches standing in
    body = StandIn(spec)
    body._stand_ins = (_Kernel(), _Kernel())
    cache._body_attention = body
    gen = torch.Generator().manual_seed(0)
    cache.append(*(torch.randn(1, 4, 8192, 128, generator=gen).half() for _ in range(2)))
    # the new key as the rotary embedding makes it, the value a view of a transpose (as in transformers)
    k1 = torch.randn(1, 4, 1, 128, generator=gen).half()
    v1 = torch.randn(1, 1, 4, 128, generator=gen).half().transpose(1, 2)
    q = torch.randn(1, 16, 128, generator=gen).half()

    def step():
        cache.append(k1, v1)
        cache.attention(q)

    for _ in range(5):
        step()
    rows = {"append": median_us(lambda: cache.append(k1, v1)), "attention": median_us(lambda: cache.attention(q)),
            "append + attention": median_us(step)}
    cache.reset()
    cache.append(*(torch.randn(1, 4, 8192, 128, generator=gen).half() for _ in range(2)))
    rows.update({"append, cold": median_us(lambda: cache.append(k1, v1), 1500, cold=True),
                 "attention, cold": median_us(lambda: cache.attention(q), 1500, cold=True),
                 "append + attention, cold": median_us(step, 1500, cold=True)})
    # a PagedKVCache straight to pages (no sink, no window): one layer's decode append at batch 1 and 64
    from foldc.serving import PagedKVCache

    for batch in (1, 64):
        paged = PagedKVCache(spec, num_layers=1, page_size=64, num_pages=64 * batch, max_seq_len=4096)
        paged._append_interpret = False   # native, its kernels standing in
        wrapper = paged.wrapper   # its attention the register-operand launcher, kernels standing in
        wrapper.attention = StandIn(spec, block_n=64)
        wrapper.attention._stand_ins = (_Kernel(), _Kernel())
        wrapper.register_operand, wrapper.interpret, wrapper._dtypes = True, False, (torch.float16, torch.bfloat16)
        paged.plan(torch.arange(0, 64 * batch + 1, 64, dtype=torch.int32), torch.arange(64 * batch, dtype=torch.int32),
                   seq_lens=[0] * batch)
        paged.append(0, *(torch.randn(batch, 4, 64, 128, generator=gen).half() for _ in range(2)))
        kp, vp = (torch.randn(batch, 4, 1, 128, generator=gen).half() for _ in range(2))
        qp = torch.randn(batch, 16, 128, generator=gen).half()
        rows[f"paged append, batch {batch}"] = median_us(lambda: paged.append(0, kp, vp), 2000)
        for _ in range(3):
            paged.attention(0, qp)
        rows[f"paged attention, batch {batch}"] = median_us(lambda: paged.attention(0, qp), 2000)
    for name, us in rows.items():
        print(f"{name:20} {us:6.1f} µs")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(host_python_us=rows, cpu=os.cpu_count()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
