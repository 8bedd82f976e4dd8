"""foldc: compile an affine-quantized KV-cache layout into a provably exact decode attention.

Public API::

    enc = foldc.Affine(bits=2, layout="token", group_size=128)
    kq = foldc.quantize(k, enc)                      # AffineTensor (packed codes, scale, zero)
    spec = foldc.AttentionSpec(32, 8, 128, k=enc, v=enc)
    p = foldc.plan(spec); print(p); p.folds          # {"qk": "acc-fold", "pv": "operand-fold"}
    foldc.check_plan(p)                              # the fold rules alone (PlanError names rule and product)
    foldc.prove(p)                                   # sympy proof, raises FoldError if not exact
    attn = foldc.compile(spec, target="reference")   # float64 plan executor
    out = attn(q, kq, vq, sm_scale=None, seq_lens=None)
"""
from .compile import compile
from .encoding import Affine, AffineTensor, quantize
from .merge import merge_attention
from .errors import FoldError, GraphError, InputError, InputTypeError, PlanError, ProofError, SpecError
from .plan import Plan, ProductPlan, check_plan, plan
from .proof import ProofReport, prove
from .reference import attention_reference
from .spec import AttentionSpec
from .gemm import GemmEncoding, GemmSpec   # registers the GEMM workload (foldc/registry.py)
from . import backends   # registers the attention backends (foldc/registry.py)  # noqa: E402, F401
from . import nn   # foldc.nn.FoldLinear and the foldc::linear op  # noqa: E402, F401
from . import ops   # the foldc::decode_attention and foldc::append_kv ops  # noqa: E402, F401

__all__ = [
    "Affine", "AffineTensor", "AttentionSpec", "GemmEncoding", "GemmSpec", "FoldError", "GraphError", "InputError", "InputTypeError",
    "Plan", "PlanError", "ProductPlan", "ProofError", "ProofReport", "SpecError", "attention_reference",
    "check_plan", "compile", "merge_attention", "plan", "prove", "quantize",
]
