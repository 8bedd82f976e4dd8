"""Command line: ``foldc explain``, ``foldc prove``, ``foldc compile``, ``foldc demo``.

The layout comes as flags (``--k token:2:128 --v channel:2:128 --heads 32/8 --head-dim 128``;
``none`` for a plain operand) or as a TOML file describing an attention or a GEMM layout (see
`foldc.spec.spec_from_toml`).
"""
from __future__ import annotations

import argparse
import sys

from .errors import FoldError, SpecError
from .spec import spec_from_args, spec_from_toml

DEFAULT_K = "token:2:128"
DEFAULT_V = "token:2:128"
DEFAULT_HEADS = "32/8"
DEFAULT_HEAD_DIM = 128
DEFAULTS = {"k": DEFAULT_K, "v": DEFAULT_V, "heads": DEFAULT_HEADS, "head_dim": DEFAULT_HEAD_DIM}


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("layout", nargs="?", help="TOML file describing the layout (instead of the flags)")
    p.add_argument("--k", default=None, help="key encoding layout:bits:group[:fp16|bf16|fp32], or none "
                   f"(default {DEFAULT_K})")
    p.add_argument("--v", default=None, help=f"value encoding, same syntax (default {DEFAULT_V})")
    p.add_argument("--heads", default=None, help="query heads / KV heads (default 32/8)")
    p.add_argument("--head-dim", type=int, default=None, help="channels per head (default 128)")


def _add_target_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, choices=["sm_90", "sm_100", "interpret"],
                   help="the plan of the kernel that runs the layout on this target, bf16 queries (fp16 for interpret, "
                   "the only ones it runs): its code bias, operand precision and rows per program; default: the "
                   "reference plan")


LAYOUT_FLAGS = (("k", "--k"), ("v", "--v"), ("heads", "--heads"), ("head_dim", "--head-dim"))


#: what an empty layout value should have held (an unset shell variable, --k "$K", gives one)
EMPTY_HINTS = {"--k": "an encoding such as token:2:128, or none for a plain operand",
               "--v": "an encoding such as channel:2:128, or none for a plain operand",
               "--heads": "query heads / KV heads such as 32/8"}


def _spec(args):
    if args.layout == "":
        raise SpecError("layout file '' is empty: give the path of a TOML layout file, or leave it out and describe "
                        "the layout by the flags")
    for name, flag in LAYOUT_FLAGS:
        if getattr(args, name) == "":   # taken for a flag left out, the default came out silently
            raise SpecError(f"{flag}='' is empty: give {EMPTY_HINTS[flag]}, or leave the flag out for its default")
    if args.layout:
        given = [flag for name, flag in LAYOUT_FLAGS if getattr(args, name) is not None]
        if given:   # the file describes the whole layout: a flag beside it would be ignored, silently
            raise SpecError(f"{given[0]} given with the layout file {args.layout}: describe the layout in the file "
                            "or by the flags, not both")
        return spec_from_toml(args.layout)
    try:
        return spec_from_args(args.k or DEFAULT_K, args.v or DEFAULT_V, args.heads or DEFAULT_HEADS,
                              DEFAULT_HEAD_DIM if args.head_dim is None else args.head_dim)
    except SpecError as e:   # a value the message names but the user never typed: say it is a flag's default
        sides = {"k": ("k",), "v": ("v",), "head_dim": ("k", "v"), "heads": ()}   # "head_dim (for k)=128"
        notes = [f"{flag} was left out: its default is {DEFAULTS[name]}" for name, flag in LAYOUT_FLAGS
                 if getattr(args, name) is None and any(f"(for {side})" in str(e) for side in sides[name])]
        if not notes:
            raise
        raise SpecError(f"{e} ({'; '.join(notes)})") from None


def _plan(args):
    """The reference plan, or with --target the plan the kernel that runs the layout there runs (bf16 queries)."""
    from .plan import plan

    spec = _spec(args)
    if args.target is None:
        return plan(spec)
    from .registry import workload_of

    if workload_of(spec) is not None:
        raise SpecError(f"--target {args.target} plans attention's kernels; a GEMM layout's plan has no target: drop "
                        "--target (foldc compile builds its kernel)")
    return plan(spec, target=args.target)


