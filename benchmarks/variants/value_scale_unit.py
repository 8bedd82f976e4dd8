"""A variant of the register-operand decode kernel for token-wise values of small (or large) magnitude: each tile's
``P x scale`` (the value MMA's fp16 operand, tile_operands.scaled_p and tile_values.consume_values) taken at a power
of two 2^e per query row, so that the tile's largest scale times 2^e lies in [2^14, 2^15). Not production code.

Why (an audit of 2026-12-07, on the CPU, emulating the kernel's rounding in torch): production rounds ``P x s`` to
fp16 with the raw scale. INT8 values of about 3e-4 have scales near 2e-6, and ``P x s`` falls among fp16's
subnormals (steps of 2^-24): about 12x plain bf16 attention's error at 2048 tokens, 80x at 1e-4 (1e-3 and up stay
within the bar); bf16 or fp32 scales past 65504 make ``P x s`` inf. Powers of two scale exactly, so where ``P x s``
was a normal fp16 nothing changes.

This variant is the cost's upper bound: it wraps production's `consume_values`, handing it the scales times 2^e and
the output accumulator times 2^e, and takes 2^-e back from the returned accumulator (two multiplies per
accumulator element and the tile's largest scale per row, a reduction over its tokens). A production form would
keep the accumulator in the current tile's unit instead (one multiply per row a tile: ``alpha x 2^(e_t - e_t-1)``,
and 2^-e once at the end).

    python3 benchmarks/variants/value_scale_unit.py --aot                       # CPU: SASS per tile beside production
    PYTHONPATH=. python3 benchmarks/variants/value_scale_unit.py --out $OUT/vsu.json   # GPU: errors on small values
    PYTHONPATH=. python3 benchmarks/ab_kernel.py --variant unit=benchmarks/variants/value_scale_unit.py:KERNEL \\
        --out $OUT/vsu_ab.json                                                  # GPU: the cost, beside production

Import only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from foldc.backends.gluon import kernel as production
from foldc.backends.gluon.tile_values import consume_values
from foldc.bench import rebound


@gluon.jit
def _units(top):
    """(2^e, 2^-e) with ``top x 2^e`` in [2^14, 2^15) (top: the tile's largest |scale| per row), e within +-64 (a
    zero scale: 2^64)."""
    up_b = gl.minimum(gl.maximum(268 - ((top.to(gl.int32, bitcast=True) >> 23) & 255), 127 - 64), 127 + 64)
    return (up_b << 23).to(gl.float32, bitcast=True), ((254 - up_b) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _top(vs, H: gl.constexpr, NG: gl.constexpr):
    """The largest |scale| of the tile's tokens: a scalar (one head a program) or per row [ROWS]."""
    if NG == 1:
        top = gl.max(gl.abs(vs.to(gl.float32)), axis=0)
    else:
        top = gl.max(gl.abs(vs[0].to(gl.float32)), axis=0)
        for g in gl.static_range(1, NG):
            top = gl.maximum(top, gl.max(gl.abs(vs[g].to(gl.float32)), axis=0))
    return top


@gluon.jit
def _times(vs, u, H: gl.constexpr, NG: gl.constexpr):
    """The scales times the unit u (a scalar, or per row: along vs's columns)."""
    if H == 1:
        if NG == 1:
            out = vs.to(gl.float32) * u
        else:
            out = ()
            for g in gl.static_range(NG):
                out = out + (vs[g].to(gl.float32) * u,)
    else:
        if NG == 1:
            out = vs.to(gl.float32) * u[None, :]
        else:
            out = ()
            for g in gl.static_range(NG):
                out = out + (vs[g].to(gl.float32) * u[None, :],)
    return out


