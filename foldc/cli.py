"""Command line: ``foldc explain``, ``foldc prove``, ``foldc demo``.

The layout comes as flags (``--k token:2:128 --v channel:2:128 --heads 32/8 --head-dim 128``;
``none`` for a plain operand) or as a TOML file (see `foldc.spec.spec_from_toml`).
"""
from __future__ import annotations

import argparse
import sys

from .errors import FoldError
from .spec import spec_from_args, spec_from_toml

DEFAULT_K = "token:2:128"
DEFAULT_V = "token:2:128"


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("layout", nargs="?", help="TOML file describing the layout (overrides the flags)")
    p.add_argument("--k", default=DEFAULT_K, help="key encoding layout:bits:group[:fp16|bf16|fp32], or none "
                   f"(default {DEFAULT_K})")
    p.add_argument("--v", default=DEFAULT_V, help=f"value encoding, same syntax (default {DEFAULT_V})")
    p.add_argument("--heads", default="32/8", help="query heads / KV heads (default 32/8)")
    p.add_argument("--head-dim", type=int, default=128, help="channels per head (default 128)")


def _spec(args):
    if args.layout:
        return spec_from_toml(args.layout)
    return spec_from_args(args.k, args.v, args.heads, args.head_dim)


def cmd_explain(args) -> int:
    from .explain import explain_table
    from .plan import plan

    p = plan(_spec(args))
    print(explain_table(p))
    if args.ir:
        print()
        print(p.graph)
    return 0


def cmd_prove(args) -> int:
    from .plan import plan
    from .proof import prove

    p = plan(_spec(args))
    print(p)
    print(prove(p))
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(batch=args.batch, tokens=args.tokens, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foldc", description="Fold affine-quantized KV caches into exact "
                                     "decode attention: plan, prove and run.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="print the plan as a table: folds, corrections, ordering, cost")
    _add_layout_args(p)
    p.add_argument("--ir", action="store_true", help="also print the folded IR graph")
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("prove", help="prove the plan exact with sympy")
    _add_layout_args(p)
    p.set_defaults(func=cmd_prove)
    p = sub.add_parser("demo", help="the seed's four layouts at the paper's shapes: plan, prove, run")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
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
