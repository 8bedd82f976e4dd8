"""A/B timing of the register-operand kernel against variants of its kernel.py, in one process on
the same inputs: the error of each against float64 attention, and CUDA-graph times taken in
alternating rounds, so the comparison holds within one call (H200; evidence for docs/perf.md, not
a test). A variant is a copy of kernel.py with the same arguments (its helpers, tile_operands.py and
tile_memory.py, come from this tree's foldc), e.g. from a branch:

    git show next/lane-major-tokens:foldc/backends/gluon/kernel.py > variants/lane_major.py
    PYTHONPATH=. python3 benchmarks/ab_kernel.py --variant lane_major=variants/lane_major.py --out $OUT/ab.json
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import types

import torch

import foldc
from foldc.bench import decode_case, save_rows, timed
from foldc.testing import rel_l2


def load_variant(name: str, path: str):
    """The module at ``path`` (a kernel.py with foldc_decode_gluon), imported under its own name; ``PATH:ATTR``
    takes that module's kernel ``ATTR`` as its foldc_decode_gluon (one file, several variants)."""
    path, _, attr = path.partition(":")
    spec = importlib.util.spec_from_file_location(f"foldc_variant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if attr:
        if not hasattr(module, attr):
            raise SystemExit(f"{path} has no {attr}")
        return types.SimpleNamespace(foldc_decode_gluon=getattr(module, attr))
    if not hasattr(module, "foldc_decode_gluon"):
        raise SystemExit(f"{path} has no foldc_decode_gluon: pass a copy of foldc/backends/gluon/kernel.py")
    return module


def attention(spec, module=None, **options):
    """The launcher, running ``module``'s decode kernel instead of main's where given."""
    attn = foldc.compile(spec, "sm_90", kernel="gluon", **options)
    return attn if module is None else attn.with_decode_kernel(module.foldc_decode_gluon)


def with_unpack(attn, path: str):
    """``attn`` with the unpack PTX of the operands.py copy at ``path`` (its key_unpack_asm and
    value_unpack_asm) in place of this tree's, e.g. a branch's different shift instruction."""
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("foldc_unpack_variant", path))
    module.__spec__.loader.exec_module(module)
    base = attn.launch_config

    def launch_config(dtype, batch, tokens, device=None):
        opts = base(dtype, batch, tokens, device)
        cfg = attn.config
        kasm, kcons = module.key_unpack_asm(cfg.key_bits)
        values = [module.value_unpack_asm(cfg.value_bits, byte) for byte in range(4)]
        opts["constexprs"] = dict(opts["constexprs"], KASM=kasm, KCONS=kcons, VA0=values[0][0], VA1=values[1][0],
                                  VA2=values[2][0], VA3=values[3][0], VCONS=values[0][1])
        return opts

    attn.launch_config = launch_config
    return attn


def _encoding(bits: int, layout: str) -> foldc.Affine:
    """``token``/``channel`` with groups of 128, or e.g. ``token64``: token-wise groups of 64 channels."""
    name = layout.rstrip("0123456789")
    return foldc.Affine(bits, name, int(layout[len(name):] or 128))


def _option(name: str, value: str):
    """A launcher option's value from the command line: booleans as 0/1, else an int."""
    if name in ("dynamic_tiles", "scale_ahead"):
        return value == "1"
    return int(value)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", action="append", default=[], help="NAME=PATH[:ATTR] of a kernel.py copy, or its kernel ATTR (repeatable)")
    ap.add_argument("--unpack", action="append", default=[],
                    help="NAME=PATH of an operands.py copy: main's kernel with that copy's unpack PTX (repeatable)")
    ap.add_argument("--options", action="append", default=[],
                    help="NAME=OPTION:VALUE[;OPTION:VALUE]: also time main's kernel compiled with these options, "
                         "e.g. dyn=dynamic_tiles:1 (values: ints, or 0/1 for booleans)")
    ap.add_argument("--variant-options", action="append", default=[],
                    help="NAME=OPTION:VALUE[;OPTION:VALUE]: launch options of the variant NAME, e.g. vt=maxnreg:168")
    ap.add_argument("--cases", default="2:token/token:8x65536,2:token/token:32x16384,2:token/token:32x65536,"
                    "4:token/token:32x16384,2:channel/token:32x65536,2:channel/channel:32x65536",
                    help="BITS:K/V:BATCHxTOKENS, comma-separated; K and V as token, channel or e.g. token64 "
                         "(token-wise groups of 64 channels)")
    ap.add_argument("--head-dim", type=int, default=128, help="head_dim of every case (groups of token64 etc. "
                    "must divide it)")
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads of every case, e.g. 64/4")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (the best of each is kept)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    variants = {"main": None}
    for item in args.variant:
        name, _, path = item.partition("=")
        variants[name] = load_variant(name, path)
    rows = []
    for case in args.cases.split(","):
        bits, layouts, shape = case.split(":")
        kl, vl = layouts.split("/")
        b, n = (int(x) for x in shape.split("x"))
        q_heads, kv_heads = (int(x) for x in args.heads.split("/"))
        spec = foldc.AttentionSpec(q_heads, kv_heads, args.head_dim, _encoding(int(bits), kl), _encoding(int(bits), vl))
        q, k, v = decode_case(spec, b, n, seed=b * n + int(bits))
        ref = foldc.attention_reference(q, k, v) if b * n <= 600_000 else None
        variant_options = {}
        for item in args.variant_options:
            name, _, opts = item.partition("=")
            variant_options[name] = {k: _option(k, v) for k, v in (o.split(":") for o in opts.split(";"))}
        kernels = {name: attention(spec, module, **variant_options.get(name, {})) for name, module in variants.items()}
        for item in args.unpack:
            name, _, path = item.partition("=")
            kernels[name] = with_unpack(attention(spec), path)
        for item in args.options:
            name, _, opts = item.partition("=")
            kernels[name] = attention(spec, **{k: _option(k, v) for k, v in (o.split(":") for o in opts.split(";"))})
        best = {}
        errors = {}
        for name, attn in kernels.items():
            try:
                out = attn(q, k, v)
                errors[name] = rel_l2(out, ref) if ref is not None else None
            except Exception as e:  # a variant that fails to build or run is reported, the rest go on
                errors[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        for _ in range(args.rounds):
            for name, attn in kernels.items():
                if isinstance(errors[name], str):
                    continue
                eager, graph = timed(lambda attn=attn, q=q, k=k, v=v: attn(q, k, v))
                us = min(t for t in (eager, graph) if t is not None)
                best[name] = min(best.get(name, us), us)
        base = best.get("main")
        for name in kernels:
            row = dict(case=case, kernel=name, us=best.get(name), error=errors[name])
            if base and best.get(name):
                row["vs_main"] = best[name] / base
            rows.append(row)
            speed = f"{best[name]:.1f} us ({row.get('vs_main', 1):.3f} x main)" if name in best else "-"
            print(f"{case:<28} {name:<16} {speed}  error {errors[name]}", flush=True)
        del q, k, v
        save_rows(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
