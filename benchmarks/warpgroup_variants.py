"""Variants of the warpgroup template's tile (foldc/backends/gluon/warpgroup.py) for an A/B on the GPU.
Each variant is the production kernel with its ``_tile`` replaced (a new kernel object over the same
code, no source patched), launched through `WarpgroupLaunch` on the same calls:

- ``overlap``: the score wgmma issued asynchronously and the value operand unpacked while it runs
  (the value operand then lives across the softmax: more registers);
- ``chained``: the value wgmma accumulates into the rescaled O instead of a fresh accumulator added
  in fp32 (one FFMA per accumulator element fewer; the tensor core's running sum over a whole split);
- ``both``.

    python3 benchmarks/warpgroup_variants.py --aot                    # CPU: registers, spills, loop SASS
    PYTHONPATH=. python3 benchmarks/warpgroup_variants.py --out $OUT/variants.json   # GPU: error, µs
"""
from __future__ import annotations

import argparse
import json

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from foldc.backends.gluon import warpgroup as wg
from foldc.backends.gluon.warpgroup_launch import WarpgroupLaunch
from foldc.bench import rebound
from foldc.backends.gluon.warpgroup import (_copy_next, _key_operand, _tile_max, _value_operand, key_words_layout,
                                            partial_layout)


@gluon.jit
def _tile_variant(j, n0, end, next_n0, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem,
                  vz_smem, q_smem, p_smem, red_smem, sel, row_c, row_z, m_i, l_p, z_p, o, MASKED: gl.constexpr,
                  ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, ISSUE: gl.constexpr,
                  OVERLAP: gl.constexpr, CHAINED: gl.constexpr):
    acc_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_s, k_width=2)
    kw_l: gl.constexpr = key_words_layout(BN)
    tok_l: gl.constexpr = gl.SliceLayout(1, acc_s)
    lp_l: gl.constexpr = partial_layout(BN, ROWS)
    slot = j % STAGES
    kw = k_smem.index(slot).load(kw_l)
    ks = ks_smem.index(slot).reshape([BN]).load(tok_l).to(gl.float32)
    kz = kz_smem.index(slot).reshape([BN]).load(tok_l).to(gl.float32)
    vs = vs_smem.index(slot).reshape([BN]).load(tok_l).to(gl.float32)
    vz = vz_smem.index(slot).reshape([BN]).load(tok_l).to(gl.float32)
    if OVERLAP:
        pending = warpgroup_mma(_key_operand(kw, a_l, BN), q_smem, gl.zeros([BN, ROWS], gl.float32, layout=acc_s),
                                is_async=True)
        va = _value_operand(v_smem.index(slot), sel, a_l, BN)
        sacc = warpgroup_mma_wait(0, deps=[pending])
    else:
        sacc = warpgroup_mma(_key_operand(kw, a_l, BN), q_smem, gl.zeros([BN, ROWS], gl.float32, layout=acc_s))
    t = sacc * ks[:, None] + kz[:, None] * row_z[None, :]
    if MASKED:
        tok = gl.arange(0, BN, layout=tok_l)
        t = gl.where(((n0 + tok) < end)[:, None], t, float("-inf"))
    tmax = _tile_max(t, red_smem, ROWS, BN)
    _copy_next(j, next_n0, end, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem,
               vz_smem, BN, STAGES, ISSUE)
    m_new = gl.maximum(m_i, tmax)
    mc = m_new * row_c
    alpha = gl.exp2(m_i * row_c - mc)
    p = gl.exp2(t * row_c[None, :] - mc[None, :])
    a3 = gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(1, lp_l)))[None, None, :]
    p_smem.store((p * vs[:, None]).to(gl.float16))
    l_p = l_p * a3 + gl.convert_layout(gl.sum(gl.reshape(p, [BN // 16, 2, 8, ROWS]), axis=1), lp_l,
                                       assert_trivial=True)
    z_p = z_p * a3 + gl.convert_layout(gl.sum(gl.reshape(p * vz[:, None], [BN // 16, 2, 8, ROWS]), axis=1), lp_l,
                                       assert_trivial=True)
    fence_async_shared()
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()
    if not OVERLAP:
        va = _value_operand(v_smem.index(slot), sel, a_l, BN)
    if CHAINED:
        o = warpgroup_mma(va, p_smem, o * alpha[None, :])
    else:
        o = o * alpha[None, :] + warpgroup_mma(va, p_smem, gl.zeros([128, ROWS], gl.float32, layout=acc_s))
    return m_new, l_p, z_p, o


@gluon.jit
def _tile_overlap(j, n0, end, next_n0, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem,
                 vz_smem, q_smem, p_smem, red_smem, sel, row_c, row_z, m_i, l_p, z_p, o, MASKED: gl.constexpr,
                 ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, ISSUE: gl.constexpr):
    return _tile_variant(j, n0, end, next_n0, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem,
                         vs_smem, vz_smem, q_smem, p_smem, red_smem, sel, row_c, row_z, m_i, l_p, z_p, o, MASKED,
                         ROWS, BN, STAGES, ISSUE, True, False)


@gluon.jit
def _tile_chained(j, n0, end, next_n0, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem,
                 vz_smem, q_smem, p_smem, red_smem, sel, row_c, row_z, m_i, l_p, z_p, o, MASKED: gl.constexpr,
                 ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, ISSUE: gl.constexpr):
    return _tile_variant(j, n0, end, next_n0, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem,
                         vs_smem, vz_smem, q_smem, p_smem, red_smem, sel, row_c, row_z, m_i, l_p, z_p, o, MASKED,
                         ROWS, BN, STAGES, ISSUE, False, True)


@gluon.jit
def _tile_both(j, n0, end, next_n0, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem, vs_smem,
                 vz_smem, q_smem, p_smem, red_smem, sel, row_c, row_z, m_i, l_p, z_p, o, MASKED: gl.constexpr,
                 ROWS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, ISSUE: gl.constexpr):
    return _tile_variant(j, n0, end, next_n0, KC, VC, KS, KZ, VS, VZ, cbase, sbase, k_smem, v_smem, ks_smem, kz_smem,
                         vs_smem, vz_smem, q_smem, p_smem, red_smem, sel, row_c, row_z, m_i, l_p, z_p, o, MASKED,
                         ROWS, BN, STAGES, ISSUE, True, True)


VARIANTS = {"production": None, "overlap": _tile_overlap, "chained": _tile_chained, "both": _tile_both}


def variant_kernel(name: str):
    """The production kernel, or a new kernel object over its code whose ``_tile`` is the variant's."""
    if VARIANTS[name] is None:
        return wg.foldc_decode_warpgroup
    return rebound(wg.foldc_decode_warpgroup, _tile=VARIANTS[name])


class Launch:
    """A kernel object with some constexprs replaced, launched as `WarpgroupLaunch` launches its own."""

    def __init__(self, kernel, **consts):
        self.kernel, self.consts = kernel, consts
        self.n_regs = None

    @staticmethod
    def bind(grid, args, kwargs):   # never bound: every launch goes through __getitem__
        return None

    def __getitem__(self, grid):
        def run(*args, **kw):
            compiled = self.kernel[grid](*args, **{**kw, **self.consts})
            self.n_regs = compiled.n_regs
            return compiled
        return run


def aot(names, block_ns, rows: int = 32) -> None:
    import tempfile

    from foldc.backends.gluon.aot import compile_warpgroup_aot

    for name in names:
        for bn in block_ns:
            r = compile_warpgroup_aot(tempfile.mkdtemp(), variant_kernel(name), rows, bn)
            loop = r["inner_loop"]["top_opcodes"]
            print(json.dumps({"variant": name, "rows": rows, "block_n": bn, "registers": r["registers"],
                              "spills": loop.get("LDL", 0) + loop.get("STL", 0),
                              "loop": r["inner_loop"]["instructions_per_warp"], "wgmma_waits": r["mma"]["wgmma_waits"],
                              "top": dict(list(loop.items())[:8])}), flush=True)


def gpu(shapes, names, block_ns, out_path) -> None:
    import torch

    import foldc
    from foldc.bench import stream_read_ceiling
    from foldc.spec import spec_from_args
    from foldc.timing import graph_us

    ceiling = stream_read_ceiling()
    rows_out = []
    for batch, tokens, hq, hkv in shapes:
        spec = spec_from_args("token:2:128", "token:2:128", f"{hq}/{hkv}", 128)
        gen = torch.Generator(device="cuda").manual_seed(3)
        q = torch.randn(batch, hq, 128, device="cuda", generator=gen).to(torch.bfloat16)
        k, v = (foldc.quantize(torch.randn(batch, hkv, tokens, 128, device="cuda", generator=gen), spec.k)
                for _ in range(2))
        ref = foldc.attention_reference(q, k, v)
        read = sum(t.numel() * t.element_size() for x in (k, v) for t in (x.codes, x.scale, x.zero)) + 4 * q.numel()
        for name in names:
            for bn in block_ns:
                attn = foldc.compile(spec, "sm_90", kernel="gluon")
                if attn.warpgroup is None:   # 16 rows: the template is built, not taken by default
                    attn.warpgroup = WarpgroupLaunch(spec)
                launch = Launch(variant_kernel(name), BN=bn)
                attn.warpgroup._kernel = launch
                row = dict(batch=batch, tokens=tokens, heads=f"{hq}/{hkv}", variant=name, block_n=bn)
                try:
                    attn(q, k, v)   # compile; then fill one wave of the programs its registers let reside
                    attn.warpgroup.resident = max(1, 65536 // (-(-launch.n_regs // 8) * 8 * 128))
                    row.update(registers=launch.n_regs, resident=attn.warpgroup.resident)
                    out = attn(q, k, v)
                    row["rel_l2"] = (out.double() - ref.double()).norm().item() / ref.double().norm().item()
                    row["us"] = graph_us(lambda: attn(q, k, v))
                    row["pct"] = 100 * read / (row["us"] * 1e-6) / ceiling
                except Exception as e:   # keep going: the row records it
                    row["fail"] = repr(e)[:300]
                print(json.dumps(row), flush=True)
                rows_out.append(row)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(dict(ceiling=ceiling, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--block-n", default="64,128")
    ap.add_argument("--shapes", default="8x65536x128x4,32x65536x128x4,8x65536x64x4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.variants.split(",")
    block_ns = [int(x) for x in args.block_n.split(",")]
    if args.aot:
        aot(names, block_ns)
    else:
        gpu([tuple(map(int, s.split("x"))) for s in args.shapes.split(",")], names, block_ns, args.out)
