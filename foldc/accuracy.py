"""How far a quantized KV cache moves decode attention from exact attention (issue 5's accuracy recipe).

foldc's kernels are exact with respect to the *dequantized* cache (docs/backend.md); this module
measures the other error, the one the codes themselves cause: attention over the cache a serving
configuration would hold (a quantized body, optional plain sink and recent windows, optional
Hadamard rotation of K and V) against exact float64 attention over the *unquantized* keys and
values. Everything runs in float64 on the CPU:

1. optionally rotate q, K and V (`foldc.rotation.Rotation`: K and q alike, V with the output
   un-rotated afterwards);
2. keep the first ``sink`` and last ``window`` tokens exact; quantize the tokens between them
   (the body) with `foldc.quantize` (min-max, round to nearest, scale and zero stored in
   ``scale_dtype``; channel-wise groups start at the body's first token, as in
   `foldc.serving.QuantizedKVCache`) and dequantize them to float64;
3. float64 softmax attention (`foldc.attention_reference`) over [sink | body | recent] (one
   softmax over the concatenation equals the cache's log-sum-exp merge of the parts), then
   un-rotate the output.

The attention arithmetic adds nothing measurable (float64), so the figures are the error of the
quantization alone: the codes and the float16/bfloat16 storage of scale and zero. A fused kernel
adds its own (bf16-level, ~1e-3 relative) error on top of this; see docs/perf.md for that part.

Metrics (`ErrorReport`): ``rel_l2 = ||o_hat - o|| / ||o||`` over the whole output tensor, and
``l2``, the mean over (batch, query head) of the plain L2 distance ``||o_hat_h - o_h||_2`` between
one head's output vectors (the quantity reported as "L2 distance" for plain INT2; its size
depends on the data's scale, so compare it between configurations on the same data only).

Data (`make_data`): ``"gaussian"``: q, K, V i.i.d. N(0, 1). ``"outlier"``: q ~ N(0, 1); K ~ N(0, 1)
with ``outliers`` channels per KV head (drawn at random) multiplied by factors uniform in
[10, 20], as real keys have; V structured: a rank-8 signal whose token coefficients follow an
AR(1) process along tokens (neighbouring tokens alike), plus per-channel offsets and small noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .encoding import SUPPORTED_BITS, SUPPORTED_LAYOUTS, SUPPORTED_SCALE_DTYPES, Affine, quantize
from .errors import InputError, InputTypeError, SpecError
from .options import as_int
from .reference import attention_reference
from .rotation import Rotation
from .validate import check_sm_scale

DATA_KINDS = ("gaussian", "outlier")
# the reference paper's attention shape
PAPER_SHAPE = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}


def _nonneg_int(name: str, value) -> int:
    value = as_int(value)   # a NumPy or 0-dim torch integer is that int (as AttentionSpec takes it)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"{name}={value!r} must be an integer >= 0")
    return value


def _seed(name: str, value) -> int:
    value = as_int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -2**63 <= value < 2**64:
        raise SpecError(f"{name}={value!r} must be an int in [-2**63, 2**64) (torch.Generator's seeds)")
    return value


@dataclass(frozen=True)
class AccuracyConfig:
    """One cache configuration to measure.

    Args:
        bits: code width of K and V (2, 4 or 8).
        k_layout, v_layout: ``"token"`` or ``"channel"`` (see `foldc.Affine`), or None to keep that
            operand unquantized.
        group_size: values per (scale, zero) pair.
        rotate: rotate K/q and V/output by a (randomized) Hadamard matrix before quantizing.
        rotation_seed: seed of the rotation's ±1 signs; None for the plain Hadamard matrix.
        sink, window: the first ``sink`` and last ``window`` tokens stay exact (bf16 windows in a
            real cache; bf16 rounding, ~2e-3 relative per value, is ignored here).
        scale_dtype: storage dtype of scale and zero (float16 as in foldc.Affine's default).
    """

    bits: int = 2
    k_layout: str | None = "token"
    v_layout: str | None = "token"
    group_size: int = 128
    rotate: bool = False
    rotation_seed: int | None = 0
    sink: int = 0
    window: int = 0
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for field in ("bits", "group_size", "sink", "window", "rotation_seed"):   # a NumPy integer is that int
            object.__setattr__(self, field, as_int(getattr(self, field)))
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in SUPPORTED_BITS:
            raise SpecError(f"bits={self.bits!r} is not supported; use one of {SUPPORTED_BITS}")
        for name in ("k_layout", "v_layout"):
            layout = getattr(self, name)
            if layout is not None and layout not in SUPPORTED_LAYOUTS:
                raise SpecError(f"{name}={layout!r} must be 'token', 'channel' or None (unquantized)")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise SpecError(f"group_size={self.group_size!r} must be a positive integer")
        if not isinstance(self.rotate, bool):
            raise SpecError(f"rotate={self.rotate!r} must be True or False")
        if self.rotation_seed is not None:
            _seed("rotation_seed", self.rotation_seed)
        _nonneg_int("sink", self.sink)
        _nonneg_int("window", self.window)
        if self.scale_dtype not in SUPPORTED_SCALE_DTYPES:
            raise SpecError(f"scale_dtype={self.scale_dtype} must be one of {list(SUPPORTED_SCALE_DTYPES)}")

    def encoding(self, operand: str) -> Affine | None:
        """The foldc.Affine of ``"k"`` or ``"v"`` (None when that operand stays unquantized)."""
        layout = {"k": self.k_layout, "v": self.v_layout}[operand]
        return None if layout is None else Affine(self.bits, layout, self.group_size, self.scale_dtype)

    def rotation(self, head_dim: int) -> Rotation | None:
        """The Rotation this configuration applies to heads of ``head_dim`` channels (None if rotate=False)."""
        return Rotation(head_dim, self.rotation_seed) if self.rotate else None

    def describe(self) -> str:
        lay = {"token": "tok", "channel": "chan", None: "plain"}
        parts = [f"INT{self.bits} K {lay[self.k_layout]} / V {lay[self.v_layout]} g{self.group_size}"]
        parts.append("rotated" if self.rotate else "no rotation")
        parts.append(f"sink {self.sink} + window {self.window}" if self.sink or self.window else "no windows")
        return ", ".join(parts)


@dataclass(frozen=True)
class ErrorReport:
    """Attention-output error of one configuration on one data set (module docstring)."""

    rel_l2: float          # ||o_hat - o||_F / ||o||_F over [batch, q_heads, head_dim]
    l2: float              # mean over (batch, q head) of ||o_hat_h - o_h||_2
    max_head_rel: float    # worst single head's ||o_hat_h - o_h|| / ||o_h||
    out_norm: float        # mean over (batch, q head) of ||o_h||_2 (scale of l2)


def make_data(kind: str = "gaussian", *, tokens: int = 4096, batch: int = 1, num_q_heads: int = 32,
              num_kv_heads: int = 8, head_dim: int = 128, seed: int = 0, outliers: int = 4):
    """``(q, k, v)`` in float64: q ``[batch, num_q_heads, head_dim]``, k and v ``[batch, num_kv_heads,
    tokens, head_dim]``. ``kind`` is ``"gaussian"`` or ``"outlier"`` (module docstring)."""
    if kind not in DATA_KINDS:
        raise SpecError(f"kind={kind!r} is not a data set; use one of {DATA_KINDS}")
    tokens, batch, num_q_heads, num_kv_heads, head_dim, outliers = (
        as_int(x) for x in (tokens, batch, num_q_heads, num_kv_heads, head_dim, outliers))
    for name, value in (("tokens", tokens), ("batch", batch), ("num_q_heads", num_q_heads),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"{name}={value!r} must be a positive integer")
    if num_q_heads % num_kv_heads:
        raise SpecError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if isinstance(outliers, bool) or not isinstance(outliers, int) or not 0 <= outliers <= head_dim:
        raise SpecError(f"outliers={outliers!r} must be an integer in [0, head_dim={head_dim}]")
    gen = torch.Generator().manual_seed(_seed("seed", seed))
    f64 = torch.float64
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen, dtype=f64)
    k = torch.randn(batch, num_kv_heads, tokens, head_dim, generator=gen, dtype=f64)
    if kind == "gaussian":
        v = torch.randn(batch, num_kv_heads, tokens, head_dim, generator=gen, dtype=f64)
        return q, k, v
    # outlier keys: a few channels per KV head, 10-20x larger than the rest
    gain = torch.ones(batch, num_kv_heads, 1, head_dim, dtype=f64)
    for b in range(batch):
        for h in range(num_kv_heads):
            chans = torch.randperm(head_dim, generator=gen)[:outliers]
            gain[b, h, 0, chans] = 10.0 + 10.0 * torch.rand(outliers, generator=gen, dtype=f64)
    k = k * gain
    # structured values: rank-8 signal with AR(1) token coefficients + channel offsets + noise
    rank, rho = 8, 0.9
    innov = torch.randn(batch, num_kv_heads, tokens, rank, generator=gen, dtype=f64)
    coef = torch.empty_like(innov)
    coef[:, :, 0] = innov[:, :, 0]
    step = math.sqrt(1 - rho * rho)
    for t in range(1, tokens):
        coef[:, :, t] = rho * coef[:, :, t - 1] + step * innov[:, :, t]
    basis = torch.randn(batch, num_kv_heads, rank, head_dim, generator=gen, dtype=f64) / math.sqrt(rank)
    offset = 0.5 * torch.randn(batch, num_kv_heads, 1, head_dim, generator=gen, dtype=f64)
    noise = 0.25 * torch.randn(batch, num_kv_heads, tokens, head_dim, generator=gen, dtype=f64)
    v = coef @ basis + offset + noise
    return q, k, v


def _check_readable(name: str, x: torch.Tensor) -> None:
    """A tensor whose values the figures are computed from: dense, not on the meta device (torch raised from
    inside an as_strided, a reshape or an .item() of such tensors)."""
    if x.layout != torch.strided or x.is_meta:
        where = "on the meta device" if x.is_meta else f"of layout {x.layout}"
        fix = f"{name}.to_dense()" if not x.is_meta else "a tensor on the CPU or a GPU"
        raise InputError(f"{name} is a tensor {where}, whose values cannot be read; the accuracy figures are computed "
                         f"from the values: pass {fix}")


def _check_operands(q, k, v) -> None:
    for name, x, dims in (("q", q, 3), ("k", k, 4), ("v", v, 4)):
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != dims or not x.is_floating_point():
            want = "[batch, num_q_heads, head_dim]" if dims == 3 else "[batch, num_kv_heads, tokens, head_dim]"
            raise InputError(f"{name} must be a floating-point {want}; got dtype={x.dtype}, shape={tuple(x.shape)}")
        _check_readable(name, x)
    if k.shape != v.shape:
        raise InputError(f"k shape={tuple(k.shape)} and v shape={tuple(v.shape)} must match")
    for name, x in (("q", q), ("k", k)):   # no KV heads divided by zero below; no tokens: nothing to attend over
        if x.numel() == 0:
            raise InputError(f"{name} shape={tuple(x.shape)} has an axis of size 0; every axis needs at least one "
                             "entry (k and v at least one token)")
    b, hq, d = q.shape
    if (k.shape[0], k.shape[3]) != (b, d) or hq % k.shape[1]:
        raise InputError(f"q shape={tuple(q.shape)} does not fit k shape={tuple(k.shape)}: batch and head_dim must "
                         "match and num_q_heads must be a multiple of num_kv_heads")


def cache_values(x: torch.Tensor, enc: Affine | None, sink: int = 0, window: int = 0) -> torch.Tensor:
    """float64 values a cache would hand attention for ``x [batch, heads, tokens, head_dim]``: the first
    ``sink`` and last ``window`` tokens exact, the tokens between quantized with ``enc`` and
    dequantized (all exact when ``enc`` is None or no token is left between the windows)."""
    sink = _nonneg_int("sink", sink)   # a negative sink sliced from the end: the last tokens were quantized
    window = _nonneg_int("window", window)
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor [batch, heads, tokens, head_dim], got {type(x).__name__}")
    if x.dim() != 4 or not x.is_floating_point():
        raise InputError(f"x must be a floating-point [batch, heads, tokens, head_dim]; got dtype={x.dtype}, "
                         f"shape={tuple(x.shape)}")
    _check_readable("x", x)
    x = x.to(torch.float64)
    n = x.shape[2]
    s = min(sink, n)
    r = min(window, n - s)
    body = x[:, :, s:n - r]
    if enc is None or body.shape[2] == 0:
        return x
    body_hat = quantize(body, enc).dequantize(torch.float64)
    return torch.cat([x[:, :, :s], body_hat, x[:, :, n - r:]], dim=2)


def quantized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: AccuracyConfig,
                        sm_scale: float | None = None, *, prerotated: bool = False) -> torch.Tensor:
    """float64 attention output ``[batch, num_q_heads, head_dim]`` over the cache ``config`` would hold
    for k and v (rotation, windows, quantized body; module docstring), un-rotated.

    ``prerotated=True`` says q, k and v already went through ``config.rotation()`` (to rotate a data
    set once for many configurations); the output is un-rotated all the same."""
    if not isinstance(config, AccuracyConfig):
        raise InputTypeError(f"config must be a foldc.accuracy.AccuracyConfig, got {type(config).__name__}")
    _check_operands(q, k, v)
    if prerotated and not config.rotate:
        raise SpecError("prerotated=True but config.rotate=False; pass the unrotated q, k, v")
    q, k, v = q.to(torch.float64), k.to(torch.float64), v.to(torch.float64)
    rot = config.rotation(q.shape[-1])
    if rot is not None and not prerotated:
        q, k, v = rot.rotate_queries(q), rot.rotate_keys(k), rot.rotate_values(v)
    k_hat = cache_values(k, config.encoding("k"), config.sink, config.window)
    v_hat = cache_values(v, config.encoding("v"), config.sink, config.window)
    out = attention_reference(q, k_hat, v_hat, sm_scale)
    return rot.unrotate_output(out) if rot is not None else out


def compare(out: torch.Tensor, exact: torch.Tensor) -> ErrorReport:
    """`ErrorReport` of an output against the exact one (both [batch, num_q_heads, head_dim])."""
    if not (isinstance(out, torch.Tensor) and isinstance(exact, torch.Tensor)) or out.shape != exact.shape \
            or out.dim() < 1 or out.numel() == 0:
        raise InputError(f"out and exact must be non-empty tensors of one shape [..., head_dim]; got "
                         f"{getattr(out, 'shape', out)} and {getattr(exact, 'shape', exact)}")
    for name, x in (("out", out), ("exact", exact)):   # complex: .to(float64) dropped the imaginary part
        if not x.is_floating_point():
            raise InputError(f"{name} dtype={x.dtype} must be a real floating-point type (an attention output)")
    if out.device != exact.device:
        raise InputError(f"out is on {out.device} but exact is on {exact.device}; move both to one device")
    _check_readable("out", out)
    _check_readable("exact", exact)
    out, exact = out.to(torch.float64), exact.to(torch.float64)
    diff = (out - exact).norm(dim=-1)
    norm = exact.norm(dim=-1)
    return ErrorReport(
        rel_l2=float(_relative((out - exact).norm(), exact.norm())),
        l2=float(diff.mean()),
        max_head_rel=float(_relative(diff, norm).max()),
        out_norm=float(norm.mean()),
    )


def _relative(diff: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """diff / norm, where an exact output of norm 0 (a head whose values are all zero) counts 0 if matched and inf
    if not (0 / 0 was NaN, which hid every other head's error from max_head_rel)."""
    return torch.where(norm > 0, diff / norm.clamp_min(torch.finfo(norm.dtype).tiny),
                       torch.where(diff > 0, torch.inf, 0.0).to(diff.dtype))


def attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: AccuracyConfig,
                    sm_scale: float | None = None) -> ErrorReport:
    """Error of `quantized_attention` against exact float64 attention over the unquantized k, v."""
    _check_operands(q, k, v)
    exact = attention_reference(q.to(torch.float64), k.to(torch.float64), v.to(torch.float64), sm_scale)
    return compare(quantized_attention(q, k, v, config, sm_scale), exact)


def window_mass(q: torch.Tensor, k: torch.Tensor, sink: int, window: int, sm_scale: float | None = None) -> float:
    """Share of exact attention weight that falls on the first ``sink`` and last ``window`` tokens,
    averaged over (batch, query head): how much of the output the exact windows can protect."""
    _check_operands(q, k, k)
    sink, window = _nonneg_int("sink", sink), _nonneg_int("window", window)
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    scale = check_sm_scale(sm_scale, d)
    qf = q.to(torch.float64).reshape(b, hkv, hq // hkv, d)
    p = torch.softmax(torch.einsum("bkhd,bknd->bkhn", qf, k.to(torch.float64)) * scale, dim=-1)
    s = min(sink, n)
    r = min(window, n - s)
    return float((p[..., :s].sum(-1) + p[..., n - r:].sum(-1)).mean())


def measure(config: AccuracyConfig, kind: str = "gaussian", *, tokens: int = 4096, seed: int = 0,
            **shape) -> ErrorReport:
    """`attention_error` of ``config`` on ``make_data(kind, tokens=tokens, seed=seed, **shape)``
    (the paper's shape, 32 query / 8 KV heads, head_dim 128, unless ``shape`` says otherwise)."""
    q, k, v = make_data(kind, tokens=tokens, seed=seed, **{**PAPER_SHAPE, **shape})
    return attention_error(q, k, v, config)


__all__ = ["AccuracyConfig", "DATA_KINDS", "ErrorReport", "PAPER_SHAPE", "attention_error", "cache_values",
           "compare", "make_data", "measure", "quantized_attention", "window_mass"]
