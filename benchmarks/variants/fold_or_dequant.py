"""The break-even verdict (eq. 12) against the other choice on the register-operand kernel at 16 query rows per KV
head: the plan's verdict (the default) beside the same spec planned with it overridden (BreakEven patched in this
process only), errors against float64 and CUDA-graph times in alternating rounds (H100/H200; an experiment, not a
test). Ahead of time (sm_90, SASS a tile): where eq. 12 ties (token-wise groups of 32) the fold takes 19-23% fewer
than the dequant plan (token:2:32 64/4: 1302 -> 1005); for channel-wise K in groups of 64 and 128, where eq. 12
folds, rebuilding the keys per value takes 6-17% fewer (K channel:4:64 / V token:4:64 64/4: 1013 -> 840, and no
spill) than the fold's per-group query operand for 16 rows.

    PYTHONPATH=. python3 benchmarks/variants/fold_or_dequant.py --out $OUT/fold_or_dequant.json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch

import foldc
import foldc.backends.gluon  # noqa: F401  (foldc.backends.gluon.lower, the module, in sys.modules)
import foldc.passes.break_even as break_even
import foldc.plan as plan_module
from foldc.bench import decode_case, save_rows, timed
from foldc.ir import Contract
from foldc.spec import spec_from_args
from foldc.testing import rel_l2

# (K, V, heads, head_dim, the override: "fold" keeps every fold, "dequant-k" rebuilds the keys per value; launch options)
CASES = [("token:2:32", "token:2:32", "64/4", 128, "fold", {}), ("token:4:32", "token:4:32", "64/4", 128, "fold", {}),
         ("token:8:32", "token:8:32", "64/4", 128, "fold", {}), ("token:4:32", "channel:2:32", "64/2", 128, "fold", {}),
         ("channel:4:64", "token:4:64", "64/4", 128, "dequant-k", {"block_n": 32}),
         ("channel:4:64", "token:4:64", "64/2", 128, "dequant-k", {"block_n": 32}),
         ("channel:2:64", "token:2:64", "64/4", 128, "dequant-k", {"block_n": 32}),
         ("channel:2:128", "token:2:128", "64/4", 128, "dequant-k", {"block_n": 32})]


def override(how: str | None):
    """BreakEven as shipped (None), keeping every fold ("fold") or rebuilding the keys per value ("dequant-k");
    the plan caches are cleared."""
    lower_module = sys.modules["foldc.backends.gluon.lower"]
    if not hasattr(lower_module, "SHIPPED_COSTS"):
        lower_module.SHIPPED_COSTS = lower_module.FOLD_COSTS
    lower_module.FOLD_COSTS = None if how == "eq12" else lower_module.SHIPPED_COSTS   # "eq12": eq. 12 alone
    if not hasattr(break_even.BreakEven, "_shipped_apply"):
        break_even.BreakEven._shipped_apply = break_even.BreakEven.apply
    shipped = break_even.BreakEven._shipped_apply

    def apply(self, graph):
        if how == "fold" and self.policy == "auto":
            return graph.copy(), False
        out, changed = shipped(self, graph)
        if how == "dequant-k":
            for node in out.nodes_of(Contract):
                if node.product == "qk" and node.fold in ("acc-fold", "operand-fold"):
                    out.replace_node(replace(node, fold="dequant"))
                    changed = True
        return out, changed

    break_even.BreakEven.apply = apply
    for fn in vars(plan_module).values():
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="8x65536")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default=None, help="JSON list of [K, V, heads, head_dim, override, options]")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    b, n = (int(x) for x in args.shape.split("x"))
    rows = []
    for k, v, heads, d, how, options in (json.loads(args.cases) if args.cases else CASES):
        spec = spec_from_args(k, v, heads, d)
        q, kc, vc = decode_case(spec, b, n, seed=b * n)
        ref = foldc.attention_reference(q, kc, vc)
        kernels = {}
        for name, verdict, opts in (("default", None, {}), (how, how, options)):
            override(verdict)
            attn = foldc.compile(spec, "sm_90", kernel="gluon", **opts)
            kernels[name] = (attn, attn.config.key_dequant, attn.config.value_dequant)
        override(None)
        best, errors = {}, {}
        for name, (attn, _, _) in kernels.items():
            errors[name] = rel_l2(attn(q, kc, vc), ref)
        for _ in range(args.rounds):
            for name, (attn, _, _) in kernels.items():
                eager, graph = timed(lambda attn=attn: attn(q, kc, vc))
                us = min(t for t in (eager, graph) if t is not None)
                best[name] = min(best.get(name, us), us)
        for name, (_, kdq, vdq) in kernels.items():
            row = dict(case=f"{k}/{v} {heads} d{d} {args.shape}", kernel=name, key_dequant=kdq, value_dequant=vdq,
                       us=best[name], error=errors[name], vs_default=best[name] / best["default"])
            rows.append(row)
            print(row, flush=True)
        save_rows(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
