"""GEMM inputs and float64 execution: quantizers for weights and activations, the
dequantize-then-matmul ground truth, and the float64 plan executor behind
``compile_gemm(spec, "reference")``.

Shapes: x ``[m, k]`` (fp16/bf16/fp32 tensor, or an AffineTensor of logical shape
``[1, 1, m, k]`` when the activation is encoded), w ``[n, k]`` likewise; y ``[m, n]``.
"""
from __future__ import annotations

import dataclasses

import torch

from ..encoding import AffineTensor, quantize
from ..errors import InputError, InputTypeError, ScaleOverflowError
from ..executor import Executor, TorchOps
from ..ir import K, M, N
from .spec import GemmEncoding, GemmSpec


def quantize_2d(t: torch.Tensor, enc: GemmEncoding) -> AffineTensor:
    """Quantize a ``[rows, k]`` matrix with groups along k (AffineTensor of shape [1, 1, rows, k])."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise InputError(f"expected a [rows, k] tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not isinstance(enc, GemmEncoding):
        raise InputTypeError(f"enc={enc!r} must be a GemmEncoding, e.g. "
                             f"foldc.gemm.parse_gemm_encoding('k-group:4:128', 'weight')")
    try:
        return quantize(t.reshape(1, 1, *t.shape), enc.affine(t.shape[1]))
    except ScaleOverflowError:
        raise ScaleOverflowError(
            f"the matrix has values (max |w| = {t.float().abs().max().item():.4g}) whose scale or zero overflow "
            f"{enc.scale_dtype}; use the encoding with float32 scales, "
            f"{dataclasses.replace(enc, scale_dtype=torch.float32).short()!r}") from None


def _matrix(t) -> torch.Tensor:
    """float64 [rows, k] values of a plain tensor or an AffineTensor."""
    if isinstance(t, AffineTensor):
        return t.dequantize(torch.float64)[0, 0]
    return t.to(torch.float64)


def gemm_reference(x, w) -> torch.Tensor:
    """float64 ``dequantize(x) @ dequantize(w).T``: the ground truth of every GEMM plan."""
    return _matrix(x) @ _matrix(w).T


def check_operand(name: str, t, enc: GemmEncoding | None, rows: int | None, k: int) -> int:
    """Validate one operand against the spec; return its number of rows."""
    if enc is None:
        if isinstance(t, AffineTensor):
            raise InputTypeError(f"{name} is an AffineTensor but the spec says {name} is plain")
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != k:
            # (a NumPy array's shape alone, "(3, 128)", read as the right one)
            got = t.shape if isinstance(t, torch.Tensor) else f"a {type(t).__name__}, not a torch.Tensor"
            raise InputError(f"{name} must be a [rows, k={k}] tensor; got {got}")
        if t.layout != torch.strided:   # (the executor raised from inside torch's reshape; the kernels named strides)
            raise InputError(f"{name} is a tensor of layout {t.layout}; the GEMM reads a dense {name}: pass "
                             f"{name}.to_dense()")
        if not t.is_floating_point():
            raise InputError(f"{name} dtype={t.dtype}: a plain operand is floating point (float16, bfloat16, float32 "
                             f"or float64); cast it, or give the spec an encoding for {name} (e.g. 'per-token:8') and "
                             "pass an AffineTensor")
        return t.shape[0]
    if not isinstance(t, AffineTensor):
        raise InputTypeError(f"{name} must be an AffineTensor of encoding {enc.short()} "
                             f"(foldc.gemm.quantize_2d({name}, enc)); got {type(t).__name__}")
    want = enc.affine(k)
    if t.encoding != want or t.shape[:2] != (1, 1) or t.shape[3] != k:
        raise InputError(f"{name} has encoding {t.encoding.short()} and shape {t.shape}; the spec needs "
                         f"{want.short()} with shape [1, 1, rows, k={k}]")
    return t.shape[2]


def operand_device(x, w) -> torch.device:
    """The device of one call: x's, which w's must be (a kernel given a weight on another device read another
    device's addresses, or raised from inside Triton; the float64 executor from inside torch)."""
    x_device, w_device = (t.device for t in (x, w))
    if w_device != x_device:
        raise InputError(f"w is on {w_device} but x is on {x_device}; move both to one device (w.to(x.device))")
    return x_device


def bindings(x, w) -> dict:
    out = {}
    for name, t in (("x", x), ("w", w)):
        if isinstance(t, AffineTensor):
            out[(name, "codes")] = t.unpack()[0, 0].to(torch.float64)
            out[(name, "scale")] = t.scale[0, 0].to(torch.float64)
            out[(name, "zero")] = t.zero[0, 0].to(torch.float64)
        else:
            out[(name, "values")] = t.to(torch.float64)
    return out


class ReferenceGemm:
    """The float64 plan executor as a GEMM callable: ``y = gemm(x, w)``, float64 [m, n]."""

    def __init__(self, the_plan):
        self.plan, self.spec = the_plan, the_plan.spec

    def __call__(self, x, w) -> torch.Tensor:
        spec: GemmSpec = self.spec
        m = check_operand("x", x, spec.activation, spec.m, spec.k)
        n = check_operand("w", w, spec.weight, spec.n, spec.k)
        if n != spec.n or (spec.m is not None and m != spec.m):
            raise InputError(f"x has {m} rows and w {n}; the spec says m={spec.m}, n={spec.n}")
        device = operand_device(x, w)
        if device.type == "meta":   # (the executor returned a CPU tensor of whatever its memory held)
            raise InputError("x and w are on the meta device, which holds no values to multiply; pass tensors on "
                             "the CPU or a GPU")
        sizes = {M: m, N: n, K: spec.k}
        env = Executor(self.plan.graph, TorchOps(device), bindings(x, w), sizes, 1, None, 1).run()
        return env[self.plan.graph.output].data
