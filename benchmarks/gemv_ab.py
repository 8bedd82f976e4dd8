"""A/B of the register-operand GEMV on a GPU, in one process: the production kernel (foldc/backends/gluon/gemv.py)
beside another build of it with the same arguments (a kernel file, e.g. the one at an earlier commit), both on the
production launcher's launches (grid, split, constants, buffers) and each checked against float64 before it is timed.

    git show 6544a51:foldc/backends/gluon/gemv.py > benchmarks/_gemv_b.py      # the B kernel (not committed)
    PYTHONPATH=. python3 benchmarks/gemv_ab.py --b benchmarks/_gemv_b.py --b-asm swapped --out $OUT/ab.json

A gemv.py of a commit after its split into gemv.py and gemv_chunk.py (one chunk's arithmetic) imports the working
tree's gemv_chunk.py: to compare a change there, copy that commit's gemv_chunk.py too and point B's import at it.

``--b-asm swapped``: B reads the weight with `key_unpack_asm` (k index with bits 0 and 1 of the byte swapped, the
kernel swaps x to match), as the GEMV did before 2026-12-04; ``natural``: with `natural_key_unpack_asm`;
``launcher`` (the default): the production launcher's choice, for a B built from today's kernel
(benchmarks/gemv_variants.py). Constants
B does not declare are dropped. ``flip``: the production kernel with the other unpack order than its launcher picks (a biased bf16 launch: the unbiased path, x put in fp16)
(SWAP and ASM). Each case also runs the production kernel at a few launch options (stages, block
rows, a register cap, twice the split), or at ``--options`` (then ``--b`` may be left out):

    PYTHONPATH=. python3 benchmarks/gemv_ab.py --quick --options '[{"gemv_warps": 4}]' --out $OUT/warps.json
 Timing as benchmarks/gemv_check.py: CUDA graphs over distinct weight
copies (cold L2), fp16 cuBLAS and torch's INT4 kernel beside them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_check import copies, graph_us, int4pack, rel, read_ceiling  # noqa: E402

CASES = [("k-group:4:128", 4096, 14336, 1), ("k-group:4:128", 28672, 8192, 1), ("k-group:2:128", 28672, 8192, 1),
         ("k-group:4:128", 14336, 4096, 1), ("k-group:4:128", 4096, 4096, 1), ("k-group:4:128", 28672, 8192, 16),
         ("k-group:4:128", 4096, 14336, 16), ("k-group:4:32", 4096, 14336, 1), ("k-group:8:128", 4096, 14336, 1),
         ("k-group:4:128", 4096, 14336, 4), ("k-group:2:128", 28672, 8192, 16), ("k-group:4:128", 14336, 4096, 16),
         ("k-group:2:128", 4096, 14336, 1), ("k-group:2:128", 14336, 4096, 1), ("k-group:2:128", 4096, 14336, 16),
         ("k-group:2:128", 4096, 4096, 1), ("k-group:2:64", 28672, 8192, 1), ("k-group:4:128", 4096, 4096, 16),
         ("k-group:4:128", 1024, 4096, 16), ("k-group:4:128", 28672, 8192, 12), ("k-group:4:64", 28672, 8192, 16),
         ("k-group:4:128", 8192, 8192, 16)]
OPTIONS = [{}, {"gemv_stages": 4}, {"gemv_maxnreg": 96}, {"gemv_maxnreg": 80}, {"block_rows": 32}, "split2",
           "split/2"]


def load_kernel(path: str, name: str = "foldc_gemv_gluon"):
    spec = importlib.util.spec_from_file_location("gemv_b", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def b_call(kernel_b, gemv, asm_mode: str, override: dict | None = None):
    """``call(x, w, out)`` launching kernel_b with the production launcher's launch; ``asm_mode``: "swapped" or
    "natural" sets the unpack (and SWAP where the kernel takes it), "flip" the other order than the launcher's.
    ``override``: constants of B's to set, and "_programs_per_sm": B's grid is that many programs per SM (one axis;
    benchmarks/gemv_persistent.py) instead of the launch's."""
    from foldc.backends.gluon.operands import key_unpack_asm, natural_key_unpack_asm
    from foldc.backends.runtime.fast_launch import FastLaunch

    fast = FastLaunch(kernel_b)
    names = set(kernel_b.arg_names)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    override = dict(override or {})
    per_sm = override.pop("_programs_per_sm", None)

    def call(x, w, out):
        launch = gemv.plan_launch(x.dtype, x.shape[0], sms)
        part, counters = gemv.buffers(launch, x.device)
        consts = {k: v for k, v in launch.constants if k in names or k in ("num_warps", "maxnreg")}
        mode = asm_mode
        if dict(launch.constants).get("BIAS") and (mode != "launcher" or "BIAS" not in names):
            # biased bf16 codes (the plan's code bias) where B or the unpack asked for cannot take them: the
            # unbiased path (x put in fp16 per chunk) with key_unpack_asm
            consts.pop("BIAS", None)
            if "BIAS" in names:
                consts["BIAS"] = 0
            if mode == "launcher":
                mode = "swapped"
        if mode == "flip":
            mode = "natural" if consts.get("SWAP") else "swapped"
        if mode in ("swapped", "natural"):
            asm = key_unpack_asm if mode == "swapped" else natural_key_unpack_asm
            consts["ASM"], consts["CONS"] = asm(launch.kernel.bits)
            if "SWAP" in consts:
                consts["SWAP"] = mode == "swapped"
        consts.update(override)
        codes, scale, zero = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
        grid = launch.grid if per_sm is None else (sms * per_sm,)
        fast[grid](x, codes.view(torch.int32), scale, zero, out, part, counters, launch.m, gemv.spec.n,
                   x.stride(0), codes.stride(0) // 4, scale.stride(0), out.stride(0), launch.chunks_per_split, **consts)
    return call


def summary(r: dict) -> str:
    """One line per case: µs of each kernel (A: production, flip, variant, B) per activation dtype."""
    out = f"{r['enc']:14} {r['n']:5}x{r['k']:5} m{r['m']:2} fp16 {r['fp16_us']:6.1f} "
    out += f"torch-int4 {r.get('torch_int4_us') or 0:6.1f} |"
    for t in ("float16", "bfloat16"):
        names = [n for n in ("a", "flip", "variant", "b") + tuple(f"b{j}" for j in range(8)) if f"{n}_{t}_us" in r]
        out += f" {t}: " + " ".join(f"{n} {r[f'{n}_{t}_us']:.2f}" for n in names) + f" (err a {r[f'a_{t}_err']:.1e}) |"
    if "a_options" in r:
        out += " options " + " ".join(f"{json.dumps(o)}:{u and round(u, 2)}" for o, _, u in r["a_options"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", default=None, help="a kernel file defining foldc_gemv_gluon (none: the production kernel "
                    "and its options only)")
    ap.add_argument("--b-kernel", default="foldc_gemv_gluon", help="the kernel's name in that file (e.g. foldc_gemv_bias "
                    "in benchmarks/gemv_variants.py)")
    ap.add_argument("--b-asm", choices=("launcher", "swapped", "natural"), default="launcher",
                    help="the unpack B runs: the launcher's (its ASM and SWAP), or one order forced")
    ap.add_argument("--b-override", default=None, help="a JSON list of dicts of B's constants to override: B is timed "
                    "once per dict (b0, b1, ...), e.g. '[{\"STAGES\": 2}, {\"STAGES\": 4}]'; a dict's \"_options\": the "
                    "foldc.compile options of B's launch, e.g. {\"gemv_warps\": 4}")
    ap.add_argument("--variant", default=None, help="a JSON dict of the production kernel's constants to override "
                    "(timed as 'variant', e.g. '{\"X_SHARED\": false}')")
    ap.add_argument("--out", default="results/gemv_ab.json")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--quick", action="store_true", help="default options only")
    ap.add_argument("--options", default=None, help="a JSON list of launch options (foldc.compile keywords, or "
                    "\"split2\" / \"split/2\") to time the production kernel at, with fp16 x, instead of OPTIONS "
                    "(also with --quick)")
    ap.add_argument("--cases", default=None, help="indices into CASES, comma-separated (default: all)")
    args = ap.parse_args(argv)

    import foldc
    from foldc.backends.gluon.gemv_launch import gemv_bytes
    from foldc.gemm import GemmSpec, parse_gemm_encoding
    from foldc.gemm.reference import gemm_reference, quantize_2d

    kernel_b = load_kernel(args.b, args.b_kernel) if args.b else None
    options = json.loads(args.options) if args.options else OPTIONS[1:]
    print(f"seed {args.seed}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    picked = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    for enc, n, k, m in picked:
        spec = GemmSpec(n, k, parse_gemm_encoding(enc, "weight"))
        w = (torch.randn(n, k, generator=gen) * 0.05 + 0.01 * torch.randn(n, 1, generator=gen)).cuda()
        wq = quantize_2d(w, spec.weight)
        nbytes = gemv_bytes(spec)
        row = {"enc": enc, "n": n, "k": k, "m": m}
        for dt in (torch.float16, torch.bfloat16):
            x = (torch.randn(m, k, generator=gen) * 2 + 0.1).to("cuda", dt)
            ref = gemm_reference(x, wq)
            tag = str(dt)[6:]
            if dt == torch.float16:
                w16 = w.half()
                row["fp16_us"] = graph_us([lambda t=t: torch.mm(x, t.T) for t in copies(w16, n * k * 2)])
            if enc == "k-group:4:128" and dt == torch.bfloat16:
                packed, sz = int4pack(wq)
                row["torch_int4_err"] = rel(torch._weight_int4pack_mm(x, packed, 128, sz), ref)
                row["torch_int4_us"] = graph_us([lambda p=p: torch._weight_int4pack_mm(x, p, 128, sz)
                                                 for p in copies(packed, packed.numel() * packed.element_size())])
            kern = foldc.compile(spec, target="auto", kernel="gluon")
            y = kern(x, wq)
            row[f"a_{tag}_err"] = rel(y, ref)
            from foldc.backends.gluon.gemv import foldc_gemv_gluon

            calls = {"flip": b_call(foldc_gemv_gluon, kern.gemv, "flip")}
            if kernel_b is not None and args.b_override:
                for j, o in enumerate(json.loads(args.b_override)):
                    o = dict(o)
                    opts = o.pop("_options", {})   # foldc.compile options of B's launch (e.g. gemv_warps)
                    kb = foldc.compile(spec, target="auto", kernel="gluon", **opts) if opts else kern
                    calls[f"b{j}"] = b_call(kernel_b, kb.gemv, args.b_asm, o)
            elif kernel_b is not None:
                calls["b"] = b_call(kernel_b, kern.gemv, args.b_asm)
            if args.variant:
                calls["variant"] = b_call(foldc_gemv_gluon, kern.gemv, "launcher", json.loads(args.variant))
            ws = copies(wq, nbytes)
            row[f"a_{tag}_us"] = graph_us([lambda c=c: kern(x, c, out=y) for c in ws])
            if not row[f"a_{tag}_err"] < 1e-2:
                print("FAIL", f"a_{tag}", row[f"a_{tag}_err"], flush=True)
            for name, call in calls.items():
                yb = torch.empty_like(y)
                call(x, wq, yb)
                torch.cuda.synchronize()
                row[f"{name}_{tag}_err"] = rel(yb, ref)
                if not row[f"{name}_{tag}_err"] < 1e-2:
                    print("FAIL", name, tag, row[f"{name}_{tag}_err"], flush=True)
                row[f"{name}_{tag}_us"] = graph_us([lambda c=c: call(x, c, yb) for c in ws])
            if dt == torch.float16 and (args.options or not args.quick):   # the production kernel at other options
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                split = kern.gemv.plan_launch(dt, m, sms).grid[1]
                for opts in options:
                    splits = {"split2": {"gemv_split": 2 * split}, "split/2": {"gemv_split": max(1, split // 2)}}
                    o = splits[opts] if isinstance(opts, str) else opts
                    try:
                        kv = foldc.compile(spec, target="auto", kernel="gluon", **o)
                        yv = kv(x, wq)
                        err = rel(yv, ref)
                        us = graph_us([lambda c=c: kv(x, c, out=yv) for c in ws]) if err < 1e-2 else None
                    except Exception as e:  # noqa: BLE001 - reported per option
                        err, us = f"{type(e).__name__}: {str(e)[:200]}", None
                    row.setdefault("a_options", []).append((o, err, us))
            del ws
            row[f"a_{tag}_pct"] = 100 * nbytes / (row[f"a_{tag}_us"] * 1e-6) / read_ceiling()
        print(summary(row), flush=True)
        rows.append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"seed": args.seed, "b": args.b, "b_kernel": args.b_kernel,
                                              "b_asm": args.b_asm, "device": torch.cuda.get_device_name(),
                                              "ceiling_tb_s": read_ceiling() / 1e12,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