def cmd_explain(args) -> int:
    from .layout_compile import explain

    p = _plan(args)
    print(explain(p))
    if args.ir:
        print()
        print(p.graph)
    return 0


def cmd_prove(args) -> int:
    from .proof import prove

    p = _plan(args)
    print(p)
    print(prove(p))
    return 0


def cmd_compile(args) -> int:
    from .layout_compile import compile_layout

    if args.out == "":   # taken for --out left out, no kernel source was written
        raise SpecError("--out='' is empty: give a folder for the kernel source, or leave the flag out to write none")
    return compile_layout(_spec(args), args.target, args.out, dtype=args.dtype, seed=args.seed,
                          block_n=args.block_n, num_warps=args.num_warps, num_stages=args.num_stages,
                          kernel=args.kernel)


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(batch=args.batch, tokens=args.tokens, seed=args.seed, kernels=not args.no_kernels)


def cmd_bench(args) -> int:
    return bench_main(args.bench_args)


def bench_main(argv) -> int:
    """`foldc bench [...]`: the decode grid (foldc/bench.py), or with --layouts the K/V layout grid
    (foldc/bench_layouts.py), --gemm the GEMM/GEMV kernels (foldc/gemm/bench.py), --serving the
    serving layer (foldc/serving/bench.py); each has its own options."""
    if "--layouts" in argv:
        from .bench_layouts import main as layouts_main

        return layouts_main([a for a in argv if a != "--layouts"])
    if "--gemm" in argv:   # the GEMM/GEMV kernels against torch (foldc/gemm/bench.py)
        from .gemm.bench import main as gemm_main

        return gemm_main([a for a in argv if a != "--gemm"])
    if "--serving" in argv:   # appends, paged decode, caches, HF throughput (foldc/serving/bench.py)
        from .serving.bench import main as serving_main

        return serving_main([a for a in argv if a != "--serving"])
    from .bench import main as decode_main

    return decode_main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foldc", description="Fold affine-quantized KV caches into exact "
                                     "decode attention: plan, prove and run.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="print the plan as a table: folds, corrections, ordering, cost")
    _add_layout_args(p)
    p.add_argument("--ir", action="store_true", help="also print the folded IR graph")
    _add_target_arg(p)
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("prove", help="prove the plan exact with sympy")
    _add_layout_args(p)
    _add_target_arg(p)
    p.set_defaults(func=cmd_prove)
    p = sub.add_parser("compile", help="plan, prove and emit the kernel of a layout: build it ahead of time for "
                       "a GPU (no GPU needed), or check it under the interpreter / float64 executor")
    _add_layout_args(p)
    p.add_argument("--target", default="interpret", choices=["sm_90", "sm_100", "interpret", "reference"],
                   help="sm_90/sm_100: AOT build into --out; interpret: run the kernel on the CPU against the "
                   "float64 executor; reference: check the float64 executor (default interpret)")
    p.add_argument("--out", help="folder for the kernel source (and PTX, cubin, JSON report for a GPU target)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16"],
                   help="MMA dtype of a GPU build (default bf16; the interpreter runs fp16)")
    p.add_argument("--seed", type=int, default=0, help="random inputs of the interpret/reference check")
    p.add_argument("--block-n", type=int, default=None, help="attention: tokens per tile, a power of two in "
                   "16..256 (default 64; the register-operand kernel: 32 or 64)")
    p.add_argument("--num-warps", type=int, default=None, help="generated Triton kernels: warps per program, a "
                   "power of two in 1..32 (default 4)")
    p.add_argument("--num-stages", type=int, default=None, help="generated Triton kernels: pipeline stages, 1..8 "
                   "(default 2); the register-operand kernel: code tiles in flight, 2..4")
    p.add_argument("--kernel", default="auto", choices=["auto", "triton", "gluon"],
                   help="attention on sm_90 and sm_100: the register-operand kernel where it lowers the plan (auto, "
                   "gluon) or the generated Triton kernel (triton)")
    p.set_defaults(func=cmd_compile)
    p = sub.add_parser("bench", help="time the kernels against the HBM ceiling and bf16 peers (GPU)",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="see `foldc bench --help`")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("demo", help="the seed's four layouts at the paper's shapes: plan, prove, run")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kernels", action="store_true", help="skip the generated Triton kernel section")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser: flags pass through untouched
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FoldError as e:
        print(f"foldc: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