@gluon.jit
def consume_values_unit(t, v_smem, slot, vs, vz, m_i, l_i, zsum, acc_o, head_b, v_scale, v_zero, BN: gl.constexpr,
                        D: gl.constexpr, F: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, VAL_G: gl.constexpr,
                        VA0: gl.constexpr, VA1: gl.constexpr, VA2: gl.constexpr, VA3: gl.constexpr,
                        VCONS: gl.constexpr, AND_P: gl.constexpr, VAL_NG: gl.constexpr, VDQ: gl.constexpr,
                        LEAN: gl.constexpr = False, VMG: gl.constexpr = False, DRV: gl.constexpr = 0,
                        PDT: gl.constexpr = gl.bfloat16):
    """Production's `consume_values`, with token-wise folded values at a power of two per row (module docstring)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    if F > 0 and not VDQ and VAL_G == 0:
        up, down = _units(_top(vs, H, VAL_NG))
        if H == 1:
            m_i, l_i, zsum, acc = consume_values(t, v_smem, slot, _times(vs, up, H, VAL_NG), vz, m_i, l_i, zsum,
                                                 acc_o * up, head_b, v_scale, v_zero, BN, D, F, ROWS, H, VAL_G, VA0,
                                                 VA1, VA2, VA3, VCONS, AND_P, VAL_NG, VDQ, LEAN, VMG, DRV, PDT)
            acc_o = acc * down
        else:
            up_r = gl.convert_layout(up, gl.SliceLayout(0, mma))[None, :]
            down_r = gl.convert_layout(down, gl.SliceLayout(0, mma))[None, :]
            m_i, l_i, zsum, acc = consume_values(t, v_smem, slot, _times(vs, up, H, VAL_NG), vz, m_i, l_i, zsum,
                                                 acc_o * up_r, head_b, v_scale, v_zero, BN, D, F, ROWS, H, VAL_G,
                                                 VA0, VA1, VA2, VA3, VCONS, AND_P, VAL_NG, VDQ, LEAN, VMG, DRV, PDT)
            acc_o = acc * down_r
    else:
        m_i, l_i, zsum, acc_o = consume_values(t, v_smem, slot, vs, vz, m_i, l_i, zsum, acc_o, head_b, v_scale,
                                               v_zero, BN, D, F, ROWS, H, VAL_G, VA0, VA1, VA2, VA3, VCONS, AND_P,
                                               VAL_NG, VDQ, LEAN, VMG, DRV, PDT)
    return m_i, l_i, zsum, acc_o


KERNEL = rebound(production.foldc_decode_gluon, _tile=rebound(production._tile, consume_values=consume_values_unit))

CASES = [("token:8:128", "token:8:128", "32/8", 128), ("token:4:128", "token:4:128", "32/8", 128),
         ("token:2:128", "token:2:128", "32/8", 128), ("token:8:32", "token:8:32", "32/8", 128),
         ("token:8:128", "token:8:128", "8/8", 128), ("token:8:128:fp32", "token:8:128:fp32", "32/8", 128)]


def aot() -> list[dict]:
    """Registers and SASS per tile, production beside the variant, sm_90 (CPU)."""
    from foldc.bench import decode_variant_builds

    return decode_variant_builds(KERNEL, "unit", CASES)


def gpu(seed: int) -> list[dict]:
    """Per case and value magnitude: production's and the variant's relative error against float64 on the
    dequantized cache, beside plain bf16 attention's on the same values (the bar is 2x that)."""
    import math

    import foldc
    from foldc.spec import spec_from_args
    from foldc.testing import bf16_attention, rel_l2

    rows = []
    for k_enc, v_enc, heads, d in CASES:
        spec = spec_from_args(k_enc, v_enc, heads, d)
        for magnitude in (1.0, 1e-3, 3e-4, 1e-4, 1e4):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            b, n = 2, 2048
            q = torch.randn(b, spec.num_q_heads, d, device="cuda", generator=gen).to(torch.bfloat16)
            k = foldc.quantize(torch.randn(b, spec.num_kv_heads, n, d, device="cuda", generator=gen), spec.k)
            v = foldc.quantize(torch.randn(b, spec.num_kv_heads, n, d, device="cuda", generator=gen) * magnitude,
                               spec.v)
            ref = foldc.attention_reference(q, k, v)   # float64 over the dequantized cache
            lens = torch.full((b,), n, device="cuda")
            plain = bf16_attention(q, k, v, 1.0 / math.sqrt(d), lens)
            row = {"k": k_enc, "v": v_enc, "heads": heads, "magnitude": magnitude,
                   "plain_bf16": rel_l2(plain, ref)}
            for name, module in (("production", None), ("unit", KERNEL)):
                attn = foldc.compile(spec, "sm_90", kernel="gluon")
                if module is not None:
                    attn = attn.with_decode_kernel(module)
                out = attn(q, k, v)
                row[name] = rel_l2(out, ref)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aot", action="store_true", help="build for sm_90 on the CPU: SASS per tile beside production")
    ap.add_argument("--out", default="results/value_scale_unit.json")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    rows = aot() if args.aot else gpu(args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.aot:
        for r in rows:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
