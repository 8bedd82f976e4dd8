"""GEMM inputs and float64 execution: quantizers for weights and activations, the
dequantize-then-matmul ground truth, and the float64 plan executor behind
``compile_gemm(spec, "reference")``.

Shapes: x ``[m, k]`` (fp16/bf16/fp32 tensor, or an AffineTensor of logical shape
``[1, 1, m, k]`` when the activation is encoded), w ``[n, k]`` likewise; y ``[m, n]``.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..encoding import AffineTensor, quantize
from ..errors import InputError, InputTypeError, ScaleOverflowError, SpecError
from ..executor import Executor, TorchOps
from ..ir import K, M, N
from .spec import GemmEncoding, GemmSpec, gemm_text


def quantize_2d(t: torch.Tensor, enc: GemmEncoding) -> AffineTensor:
    """Quantize a ``[rows, k]`` matrix with groups along k (AffineTensor of shape [1, 1, rows, k])."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise InputError(f"expected a [rows, k] tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not isinstance(enc, GemmEncoding):
        raise InputTypeError(f"enc={enc!r} must be a GemmEncoding, e.g. "
                             f"foldc.gemm.parse_gemm_encoding('k-group:4:128', 'weight')")
    rows, k = t.shape   # (checked here: the attention quantizer named them tokens and head_dim)
    if rows < 1 or k < 1:
        raise InputError(f"the matrix has shape {tuple(t.shape)}; quantize_2d needs at least one row and one column")
    per_byte = 8 // enc.bits
    if k % per_byte:
        raise SpecError(f"k={k}, the matrix's columns, is not a multiple of {per_byte}, the {enc.bits}-bit codes per "
                        "byte; pad k")
    if enc.group_size is not None and k % enc.group_size:
        raise SpecError(f"group_size={enc.group_size} of {enc.short()} does not divide k={k}, the matrix's columns; "
                        f"pick a divisor of {k}")
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
        role = "weight" if name == "w" else "activation"
        raise InputError(f"{name} has encoding {gemm_text(t.encoding, t.head_dim, role)} and shape {t.shape}; the spec "
                         f"needs {enc.short()} with shape [1, 1, rows, k={k}]")
    return t.shape[2]


_PEAK_VALUES = 1 << 24   # the exact check dequantizes this many values at a time


def rebuilt_peak(t: AffineTensor, limit: float) -> tuple[float, int, int] | None:
    """(largest |scale * code + zero|, its row, its column) over a ``[1, 1, rows, k]`` operand, or None when no value
    can pass ``limit``. First a bound from the scales and zeros alone (each group's values lie between ``zero`` and
    ``scale * max_code + zero``); only where the bound passes ``limit``, the values of the codes stored (a group whose
    codes never reach the top code can fit where its bound does not). Computed in float64 (one device sync)."""
    enc = t.encoding
    if t.scale.numel() == 0 or float(torch.finfo(enc.scale_dtype).max) * (enc.max_code + 1) <= limit:
        return None   # no scale and zero of the dtype can get there
    s, z = t.scale.to(torch.float64), t.zero.to(torch.float64)
    if not float(torch.maximum(z.abs(), (s * enc.max_code + z).abs()).max()) > limit:
        return None
    peak, at, k = -1.0, (0, 0), t.head_dim
    step = max(1, _PEAK_VALUES // k)
    for r in range(0, t.shape[2], step):
        rows = slice(r, r + step)
        part = AffineTensor(t.codes[:, :, rows], t.scale[:, :, rows], t.zero[:, :, rows], enc, k)
        values = part.dequantize(torch.float64)[0, 0].abs().nan_to_num(nan=0.0, posinf=math.inf)
        i = int(values.argmax())
        if float(values.view(-1)[i]) > peak:
            peak, at = float(values.view(-1)[i]), (r + i // k, i % k)
    return (peak, *at) if peak > limit else None


def check_rebuilt(name: str, t: AffineTensor, dtype: torch.dtype, fix: str) -> None:
    """Refuse an operand whose values ``scale * code + zero``, rebuilt one by one in ``dtype`` by a kernel (a plan
    whose fold for it is ``dequant``), pass ``dtype``'s largest finite value: each such value would be inf there
    and the output silently wrong (the plan executor's float64 gives finite values). ``fix``: what to change, for
    the message."""
    limit = float(torch.finfo(dtype).max)
    found = rebuilt_peak(t, limit)
    if found is not None:
        peak, row, col = found
        raise InputError(f"{name} holds values scale * code + zero up to |{peak:.6g}| ({name}[{row}, {col}]), past "
                         f"{dtype}'s largest finite value {limit:.6g}: this call's plan rebuilds every {name} value "
                         f"in {dtype} (fold 'dequant'), where they would be inf and the output wrong; {fix}")


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
