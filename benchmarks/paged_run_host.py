"""Host time of `PagedDecodeWrapper.run` on the CPU, its launches stood in for (tests/serving/_stand_in_wrapper.py):
the Python a serving loop's eager call pays before the driver's launches, beside the prepared run alone (the launches'
share). INT2 token-wise g128, 32/8 heads, 1 x 16K tokens over 64-token pages, `out` given, 20000 calls each.

    PYTHONPATH=. python3 benchmarks/paged_run_host.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "serving"), str(ROOT / "tests" / "backends")]


class _Patch:   # what the stand-in takes as pytest's monkeypatch
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def per_call_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> int:
    from _stand_in_wrapper import stand_in_register_operand

    from foldc import Affine, AttentionSpec
    from foldc.serving import PagedDecodeWrapper, page_pool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    enc = Affine(2, "token", 128)
    spec = AttentionSpec(32, 8, 128, enc, enc)
    wrapper = PagedDecodeWrapper(spec, 64, max_seq_len=16384, device="cpu")
    stand_in_register_operand(wrapper, spec, _Patch())
    pools = [page_pool(spec, name, 256, 64) for name in "kv"]
    wrapper.plan(torch.tensor([0, 256], dtype=torch.int32), torch.arange(256, dtype=torch.int32), None, num_pages=256,
                 seq_lens=[16384])
    q = torch.randn(1, 32, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = torch.empty_like(q)
    row = {"run, out given": per_call_us(lambda: wrapper.run(q, *pools, out=out, sm_scale=0.1), args.calls)}
    prepared = wrapper.prepared_run(q.dtype, 0.1, *pools)
    row["the prepared run alone"] = per_call_us(lambda: prepared(q, out), args.calls)
    for name, us in row.items():
        print(f"{name:<24} {us:6.2f} µs")
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
