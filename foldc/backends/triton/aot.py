"""Ahead-of-time compilation of the generated kernels for sm_90 and sm_100 on a machine with
no GPU (triton bundles ptxas for both). Writes the generated source, TTIR/TTGIR/LLIR, PTX and
cubin, and reports which matrix instructions the kernel uses (wgmma, tcgen05, mma.sync).

Must run where TRITON_INTERPRET is unset when triton is first imported (the CLI's own
process): the interpreter replaces triton's library functions at import time.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ...errors import SpecError
from ...cost import lane_slots_per_byte as lane_slots_per_byte_model
from .launch import _interpret, kernel_source, load_module
from .sass import inner_loop, lane_slots_per_byte


def bytes_per_tile(enc, block_n: int, head_dim: int) -> float:
    """Bytes one token tile of one cache operand reads: codes plus its share of scale and zero."""
    if enc is None:
        return block_n * head_dim * 2.0
    param = {"float16": 2, "bfloat16": 2, "float32": 4}[str(enc.scale_dtype).replace("torch.", "")]
    return block_n * head_dim * enc.bits / 8 + 2 * param * block_n * head_dim / enc.group_size

ARCHS = {"sm_90": 90, "sm_100": 100}
MMA_PATTERNS = {"wgmma": r"\bwgmma\.mma_async", "tcgen05": r"\btcgen05\.mma", "mma.sync": r"\bmma\.sync"}


def _signature(ks, dtype: str, scale_dtypes: dict) -> dict:
    elem = {"fp16": "*fp16", "bf16": "*bf16"}[dtype]
    sig = {}
    for a in ks.args:
        if a == "SEQ_LENS":
            sig[a] = "*i32"
        elif a.startswith("WS_"):
            sig[a] = "*fp32"
        elif a == "Q" or a.endswith("_VALUES"):
            sig[a] = elem
        elif a.endswith("_CODES"):
            sig[a] = "*u8"
        elif a.endswith("_SCALE") or a.endswith("_ZERO"):
            sig[a] = scale_dtypes[a[0].lower()]
        elif a == "qk_scale":
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    return sig


def mma_instructions(ptx: str) -> dict[str, int]:
    return {name: len(re.findall(pat, ptx)) for name, pat in MMA_PATTERNS.items()}


def compile_aot(spec, arch: str, out_dir: str | Path, dtype: str = "bf16", block_n: int = 64,
                num_warps: int = 4, num_stages: int = 2, fold_policy: str = "auto") -> dict:
    """Compile the decode kernel of ``spec`` for ``arch``; write artifacts into ``out_dir``."""
    if arch not in ARCHS:
        raise SpecError(f"arch={arch!r} is not supported for ahead-of-time builds; use one of {sorted(ARCHS)}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SpecError("ahead-of-time compilation needs TRITON_INTERPRET unset in this process; run "
                        "`foldc compile` in a fresh shell")
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ks, geo, the_plan = kernel_source(spec, dtype, block_n, fold_policy)
    module = load_module(ks.source, interpret=False)
    names = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
    scale_dtypes = {n: names[getattr(spec, n).scale_dtype] for n in ("k", "v") if getattr(spec, n) is not None}
    signature = _signature(ks, dtype, scale_dtypes)
    constexprs = {"Q_PER_KV": spec.q_per_kv, "ROWS": geo.rows, "BLOCK_N": geo.block_n, "HEAD_DIM": spec.head_dim,
                  "NUM_KV_HEADS": spec.num_kv_heads}
    signature.update({k: "constexpr" for k in constexprs})
    ptr_args = [i for i, a in enumerate(ks.args) if signature[a].startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptr_args}
    target = GPUTarget("cuda", ARCHS[arch], 32)
    with _interpret(False):
        compiled = triton.compile(ASTSource(module.foldc_decode, signature, constexprs=constexprs, attrs=attrs),
                                  target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "foldc_decode.py").write_text(ks.source)
    for ext in ("ttir", "ttgir", "llir", "ptx"):
        if ext in compiled.asm:
            (out / f"foldc_decode.{arch}.{ext}").write_text(compiled.asm[ext])
    (out / f"foldc_decode.{arch}.cubin").write_bytes(compiled.asm["cubin"])
    loop = inner_loop(out / f"foldc_decode.{arch}.cubin")
    tile_bytes = sum(bytes_per_tile(getattr(spec, n), geo.block_n, spec.head_dim) for n in ("k", "v"))
    model = {name: lane_slots_per_byte_model(arch, p.fold, p.bits, float(p.fold_ops_per_value or 0))
             for name, p in the_plan.products.items() if p.fold not in ("none",)}
    report = {
        "spec": spec.describe(), "folds": the_plan.folds, "arch": arch, "dtype": dtype,
        "rows": geo.rows, "block_n": geo.block_n, "num_warps": num_warps, "num_stages": num_stages,
        "mma": mma_instructions(compiled.asm["ptx"]), "cubin_bytes": len(compiled.asm["cubin"]),
        "registers": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
        "shared_bytes": compiled.metadata.shared,
        "inner_loop": {"instructions_per_warp": sum(loop.values()), "bytes_per_tile": tile_bytes,
                       "lane_slots_per_byte": lane_slots_per_byte(loop, num_warps, tile_bytes),
                       "model_lane_slots_per_byte": model, "top_opcodes": dict(loop.most_common(12))},
    }
    (out / f"foldc_decode.{arch}.json").write_text(json.dumps(report, indent=2))
    return report
