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

import torch

from ...cost import lane_slots_per_byte as lane_slots_per_byte_model
from ...errors import SpecError
from ...options import check_launch_options, check_out_dir
from ..runtime.artifacts import build_errors, write_artifacts
from ..runtime.modules import interpreter
from ..runtime.modules import load_module
from ..runtime.sass import inner_loop, lane_slots_per_byte
from .launch import kernel_source


def bytes_per_tile(enc, block_n: int, head_dim: int) -> float:
    """Bytes one token tile of one cache operand reads: codes plus its share of scale and zero."""
    if enc is None:
        return block_n * head_dim * 2.0
    param = {"float16": 2, "bfloat16": 2, "float32": 4}[str(enc.scale_dtype).replace("torch.", "")]
    return block_n * head_dim * enc.bits / 8 + 2 * param * block_n * head_dim / enc.group_size

ARCHS = {"sm_90": 90, "sm_100": 100}
MMA_PATTERNS = {"wgmma": r"\bwgmma\.mma_async", "tcgen05": r"\btcgen05\.mma", "mma.sync": r"\bmma\.sync"}


def _specialize(spec, ks, geo, dtype: str, batch: int = 4, tokens: int = 4096):
    """Signature, constexprs and attributes the runtime JIT would derive for a typical call:
    representative tensors go through the launcher's own argument builder, and each value
    through triton's specialization (ints equal to 1 become constants, multiples of 16 and
    16-byte-aligned pointers get divisibility 16), so the build matches what runs."""
    from ...encoding import quantize
    from .launch import runtime_arguments

    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim).to(tdtype)

    def cache(enc):
        x = torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim)
        return quantize(x, enc) if enc is not None else x.to(tdtype)

    splits = 4
    ws = (torch.empty(batch, spec.num_kv_heads, splits, geo.rows), ) * 2 + \
        (torch.empty(batch, spec.num_kv_heads, splits, geo.rows, spec.head_dim), )
    lens = torch.full((batch,), tokens, dtype=torch.int32)
    values = runtime_arguments(q, cache(spec.k), cache(spec.v), lens, ws, 0.1, tokens // splits, splits)
    return specialize(ks.args, values)


def specialize(arg_names, values: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) the runtime JIT derives from these argument values: ints equal
    to 1 become constants, multiples of 16 and 16-byte-aligned pointers get divisibility 16."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(arg_names):
        kind, key = native_specialize_impl(BaseBackend, values[name], False, True, True)
        if kind == "constexpr":
            signature[name], constexprs[name] = "constexpr", key
            continue
        signature[name] = kind
        if key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def mma_instructions(ptx: str) -> dict[str, int]:
    return {name: len(re.findall(pat, ptx)) for name, pat in MMA_PATTERNS.items()}


def compile_aot(spec, arch: str, out_dir: str | Path, dtype: str = "bf16", block_n: int = 64,
                num_warps: int = 4, num_stages: int = 2, fold_policy: str = "auto") -> dict:
    """Compile the decode kernel of ``spec`` for ``arch``; write artifacts into ``out_dir``."""
    if arch not in ARCHS:
        raise SpecError(f"arch={arch!r} is not supported for ahead-of-time builds; use one of {sorted(ARCHS)}")
    check_launch_options(arch, "triton", block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    if None in (block_n, num_warps, num_stages):
        raise SpecError(f"block_n={block_n!r}, num_warps={num_warps!r}, num_stages={num_stages!r}: an "
                        "ahead-of-time build needs all three (e.g. 64, 4 and 2)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SpecError("ahead-of-time compilation needs TRITON_INTERPRET unset in this process; run "
                        "`foldc compile` in a fresh shell")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ks, geo, the_plan = kernel_source(spec, dtype, block_n, fold_policy, fast=True)
    check_out_dir(out_dir)
    module = load_module(ks.source, interpret=False)
    signature, constexprs, attrs = _specialize(spec, ks, geo, dtype)
    constexprs.update({"Q_PER_KV": spec.q_per_kv, "ROWS": geo.rows, "BLOCK_N": geo.block_n,
                       "HEAD_DIM": spec.head_dim, "NUM_KV_HEADS": spec.num_kv_heads})
    signature.update({k: "constexpr" for k in constexprs})
    target = GPUTarget("cuda", ARCHS[arch], 32)
    with interpreter(False), build_errors(f"the decode kernel for {arch} with block_n={block_n}, "
                                         f"num_warps={num_warps}, num_stages={num_stages}"):
        compiled = triton.compile(ASTSource(module.foldc_decode, signature, constexprs=constexprs, attrs=attrs),
                                  target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    out = Path(out_dir)
    loop = inner_loop(write_artifacts(out, "foldc_decode", arch, compiled, ks.source))
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
