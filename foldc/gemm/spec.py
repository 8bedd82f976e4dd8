"""GemmSpec: ``y[m, n] = sum_k x[m, k] * w[n, k]`` (``y = x @ w.T``) with affine-encoded operands.

Encodings (text form ``kind:bits[:group_size][:fp16|bf16|fp32]``):

- weight ``k-group:4:128``: codes with one (scale, zero) per output channel and per group of 128
  input channels (the common 4-bit and 2-bit weight formats: the scale changes along the
  reduced axis k between groups and is constant inside one);
- weight ``per-channel:8``: one (scale, zero) per output channel for the whole k axis (a pure
  epilogue fold);
- activation ``per-token:8``: one (scale, zero) per row of x (INT8 activations with a zero point).
  With an encoded activation the weight must be ``per-channel`` (both groups span k, eq. 15).

Both encodings are `foldc.Affine` with layout "token" (groups along the packed last axis, k):
a weight ``[n, k]`` is quantized as ``quantize(w.reshape(1, 1, n, k), enc)``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..encoding import Affine
from ..errors import SpecError
from ..options import as_int
from ..spec import check_table_fields

WEIGHT_KINDS = ("k-group", "per-channel")
ACTIVATION_KINDS = ("per-token",)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: activation rows that share one dequantized weight tile in the generated kernel (the largest
#: BLOCK_M); the break-even of eq. 16 counts min(m, this)
ROWS_PER_TILE = 64
#: the largest n, k and m: the kernels number rows, output channels and input channels with 32-bit integers (a tile's
#: ``program_id * BLOCK + arange``, the k loop), which wrap past it
MAX_SIZE = 2**31 - 1
_SIZE_NAMES = {"n": "output channels", "k": "input channels", "m": "rows of x"}


@dataclass(frozen=True)
class GemmEncoding:
    """One encoded GEMM operand: ``kind`` (k-group, per-channel, per-token), bits, group size
    along k (None for per-channel/per-token: the whole k axis) and the scale/zero dtype."""

    kind: str
    bits: int
    group_size: int | None = None
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for field in ("bits", "group_size"):   # a NumPy or 0-dim torch integer is that int (as GemmSpec takes it)
            object.__setattr__(self, field, as_int(getattr(self, field)))
        if self.kind not in WEIGHT_KINDS + ACTIVATION_KINDS:
            raise SpecError(f"kind={self.kind!r} is not an encoding kind; use one of {WEIGHT_KINDS + ACTIVATION_KINDS}")
        if self.kind == "k-group" and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                       or self.group_size < 1):
            raise SpecError(f"group_size={self.group_size!r}: a k-group encoding needs a positive group size, "
                            "e.g. 'k-group:4:128'")
        if self.kind != "k-group" and self.group_size is not None:
            raise SpecError(f"group_size={self.group_size!r}: a {self.kind} encoding has one group spanning "
                            f"the whole k axis; write '{self.kind}:{self.bits}'")
        Affine(self.bits, "token", self.group_size or 1, self.scale_dtype)  # checks bits and dtype

    def affine(self, k: int) -> Affine:
        """The `foldc.Affine` (groups along the packed axis k) for a reduced axis of ``k``."""
        return Affine(self.bits, "token", self.group_size or k, self.scale_dtype)

    def short(self) -> str:
        dt = {torch.float16: "", torch.bfloat16: ":bf16", torch.float32: ":fp32"}[self.scale_dtype]
        return f"{self.kind}:{self.bits}" + (f":{self.group_size}" if self.group_size else "") + dt


def gemm_text(enc: Affine, k: int, role: str) -> str:
    """An operand's `foldc.Affine` (as `GemmEncoding.affine` makes it, groups along its ``k`` columns) in the GEMM's
    syntax: ``k-group:4:128``, or ``per-channel:8`` / ``per-token:8`` (``role`` "weight" / "activation") where one
    group spans k; an attention-only encoding (channel-wise) as its own text."""
    if enc.layout != "token":
        return f"{enc.short()} (an attention encoding: groups along tokens)"
    if enc.group_size >= k:
        return GemmEncoding("per-channel" if role == "weight" else "per-token", enc.bits, None, enc.scale_dtype).short()
    return GemmEncoding("k-group", enc.bits, enc.group_size, enc.scale_dtype).short()


def parse_gemm_encoding(text, role: str) -> GemmEncoding | None:
    """``k-group:4:128`` / ``per-channel:8`` / ``per-token:8[:bf16]`` -> GemmEncoding; none -> None."""
    if text is None or text in ("", "none", "plain"):
        return None
    if isinstance(text, dict):
        bad = set(text) - {"kind", "bits", "group_size", "scale_dtype"}
        if bad:
            raise SpecError(f"{role} encoding has unknown keys {sorted(bad)}; use kind, bits, group_size, scale_dtype")
        check_table_fields(text, f"{role} encoding's")
        parts = [str(text.get("kind", "")), str(text.get("bits", ""))]
        parts += [str(text["group_size"])] if "group_size" in text else []
        parts += [str(text["scale_dtype"])] if "scale_dtype" in text else []
        text = ":".join(parts)
    if not isinstance(text, str):
        raise SpecError(f"{role}={text!r} must be a string like 'k-group:4:128'")
    parts = text.strip().split(":")
    dtype = torch.float16
    if parts[-1] in DTYPES:
        dtype = DTYPES[parts.pop()]
    kinds = WEIGHT_KINDS if role == "weight" else ACTIVATION_KINDS
    if not parts or parts[0] not in kinds:   # none left: the text was a scale dtype alone ('bf16')
        raise SpecError(f"{role}={text!r}: kind {(parts or [''])[0]!r} is not a {role} encoding; use one of {kinds} "
                        "(e.g. 'k-group:4:128', 'per-channel:8', 'per-token:8')")
    want = 3 if parts[0] == "k-group" else 2
    if len(parts) != want:
        form = "k-group:bits:group_size" if want == 3 else f"{parts[0]}:bits"
        raise SpecError(f"{role}={text!r} must look like '{form}', optionally followed by ':fp16', ':bf16' or ':fp32'")
    try:
        nums = [int(p) for p in parts[1:]]
    except ValueError:
        raise SpecError(f"{role}={text!r}: bits and group_size must be integers") from None
    return GemmEncoding(parts[0], nums[0], nums[1] if want == 3 else None, dtype)


@dataclass(frozen=True)
class GemmSpec:
    """``y = x @ w.T`` with ``x [m, k]``, ``w [n, k]``, ``y [m, n]``.

    Args:
        n: output channels (rows of w).
        k: input channels (the reduced axis).
        weight: encoding of w (k-group or per-channel), or None for a plain weight.
        activation: encoding of x (per-token), or None for plain fp16/bf16 activations.
        m: rows of x (tokens), or None when it varies per call (symbolic); it sets the
            break-even of eq. 16 through min(m, ROWS_PER_TILE).
    """

    n: int
    k: int
    weight: GemmEncoding | None = None
    activation: GemmEncoding | None = None
    m: int | None = None

    def __post_init__(self) -> None:
        for field in ("n", "k") + (("m",) if self.m is not None else ()):
            object.__setattr__(self, field, _size(field, getattr(self, field)))
        for role, kinds in (("weight", WEIGHT_KINDS), ("activation", ACTIVATION_KINDS)):
            enc = getattr(self, role)
            if enc is None:
                continue
            if not isinstance(enc, GemmEncoding):
                raise SpecError(f"{role}={enc!r} must be a GemmEncoding (see parse_gemm_encoding) or None")
            if enc.kind not in kinds:
                raise SpecError(f"{role}={enc.short()!r}: kind {enc.kind!r} does not apply to the {role}; "
                                f"use one of {kinds}")
            per_byte = 8 // enc.bits
            if self.k % per_byte:
                raise SpecError(f"k={self.k} is not a multiple of {per_byte}, the {enc.bits}-bit codes per byte "
                                f"of the {role}; pad k")
            if enc.group_size is not None:
                if self.k % enc.group_size:
                    raise SpecError(f"group_size={enc.group_size} does not divide k={self.k}; "
                                    f"pick a divisor of {self.k}")
                if (self.k // per_byte) % enc.group_size and enc.group_size % (self.k // per_byte):
                    raise SpecError(f"group_size={enc.group_size} and k={self.k}: each bit field of a packed byte "
                                    f"covers {self.k // per_byte} channels, so a group must divide it or be a "
                                    "multiple of it")
        if self.weight is None and self.activation is None:
            raise SpecError("weight=None and activation=None: nothing is encoded, so there is nothing to fold; "
                            "give weight='k-group:4:128' or similar")
        if self.activation is not None and (self.weight is None or self.weight.kind != "per-channel"):
            raise SpecError(f"activation={self.activation.short()!r} needs weight='per-channel:8' (or other bits): "
                            "with both operands encoded their groups must both span k (eq. 15); got "
                            f"weight={self.weight.short() if self.weight else None!r}")

    @property
    def rows_per_tile(self) -> int:
        """Activation rows sharing one weight tile (h of eq. 16)."""
        return ROWS_PER_TILE if self.m is None else min(self.m, ROWS_PER_TILE)

    def weight_affine(self) -> Affine | None:
        return None if self.weight is None else self.weight.affine(self.k)

    def activation_affine(self) -> Affine | None:
        return None if self.activation is None else self.activation.affine(self.k)

    def describe(self) -> str:
        enc = lambda e: "plain" if e is None else e.short()  # noqa: E731
        m = "m" if self.m is None else str(self.m)
        return f"gemm {m}x{self.n}x{self.k}, weight {enc(self.weight)}, activation {enc(self.activation)}"


def _size(field: str, val) -> int:
    """``val`` as the positive int it must be (a NumPy or 0-dim torch integer is one), refused by name otherwise."""
    symbolic = " or None (symbolic)" if field == "m" else ""
    try:
        size = None if isinstance(val, bool) else operator.index(val)   # (a float, or a bool, is refused)
    except TypeError:
        size = None
    if size is None or size < 1:
        raise SpecError(f"{field}={val!r} must be a positive integer{symbolic}")
    if size > MAX_SIZE:
        fix = "call with fewer rows at a time" if field == "m" else \
            f"split the layer into parts of fewer {_SIZE_NAMES[field]}"
        raise SpecError(f"{field}={size} {_SIZE_NAMES[field]} is past {MAX_SIZE} (2**31 - 1, foldc.gemm.spec."
                        f"MAX_SIZE): the kernels number them with 32-bit integers, which would wrap; {fix}")
    return size


def gemm_spec_from_table(table: dict, where: str = "[gemm]") -> GemmSpec:
    """Build a GemmSpec from a TOML ``[gemm]`` table (see foldc.spec.spec_from_toml)."""
    unknown = set(table) - {"m", "n", "k", "weight", "activation"}
    if unknown:
        raise SpecError(f"{where}: unknown keys {sorted(unknown)}; expected m, n, k, weight, activation")
    for key in ("n", "k"):
        if key not in table:
            raise SpecError(f"{where}: missing key {key!r}; give the output channels n and the reduced size k")
    for key in ("weight", "activation"):
        if table.get(key) == "":   # a template's unset value, not a plain operand
            raise SpecError(f"{where}: {key}='' is empty: give an encoding such as "
                            f"{'k-group:4:128' if key == 'weight' else 'per-token:8'}, 'none' for a plain operand, "
                            "or leave the key out")
    m = table.get("m")
    if m in ("symbolic", "any"):
        m = None
    try:
        return GemmSpec(table["n"], table["k"], weight=parse_gemm_encoding(table.get("weight"), "weight"),
                        activation=parse_gemm_encoding(table.get("activation"), "activation"), m=m)
    except SpecError as e:   # a value's own message, with the file it came from
        raise SpecError(f"{where}: {e}") from None
