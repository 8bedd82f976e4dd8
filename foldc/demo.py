"""`foldc demo`: the seed's four layouts at the reference paper's shape (32 query heads, 8 KV
heads, head_dim 128, INT2, groups of 128), each planned, proved and executed on fresh random
data against float64 attention over the same dequantized cache."""
from __future__ import annotations

import time

import torch

from .compile import compile as compile_attention
from .targets import detect_target
from .encoding import Affine, quantize
from .explain import plan_summary, seed_table
from .options import check_int
from .plan import plan
from .proof import prove
from .reference import attention_reference
from .spec import AttentionSpec
from .testing import run_case

LAYOUTS = (("token", "token"), ("token", "channel"), ("channel", "token"), ("channel", "channel"))
HEADS, KV_HEADS, HEAD_DIM, BITS, GROUP = 32, 8, 128, 2, 128
#: the demo holds several float32 copies of the cache (4 KB per token and KV head group of 8):
#: at most this many cached tokens over the whole batch (about 256 MB per copy)
MAX_BATCH, MAX_CACHED = 64, 65536


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def run_demo(batch: int = 2, tokens: int = 1000, seed: int = 0, kernels: bool = True) -> int:
    check_int("batch", batch, 1, MAX_BATCH, what="sequences (--batch)")
    check_int("tokens", tokens, 1, MAX_CACHED // batch, what=f"cached tokens per sequence (--tokens); batch x tokens "
              f"is at most {MAX_CACHED}")
    check_int("seed", seed, 0, 2**63 - 1, what="seed of the random inputs (--seed)")
    gen = torch.Generator().manual_seed(seed)
    print(f"foldc demo: {HEADS} query heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, INT{BITS}, "
          f"groups of {GROUP}; batch {batch}, {tokens} cached tokens (seed {seed})\n")
    plans, rows = [], []
    seq_lens = torch.tensor([tokens - 7 * i for i in range(batch)]).clamp(min=1)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=gen)
    k[..., 3] += 4.0  # an outlier channel, as real keys have
    for k_layout, v_layout in LAYOUTS:
        spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, k=Affine(BITS, k_layout, GROUP), v=Affine(BITS, v_layout, GROUP))
        the_plan = plan(spec)
        plans.append(the_plan)
        print(plan_summary(the_plan))
        report = prove(the_plan)
        print(f"  proof: exact ({len(report.lemmas)} lemmas over symbolic g; instances: "
              + "; ".join(str(i) for i in report.instances) + ")\n")
        kq, vq = quantize(k, spec.k), quantize(v, spec.v)
        t0 = time.perf_counter()
        out = compile_attention(spec, target="reference")(q, kq, vq, seq_lens=seq_lens)
        secs = time.perf_counter() - t0
        ref = attention_reference(q, kq, vq, seq_lens=seq_lens)
        exact = attention_reference(q, k, v, seq_lens=seq_lens)
        rows.append((f"K {k_layout}-wise, V {v_layout}-wise", the_plan.folds["qk"], the_plan.folds["pv"],
                     _rel_l2(out, ref), (out - ref).abs().max().item(), _rel_l2(out, exact), secs))
    print("The explainer's table, regenerated from the plans:")
    print(seed_table(plans))
    print("\nFolded plan executed in float64 vs float64 attention over the same dequantized cache")
    print("(last column: vs attention over the unquantized cache, i.e. the INT2 quantization error itself)")
    header = f"{'layout':<31} {'qk':<13} {'pv':<13} {'rel L2 vs deq':>14} {'max abs':>10} {'vs exact':>9} {'time':>7}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for name, qk, pv, err, mx, exact_err, secs in rows:
        worst = max(worst, err)
        print(f"{name:<31} {qk:<13} {pv:<13} {err:>14.2e} {mx:>10.2e} {exact_err:>9.3f} {secs:>6.2f}s")
    status = "OK: every folded plan matches dequantize-then-compute at float64 level" if worst < 1e-10 else \
        "FAILED: a folded plan differs from dequantize-then-compute"
    print(f"\n{status} (worst {worst:.2e})")
    kernels_ok = run_kernels(seed) if kernels else True
    return 0 if worst < 1e-10 and kernels_ok else 1


def run_kernels(seed: int) -> bool:
    """The generated Triton kernel for the same four plans: native on a GPU, interpreted on the CPU."""
    gpu = torch.cuda.is_available()
    target = detect_target()
    dtype, device = (torch.bfloat16, "cuda") if gpu else (torch.float16, "cpu")
    batch, tokens = (4, 16384) if gpu else (1, 600)
    where = torch.cuda.get_device_name() if gpu else "Triton interpreter on the CPU (fp16)"
    print(f"\nGenerated Triton kernel, target={target} ({where}), batch {batch}, {tokens} tokens, "
          f"{str(dtype).replace('torch.', '')} queries:")
    header = f"{'layout':<31} {'kernel rel L2':>14} {'bf16 attention':>15} {'ratio':>6} {'unwritten':>10}"
    print(header)
    print("-" * len(header))
    ok = True
    for i, (k_layout, v_layout) in enumerate(LAYOUTS):
        spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, k=Affine(BITS, k_layout, GROUP), v=Affine(BITS, v_layout, GROUP))
        r = run_case(compile_attention(spec, target=target), spec, batch, tokens, dtype, device, seed + i)
        ok &= r.unwritten == 0 and r.ratio <= 1.10
        print(f"{f'K {k_layout}-wise, V {v_layout}-wise':<31} {r.error:>14.2e} {r.bf16_error:>15.2e} "
              f"{r.ratio:>6.2f} {r.unwritten:>10}")
    print("(kernel vs float64 attention over the same dequantized cache; bf16 attention over those values "
          "is the bar)")
    return ok
