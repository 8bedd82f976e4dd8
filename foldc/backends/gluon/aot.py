"""Ahead-of-time build of the register-operand kernel for sm_90 (no GPU needed) and what the
compiler emitted: matrix instructions, registers, and the SASS of the token loop per packed byte.

Must run where TRITON_INTERPRET is unset when triton is first imported.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import torch

from ...cost import token_loop_lane_slots_per_byte
from ...errors import SpecError
from ...options import check_launch_options, check_out_dir
from ..runtime.artifacts import build_errors, write_artifacts
from ..runtime.sass import _tool, disassemble, lane_slots_per_byte, loop_instructions, skipped_addresses
from .launch import GluonAttention
from .launch_defaults import constexprs, default_pack_heads
from .lower import gluon_plan, lower

POINTERS = {"Q": "*bf16", "KC": "*i32", "KS": "*fp16", "KZ": "*fp16", "VC": "*i32", "VS": "*fp16", "VZ": "*fp16",
            "SEQ_LENS": "*i32", "WS_M": "*fp32", "WS_L": "*fp32", "WS_ACC": "*fp32", "KV_INDPTR": "*i32",
            "KV_INDICES": "*i32", "COUNTERS": "*i32"}
SCALE_POINTERS = ("KS", "KZ", "VS", "VZ")
MERGED_POINTERS = {"KV_INDICES": "*fp32", "COUNTERS": "*i64"}   # a merging build's log-sum-exp and barrier
SCALE_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# runtime ints the JIT sees as multiples of 16 for caches whose token count is a multiple of 16 (not
# cache_tokens: the kernel does not specialise on it)
ALIGNED_INTS = ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_ksb", "stride_ksh", "stride_vb",
                "stride_vh", "stride_vsb", "stride_vsh", "tokens_per_split")
# the scale tensors' stride along tokens (token-wise: 1) or token groups (channel-wise: head_dim)
GROUP_STRIDES = ("stride_ksn", "stride_vsn")


def registers(cubin: Path) -> int | None:
    text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                          text=True).stdout
    m = re.search(r"REG:(\d+)", text)
    return int(m.group(1)) if m else None


def compile_gluon_aot(spec, arch: str, out_dir: str | Path, dtype: str = "bf16", block_n: int | None = None,
                      stages: int | None = None, maxnreg: int | None = None, pack_heads: int | None = None,
                      page_size: int = 0, scale_ahead: bool | None = None, dynamic: bool = False,
                      merge: bool = False) -> dict:
    """Build the register-operand kernel of ``spec`` for ``arch`` into ``out_dir``; return a report.
    ``block_n``, ``stages`` and ``pack_heads`` (KV heads per program) default to what the launcher
    picks for ``spec`` (`GluonAttention`'s defaults, no tuning cache); ``maxnreg``: a register cap
    (None: none, as the launcher's default); ``page_size``:
    tokens per page for the paged build (0: contiguous cache); ``scale_ahead``: as `GluonAttention`'s
    option; ``dynamic``: tiles drawn from a counter (its ``dynamic_tiles``); ``merge``: the build that merges its
    splits itself (an eager call's cooperative launch, split_merge.py; contiguous caches)."""
    if arch not in ("sm_90", "sm_100"):
        raise SpecError(f"arch={arch!r}: the register-operand kernel builds for sm_90 and sm_100")
    check_launch_options(arch, "gluon", block_n=block_n, stages=stages)
    if None in (block_n, stages, pack_heads, scale_ahead):
        launcher = GluonAttention(spec, target=arch, block_n=block_n, pack_heads=pack_heads)
        block_n, pack_heads = launcher.default_block_n, launcher.heads
        stages = launcher.default_stages if stages is None else stages
        if scale_ahead is None:   # the launcher's default (None: default_scale_ahead's)
            scale_ahead = launcher._defaults["scale_ahead"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SpecError("ahead-of-time compilation needs TRITON_INTERPRET unset in this process")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .kernel import foldc_decode_gluon

    cfg = lower(gluon_plan(spec, dtype))   # the operand precision (eq. 6a) depends on the query dtype
    heads = default_pack_heads(cfg, spec.num_kv_heads) if pack_heads is None else pack_heads
    check_out_dir(out_dir)
    if merge and (page_size or dynamic):
        raise SpecError("merge=True builds the contiguous cache's kernel: no page_size, no dynamic tiles")
    consts = dict(constexprs(cfg, block_n, stages, heads, scale_ahead, dynamic), HAS_LENS=True, PAGE=page_size,
                  MERGE=merge)
    signature, attrs = {}, {}
    for i, name in enumerate(foldc_decode_gluon.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
            if name == "Q" or (merge and name == "KV_INDPTR"):   # (merged: the output, in the queries' dtype)
                signature[name] = "*bf16" if dtype == "bf16" else "*fp16"
            elif merge and name in MERGED_POINTERS:
                signature[name] = MERGED_POINTERS[name]
            elif name in SCALE_POINTERS:   # the encoding's scale dtype (a plain side: the query stands in)
                enc = spec.k if name.startswith("K") else spec.v
                signature[name] = "*" + (SCALE_TYPES[enc.scale_dtype] if enc is not None else dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in ALIGNED_INTS or (name == "stride_ksn" and cfg.key_tokens) or \
                    (name == "stride_vsn" and cfg.value_tokens):
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": 1}
    if maxnreg:
        options["maxnreg"] = maxnreg
    with build_errors(f"the register-operand kernel for {arch} with block_n={block_n}, stages={stages}, "
                      f"maxnreg={maxnreg!r}"):
        compiled = triton.compile(GluonASTSource(foldc_decode_gluon, signature, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", {"sm_90": 90, "sm_100": 100}[arch], 32), options=options)
    out = Path(out_dir)
    cubin = write_artifacts(out, "foldc_decode_gluon", arch, compiled)
    body = loop_instructions(cubin)
    loop = Counter(o for _, o, _ in body)
    # the once-per-group reloads of channel-wise sides sit in the loop behind a branch: per tile they
    # cost block_n / group of their size. Groups of at most a tile reload every tile with no branch (the
    # kernel's n0 % group test is always true), so only groups longer than a tile count; where K and V
    # both have such groups of different sizes, the smaller (an upper bound)
    skipped = skipped_addresses(body)
    once_per_group = len(skipped)
    groups = [g for g in (cfg.key_tokens, cfg.value_tokens) if g > block_n]
    per_tile = len(body) - once_per_group + (once_per_group * block_n / min(groups) if groups else 0)
    # codes + fp16 scale and zero, K and V, of every packed head
    params = (0 if cfg.key_plain else cfg.key_groups) + (0 if cfg.value_plain else cfg.value_groups)
    tile_bytes = heads * block_n * (cfg.code_bytes_per_token + 4 * params)
    # global loads in the token loop (the token-wise scales and zeros), and the address registers
    # they use: one base per parameter when each load takes an immediate offset (_param)
    loads = [args for _, op, args in body if op == "LDG"]
    bases = {m.group(1) for a in loads for m in [re.search(r"\[(R\d+)(?:\.64)?", a)] if m}
    ptx = compiled.asm["ptx"]
    report = {
        "spec": spec.describe(), "kernel": "gluon", "arch": arch, "dtype": dtype, "block_n": block_n,
        "stages": stages, "maxnreg": maxnreg, "scale_ahead": consts["SCALE_AHEAD"], "dynamic": consts["DYNAMIC"],
        "rows": cfg.rows,
        "pack_heads": heads, "registers": registers(cubin),
        "mma": {"mma.sync": len(re.findall(r"\bmma\.sync", ptx)), "wgmma": len(re.findall(r"\bwgmma", ptx))},
        "shared_stores_in_ptx": len(re.findall(r"\bst\.shared", ptx)),
        "inner_loop": {"instructions_per_warp": sum(loop.values()), "once_per_group": once_per_group,
                       "instructions_per_tile": per_tile, "bytes_per_tile": tile_bytes,
                       "lane_slots_per_byte": lane_slots_per_byte(loop, 1, tile_bytes),
                       "model_lane_slots_per_byte": (token_loop_lane_slots_per_byte("sm_90", cfg.key_bits, cfg.head_dim,
                                                                                     heads=heads, block_n=block_n,
                                                                                     key_groups=cfg.key_groups,
                                                                                     value_groups=cfg.value_groups,
                                                                                     value_bits=cfg.value_bits)
                                                     if not (cfg.key_tokens or cfg.value_tokens or cfg.key_plain
                                                             or cfg.value_plain) else None),
                       "top_opcodes": dict(loop.most_common(12)),
                       # spilled registers' traffic in the loop, and the part of it every tile runs
                       "local_memory": loop.get("LDL", 0) + loop.get("STL", 0),
                       "local_memory_every_tile": sum(o in ("LDL", "STL") for a, o, _ in body if a not in skipped),
                       "global_loads": len(loads), "global_load_bases": len(bases),
                       "l2_prefetches": loop.get("CCTL", 0), "atomics": loop.get("ATOMG", 0)},
    }
    (out / f"foldc_decode_gluon.{arch}.json").write_text(json.dumps(report, indent=2))
    return report


def compile_warpgroup_aot(out_dir: str | Path, kernel=None, rows: int | None = None,
                          block_n: int | None = None, head_rows: int = 0) -> dict:
    """Build the warpgroup template (warpgroup.py) for sm_90 into ``out_dir``, with the launcher's tile
    and stages, and report its matrix instructions, registers and token loop. ``kernel``: another kernel
    object with its signature (benchmarks' variants); ``rows``, ``block_n``: other than the launcher's;
    ``head_rows``: fewer query rows per KV head than ``rows`` (the rest padding, the kernel's QH)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SpecError("ahead-of-time compilation needs TRITON_INTERPRET unset in this process")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .warpgroup import foldc_decode_warpgroup
    from .warpgroup_launch import BLOCK_N, ROWS, STAGES

    check_out_dir(out_dir)
    kernel = kernel or foldc_decode_warpgroup
    rows, block_n = rows or ROWS, block_n or BLOCK_N
    consts = {"HAS_LENS": True, "ROWS": rows, "BN": block_n, "STAGES": STAGES}
    if "QH" in kernel.arg_names:   # the template's (a variant may predate it)
        consts["QH"] = head_rows
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = {"Q": "*bf16", "KC": "*i32", "VC": "*i32", "SEQ_LENS": "*i32", "qk_scale": "fp32"}.get(
            name, "*fp16" if name in SCALE_POINTERS else "*fp32" if name.startswith("WS_") else "i32")
        if name not in ("qk_scale", "cache_tokens"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    with build_errors("the warpgroup template for sm_90"):
        compiled = triton.compile(GluonASTSource(kernel, signature, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    cubin = write_artifacts(Path(out_dir), "foldc_decode_warpgroup", "sm_90", compiled)
    loop = Counter(o for _, o, _ in loop_instructions(cubin))
    ptx = compiled.asm["ptx"]
    return {"kernel": "warpgroup", "arch": "sm_90", "block_n": block_n, "stages": STAGES, "rows": rows,
            "head_rows": head_rows or rows, "sass_sha256": hashlib.sha256("\n".join(f"{op} {args}" for _, op, args in disassemble(cubin)).encode()).hexdigest(),
            "registers": registers(cubin),
            "mma": {"mma.sync": len(re.findall(r"\bmma\.sync", ptx)), "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)),
                    "wgmma_waits": len(re.findall(r"wgmma\.wait_group", ptx))},
            "inner_loop": {"instructions_per_warp": sum(loop.values()), "top_opcodes": dict(loop.most_common(24)),
                           "local_memory": loop.get("LDL", 0) + loop.get("STL", 0)}}
