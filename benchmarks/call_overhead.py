"""Where the host time of one eager register-operand call goes: each step of
`GluonAttention.__call__` timed alone (median of many calls, GPU idle), and cProfile of whole calls
sorted by cumulative time (H200; evidence for docs/perf.md, not a test). Beside it, in the same run,
cuDNN SDPA bf16 on the same shape: its host time per call, and both kernels' time per call when
called back to back (no sync between calls: what an eager loop sees).

    PYTHONPATH=. python3 benchmarks/call_overhead.py --shape 1x16384 --out $OUT/overhead.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

import foldc
from foldc.backends.runtime.launch import allocate_workspace
from foldc.bench import decode_case, gluon_call_parts
from foldc.bench import selected as bench_selected
from foldc.timing import back_to_back_us, host_us
from foldc.validate import check_call, output_buffer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x16384")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    b, n = (int(x) for x in args.shape.split("x"))
    enc = foldc.Affine(args.bits, "token", 128)
    spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
    q, k, v = decode_case(spec, b, n, seed=b + n)
    # the steps below are those of a call of two launches (the decode, then the merge kernel); `merging` is the
    # default launcher, whose one-wave eager calls merge their splits inside the decode (split_merge.py)
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    attn.merge_in_decode = False
    merging = foldc.compile(spec, "sm_90", kernel="gluon")
    out = attn(q, k, v)
    for _ in range(2):
        merging(q, k, v, out=out)
    parts = gluon_call_parts(attn, q, k, v, 0.1)
    launch, splits, per_split, ws = parts["launch"], parts["splits"], parts["per_split"], parts["ws"]
    dargs, kwargs, grid = parts["args"], parts["kwargs"], parts["grid"]
    lse = torch.empty(b, spec.num_q_heads, device="cuda")
    decode, merge = attn._launchers()
    # the same call with the launches never bound (`FastLaunch.bind`): every launch keyed by FastLaunch
    from foldc.backends.gluon.launch import GluonAttention

    from foldc.backends.runtime.fast_launch import Bindings

    class Never(Bindings):   # notes nothing, so binds nothing
        def note(self, *args):
            pass

    unbound = GluonAttention(spec)
    unbound.merge_in_decode = False
    unbound._bindings = Never()
    unbound(q, k, v, out=out)
    attn(q, k, v, out=out)   # the second call with one key binds

    class NoMemo:   # holds nothing: every call takes the whole path (validation, launch memo, binding key)
        def run(self, *args):
            return None

        def note(self, *args):
            pass

        def clear(self):
            pass

    whole_path = GluonAttention(spec)
    whole_path.merge_in_decode = False
    whole_path._eager = NoMemo()
    for _ in range(2):
        whole_path(q, k, v, out=out)
    bound = attn._bindings.bound()[0]
    from foldc.backends.gluon.decode_args import decode_addresses

    # a serving cache's repeated run (`GluonAttention.prepare`): k, v and the buffers' addresses made once
    plan = attn.plan_launch(q.dtype, b, n, q.device, k=k, v=v)
    prepared = attn.prepare(plan, k, v, allocate_workspace(plan, q.device), lse, 0.1)
    merging_prepared = merging.prepare(plan, k, v, allocate_workspace(plan, q.device), lse, 0.1)
    for _ in range(3):
        prepared(q, out, n)
        merging_prepared(q, out, n)
    # a serving engine's paged call: `PagedDecodeWrapper.run` over 64-token pages holding the same tokens
    from foldc.serving import PagedDecodeWrapper, page_pool

    page, pages_each = 64, -(-n // 64)
    wrapper = PagedDecodeWrapper(spec, page, max_seq_len=n, device="cuda")
    pools = {}
    for name, x in (("k", k), ("v", v)):
        pool = page_pool(spec, name, b * pages_each, page, device="cuda")
        for part in ("codes", "scale", "zero"):   # each sequence's tokens, page after page
            src = getattr(x, part)
            getattr(pool, part).view(b, pages_each, *src.shape[1:2], page, *src.shape[3:]).copy_(
                src.view(b, src.shape[1], pages_each, page, *src.shape[3:]).transpose(1, 2))
        pools[name] = pool
    wrapper.plan(torch.arange(0, b * pages_each + 1, pages_each, dtype=torch.int32, device="cuda"),
                 torch.arange(b * pages_each, dtype=torch.int32, device="cuda"), None, num_pages=b * pages_each,
                 seq_lens=[n] * b)
    paged_out = wrapper.run(q, pools["k"], pools["v"], sm_scale=0.1)
    print(f"paged against contiguous: max |diff| {(paged_out.float() - attn(q, k, v, 0.1).float()).abs().max():.2e}")
    steps = {
        "prepared run (bound launches, addresses made once)": lambda: prepared(q, out, n),
        "prepared run, merging inside the decode": lambda: merging_prepared(q, out, n),
        "PagedDecodeWrapper.run (64-token pages), out given": lambda: wrapper.run(q, pools["k"], pools["v"],
                                                                                  sm_scale=0.1, out=out),
        "whole call, merging inside the decode (the default)": lambda: merging(q, k, v, out=out),
        "whole call": lambda: attn(q, k, v, out=out),
        "whole call, new out": lambda: attn(q, k, v),
        "whole call without the memo of bound calls (the whole path)": lambda: whole_path(q, k, v, out=out),
        "whole call, launches not bound": lambda: unbound(q, k, v, out=out),
        "bound decode launch (addresses included)": lambda: bound[0](decode_addresses(q, k, v, None, ws), (n,)),
        "bound merge launch (addresses included)": lambda: bound[1]((*(t.data_ptr() for t in ws), out.data_ptr(),
                                                                     lse.data_ptr())),
        "check_call": lambda: check_call(spec, q, k, v, None, None),
        "launch_config (memoised)": lambda: attn.launch_config(q.dtype, b, n),
        "split_plan": lambda: attn.split_plan(launch, b, n, q.device, q.dtype),
        "workspace (3 empties)": lambda: attn.workspace(launch, b, splits, q.device),
        "output_buffer(out)": lambda: output_buffer(out, tuple(out.shape), q),
        "lse empty": lambda: torch.empty(b, spec.num_q_heads, device=q.device, dtype=torch.float32),
        "decode_arguments": lambda: attn.decode_arguments(launch, q, k, v, None, ws, 0.1, per_split, n, None),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "decode launch (FastLaunch)": lambda: decode[grid](*dargs, **kwargs),
        "launch() both kernels": lambda: attn.launch(launch, q, k, v, None, ws, out, lse, 0.1, per_split, splits, n),
    }
    from torch.nn.attention import SDPBackend

    from foldc.bench import sdpa_peer

    kd, vd = (x.dequantize().to(torch.bfloat16).contiguous() for x in (k, v))
    # cuDNN selected once around its measurements (torch's sdpa_kernel context inside each call added about 10 µs of
    # host time to cuDNN's: a serving engine selects its backend once)
    cudnn = sdpa_peer(SDPBackend.CUDNN_ATTENTION)(q, kd, vd)
    steps["FastLaunch key (decode)"] = lambda: decode._key(dargs, kwargs)
    for name, fast in (("decode", decode), ("merge", merge)):
        for ready in fast.compiled.values():
            run = ready.compiled.run
            print(f"{name}: direct launch {ready.direct is not None}; scratch {getattr(run, 'global_scratch_size', '?')}"
                  f" / {getattr(run, 'profile_scratch_size', '?')}; {len(ready.tail)} constexprs", flush=True)
    rows = {name: host_us(fn, 300) for name, fn in steps.items()}
    with cudnn.selected():
        rows["cuDNN SDPA bf16 call"] = host_us(cudnn, 300)
    for name, us in rows.items():
        print(f"{name:<32} {us:8.2f} us", flush=True)
    for name, fn in (("foldc", lambda: attn(q, k, v)), ("foldc merging", lambda: merging(q, k, v)),
                     ("cuDNN", cudnn)):
        with bench_selected(fn):
            rows[f"back to back: {name}"] = back_to_back_us(fn)
        print(f"back to back, per call: {name:<10} {rows[f'back to back: {name}']:8.2f} us", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        attn(q, k, v, out=out)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    print(text.getvalue())
    Path(args.out).write_text(json.dumps(dict(shape=args.shape, bits=args.bits, steps_us=rows,
                                              profile=text.getvalue()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
