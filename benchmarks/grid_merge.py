"""The register-operand decode kernel merging its own splits in one cooperative launch (its MERGE build,
foldc/backends/gluon/split_merge.py), beside production's two launches (the decode, then the merge kernel): one
driver launch a call instead of two.

Per shape, on one GPU: the error of both against float64, the host time of one call on an idle GPU (production's whole
eager call with and without `merge_in_decode`, and the merging launch bound alone), the time per call back to back,
and the GPU time in CUDA-graph replay (L2 flushed; production's graphs launch the merge kernel, the merging launch is
captured alone for its GPU time):

    PYTHONPATH=. python3 benchmarks/grid_merge.py --out $OUT/grid_merge.json
    PYTHONPATH=. python3 benchmarks/grid_merge.py --variants production,packed,sleep --out $OUT/barriers.json

``--variants``: the merging launch ("fused" in the rows) with each barrier of benchmarks/variants/merge_barrier.py in
turn, each row labelled with its own.
"""
from __future__ import annotations

import argparse
import json

from foldc.backends.gluon.kernel import foldc_decode_gluon


def case(layout: str, heads: str, batch: int, tokens: int, kernel) -> dict:
    import torch

    import foldc
    from foldc.backends.gluon.decode_args import TOKENS_ARG, decode_arguments
    from foldc.backends.runtime.fast_launch import FastLaunch
    from foldc.backends.runtime.launch import allocate_workspace
    from foldc.backends.runtime.modules import num_sms
    from foldc.spec import spec_from_args
    from foldc.timing import back_to_back_us, graph_us, host_us

    spec = spec_from_args(layout, layout, heads, 128)
    gen = torch.Generator(device="cuda").manual_seed(11)
    hq, hkv = map(int, heads.split("/"))
    q = torch.randn(batch, hq, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (foldc.quantize(torch.randn(batch, hkv, tokens, 128, device="cuda", generator=gen), enc)
            for enc in (spec.k, spec.v))   # each side its own encoding object: the memo of bound calls checks it
    ref = foldc.attention_reference(q, k, v).double()
    attn = foldc.compile(spec, "sm_90", kernel="gluon")
    attn.merge_in_decode = False   # production's two launches
    merging = foldc.compile(spec, "sm_90", kernel="gluon")   # production's eager calls that merge inside
    out_p, out_m = torch.empty_like(q), torch.empty_like(q)
    for _ in range(3):   # whole path, then bound, then the memo of bound calls
        attn(q, k, v, out=out_p)
        merging(q, k, v, out=out_m)
    row = dict(layout=layout, heads=heads, batch=batch, tokens=tokens)
    launch = attn.plan_launch(q.dtype, batch, tokens, q.device, k=k, v=v)
    if launch.kernel != "gluon" or attn.config.row_blocks != 1 or attn.config.head_rows:
        row["skipped"] = f"kernel {launch.kernel}, row blocks {attn.config.row_blocks}"
        return row
    opts = launch.options
    ws = allocate_workspace(launch, q.device)
    lse = torch.empty(batch * hq, device="cuda", dtype=torch.float32)
    counter = torch.zeros(2 + batch * attn.head_programs(launch.options), device="cuda", dtype=torch.int64)
    out_f = torch.empty_like(q)
    sm_scale = 128 ** -0.5
    args, kwargs = decode_arguments(opts, q, k, v, None, ws, sm_scale, launch.per_split, tokens, None)
    args = list(args)
    args[11], args[12], args[13] = out_f, lse, counter
    args = tuple(args)
    kwargs = dict(kwargs, MERGE=True, launch_cooperative_grid=True)
    grid = (batch, attn.head_programs(opts), launch.splits)
    fused = FastLaunch(kernel)
    fused[grid](*args, **kwargs)
    torch.cuda.synchronize()
    compiled = next(iter(fused.compiled.values())).compiled
    row.update(grid=list(grid), programs=batch * grid[1] * grid[2], registers=compiled.n_regs,
               resident_production=opts.get(("resident", False, 0)), sms=num_sms(q.device))
    row["err_production"] = ((out_p.double() - ref).norm() / ref.norm()).item()
    row["err_fused"] = ((out_f.double() - ref).norm() / ref.norm()).item()
    row["fused_vs_production_max"] = (out_f.double() - out_p.double()).abs().max().item()
    bound = fused.bind(grid, args, kwargs, dynamic=(TOKENS_ARG,))
    row["bound"] = bound is not None
    addresses = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args[:14])

    def fused_call():
        kc = k.codes
        qa = q.data_ptr()
        if not bound((qa, kc.data_ptr(), k.scale.data_ptr(), k.zero.data_ptr(), v.codes.data_ptr(),
                      v.scale.data_ptr(), v.zero.data_ptr(), qa, *addresses[8:]), (tokens,)):
            fused[grid](*args, **kwargs)

    def production_call():
        attn(q, k, v, out=out_p)

    def merging_call():
        merging(q, k, v, out=out_m)

    row["merges_inside"] = merging.merges_inside(opts, q, launch.splits, True)
    row["err_merging_call"] = ((out_m.double() - ref).norm() / ref.norm()).item()
    row["host_production_us"] = host_us(production_call)
    row["host_fused_us"] = host_us(fused_call)
    row["host_merging_call_us"] = host_us(merging_call)
    row["host_production_us_again"] = host_us(production_call)
    row["b2b_production_us"] = back_to_back_us(production_call)
    row["b2b_fused_us"] = back_to_back_us(fused_call)
    row["b2b_merging_call_us"] = back_to_back_us(merging_call)
    row["graph_production_us"] = graph_us(production_call)
    try:
        row["graph_fused_us"] = graph_us(lambda: fused[grid](*args, **kwargs))
    except Exception as e:   # a cooperative launch under capture: recorded, not fatal
        row["graph_fused_fail"] = repr(e)[:300]
    fused_call()
    torch.cuda.synchronize()
    row["counts_left"] = int(counter[0].item()) + int(counter[2:].abs().sum().item())   # 0: the barrier reset them
    row["generations"] = int(counter[1].item())
    row["err_fused_after"] = ((out_f.double() - ref).norm() / ref.norm()).item()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="token:2:128,32/8,1,16384;token:2:128,32/8,1,4096;token:2:128,32/8,1,65536;"
                    "token:4:128,32/8,1,16384;token:2:128,32/8,4,16384;token:2:128,8/8,1,16384")
    ap.add_argument("--variants", default=None, help="barriers of benchmarks/variants/merge_barrier.py, e.g. "
                    "production,packed,sleep")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    kernels = {"production": foldc_decode_gluon}
    if args.variants:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent / "variants"))
        from merge_barrier import decode_kernel

        kernels = {name: decode_kernel(name) for name in args.variants.split(",")}
    rows = []
    for item in args.cases.split(";"):
        layout, heads, batch, tokens = item.split(",")
        for name, kernel in kernels.items():
            try:
                row = dict(case(layout, heads, int(batch), int(tokens), kernel), barrier=name)
            except Exception as e:   # keep going: the row records it
                row = dict(layout=layout, heads=heads, batch=batch, tokens=tokens, barrier=name, fail=repr(e)[:400])
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
