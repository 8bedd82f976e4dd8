"""Repeat one GEMM template case many times (fresh and identical data) across tile configs and split-k,
each against float64: finds configs whose error is not deterministic (a race) or larger than torch's.

    PYTHONPATH=. python3 benchmarks/gemm_dequant_repeat.py [--enc k-group:8:32 --n 4096 --k 4096 --m 100]
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    import triton

    from foldc.backends.runtime.modules import load_module
    from foldc.backends.triton.gemm_dequant import SOURCE, dequant_config, lower_dequant, unpack_asm
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.plan import gemm_plan
    from foldc.gemm.reference import gemm_reference, quantize_2d

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="k-group:8:32,4096,4096,100;k-group:8:128,4096,4096,100;"
                                       "k-group:4:128,4096,4096,100;k-group:2:32,4096,4096,100;k-group:8:32,4096,4096,64")
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    module = load_module(SOURCE, False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case in a.cases.split(";"):
        enc, n, k, m = case.split(",")
        n, k, m = int(n), int(k), int(m)
        spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"), m=m)
        tile = lower_dequant(gemm_plan(spec), m)
        for dtype in (torch.float16,):
            asm, cons = unpack_asm(tile.bits, False)
            for bm, bn, warps in ((128, 128, 8), (64, 128, 8), (64, 64, 4), (128, 64, 4)):
                cfg = dequant_config(tile, m, n, sms, block_m=bm, block_n=bn, num_warps=warps)
                for split in sorted({1, 2, cfg["split_k"]}):
                    errs = []
                    for r in range(a.repeats):
                        gen = torch.Generator().manual_seed(r % 2)     # seeds 0, 1, 0, 1: identical data twice
                        w = quantize_2d((torch.randn(n, k, generator=gen) * 0.05).cuda(), spec.weight)
                        x = torch.randn(m, k, generator=gen).to("cuda", dtype)
                        ref = gemm_reference(x, w)
                        bar = float((x @ w.dequantize(dtype)[0, 0].T).double().sub(ref).norm() / ref.norm())
                        codes, s, z = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
                        ws = torch.zeros(m, n, device="cuda", dtype=torch.float32)
                        y = torch.empty(m, n, device="cuda", dtype=dtype)
                        c = dict(K=k, BITS=tile.bits, GROUP=tile.group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=tile.block_k,
                                 GROUP_M=8, MATH=1, ASM=asm, CONS=cons, SPLIT_K=split, num_warps=warps,
                                 num_stages=cfg["num_stages"])
                        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
                        target = ws if split > 1 else y
                        module.foldc_gemm_dequant[grid](x, x.stride(0), codes, codes.stride(0), s, z, s.stride(0),
                                                        target, target.stride(0), m, n, **c)
                        if split > 1:
                            y.copy_(ws)
                        d = (y.double() - ref).abs()
                        errs.append((float(d.norm() / ref.norm()) / bar, int((d > 50 * bar * ref.abs().max()).sum())))
                    print(f"{enc} {n}x{k} m={m} {bm}x{bn} w{warps} st{cfg['num_stages']} split {split}: "
                          f"err/bar {[round(e, 2) for e, _ in errs]} outliers {[o for _, o in errs]}", flush=True)


if __name__ == "__main__":
    main()
