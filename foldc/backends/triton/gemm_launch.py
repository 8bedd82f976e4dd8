"""Load and launch the generated GEMM kernel: the callable of ``foldc.compile(GemmSpec, target)``
for the Triton targets ("sm_90", "sm_100", "interpret", "auto").

``gemm(x, w)`` takes x ``[m, k]`` (fp16 or bf16; an AffineTensor [1, 1, m, k] for an encoded
activation) and w (an AffineTensor [1, 1, n, k] from `foldc.gemm.quantize_2d`) and returns
y ``[m, n]`` in x's dtype (``out_dtype``, fp16 by default, when x is encoded).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ...encoding import AffineTensor
from ...errors import InputError, SpecError
from ...gemm.plan import GemmPlan, gemm_plan
from ...gemm.reference import check_operand, check_rebuilt, operand_device
from ...gemm.spec import GemmSpec
from ...options import check_gemm_options
from ...proof import prove
from ...validate import check_no_overlap, check_out, without_backward
from .gemm_codegen import GemmKernelSource, generate_gemm
from .gemm_dequant import SOURCE as DEQUANT_SOURCE
from .gemm_dequant import (DequantTile, NotDequantTemplate, check_tensor_memory, dequant_config, lower_dequant,
                           tensor_memory, unpack_asm)
from ..runtime.fast_launch import FastLaunch
from ..runtime.launch import STREAM_CAPTURING
from ..runtime.modules import device_arch, interpreter, load_module, num_sms

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
INT8_CODE_BIAS = -128  # unsigned 8-bit codes become int8 for the integer tensor cores (eq. 7)


def gemm_kernel_plan(spec: GemmSpec, fold_policy: str = "auto") -> GemmPlan:
    """The plan the backend lowers: with two 8-bit operands, codes carry the bias -128 (folded into
    the zeros, eq. 7) so the codes product runs as int8 x int8 -> int32. ``fold_policy="dequant"``
    reconstructs every weight value in the kernel instead (the comparison point for the fold)."""
    both8 = spec.activation is not None and spec.activation.bits == 8 and spec.weight.bits == 8
    bias = {"weight": INT8_CODE_BIAS, "activation": INT8_CODE_BIAS} if both8 and fold_policy == "auto" else None
    return gemm_plan(spec, code_bias=bias, fold_policy=fold_policy)


def gemm_kernel_source(spec: GemmSpec, dtype: str = "fp16",
                       fold_policy: str = "auto") -> tuple[GemmKernelSource, GemmPlan]:
    the_plan = gemm_kernel_plan(spec, fold_policy)
    return generate_gemm(the_plan, dtype), the_plan


def k_chunk(spec: GemmSpec, group: int, cap: int = 64) -> int:
    """Largest chunk of k (<= cap) inside one k group and one bit field of every packed operand."""
    bk = math.gcd(cap, group)
    for enc in (spec.weight, spec.activation):
        if enc is not None:
            bk = math.gcd(bk, spec.k // (8 // enc.bits))
    return bk


def launch_config(m: int, n: int) -> dict:
    """Tile sizes for a call with m rows: decode GEMVs take small row tiles and more column tiles.
    ``block_k`` is an upper bound (the chunk must also fit a group and a bit field)."""
    if m <= 16:
        return {"block_m": 16, "block_n": 32 if n >= 4096 else 16, "block_k": 64, "split_k": 1, "num_warps": 4,
                "num_stages": 4}
    if m <= 64:
        return {"block_m": 32 if m <= 32 else 64, "block_n": 64, "block_k": 64, "split_k": 1, "num_warps": 4,
                "num_stages": 3}
    return {"block_m": 64, "block_n": 128, "block_k": 64, "split_k": 1, "num_warps": 8, "num_stages": 3}


def runtime_arguments(x, w, y) -> dict:
    args = {"Y": y, "stride_y": y.stride(0), "M": y.shape[0]}
    for name, t in (("x", x), ("w", w)):
        up = name.upper()
        if isinstance(t, AffineTensor):
            codes, scale, zero = t.codes[0, 0], t.scale[0, 0], t.zero[0, 0]
            args.update({f"{up}_CODES": codes, f"{up}_SCALE": scale, f"{up}_ZERO": zero,
                         f"stride_{name}": codes.stride(0), f"stride_{name}s": scale.stride(0)})
        else:
            args.update({up: t, f"stride_{name}": t.stride(0)})
    return args


def check_kernel_layout(name: str, t: AffineTensor) -> None:
    """The layout both Triton kernels read an encoded operand in: code rows with unit stride along the
    bytes, scales and zeros with the same strides and unit stride along the groups (one row stride
    serves both). Anything else would read the wrong values, so it is refused with the fix."""
    codes, scale, zero = t.codes[0, 0], t.scale[0, 0], t.zero[0, 0]
    fix = (f"pass contiguous tensors: AffineTensor({name}.codes.contiguous(), {name}.scale.contiguous(), "
           f"{name}.zero.contiguous(), {name}.encoding, {name}.head_dim)")
    if codes.shape[1] > 1 and codes.stride(1) != 1:
        raise InputError(f"{name}.codes has strides {tuple(t.codes.stride())}: the kernel reads each row's code bytes "
                         f"with unit stride; {fix}")
    rows, groups = scale.shape
    if (rows > 1 and zero.stride(0) != scale.stride(0)) or (groups > 1 and (scale.stride(1), zero.stride(1)) != (1, 1)):
        raise InputError(f"{name}.scale has strides {tuple(t.scale.stride())} and {name}.zero "
                         f"{tuple(t.zero.stride())}: the kernel reads both with one row stride and unit stride "
                         f"along the groups; {fix}")


INT32_MAX = 2**31 - 1


def check_tile_span(launch: "GemmLaunch", x, w, out: torch.Tensor) -> None:
    """Both kernels move each pointer to its tile's first row in int64 and address the tile's rows from
    there in int32 (``row x stride``, `generate_gemm`): refuse a tile whose rows span more than 2**31 - 1
    elements (a row stride of about 2**31 / block elements; Triton passes a stride of 2**31 or more as
    int64, so only a smaller one can wrap)."""
    blocks = dict(launch.constants)
    rows = {"x": blocks["BLOCK_M"], "w": blocks["BLOCK_N"], "out": blocks["BLOCK_M"]}
    for name, t in (("x", x), ("w", w), ("out", out)):
        parts = (t.codes[0, 0], t.scale[0, 0]) if isinstance(t, AffineTensor) else (t,)
        for part in parts:
            stride, row = part.stride(0), part.shape[1]
            span = (rows[name] - 1) * stride + row
            if stride <= INT32_MAX and span > INT32_MAX:
                raise InputError(f"{name} has row stride {stride}: a tile of {rows[name]} rows spans {span} elements, "
                                 f"past the kernel's 32-bit tile offsets (limit {INT32_MAX}); pass a tile of fewer "
                                 f"rows (block_m / block_n) or rows of fewer than {INT32_MAX // rows[name]} elements")


#: the most (c - 128) x (d - 128) products of two 8-bit operands' biased codes (eq. 7; each up to 128 * 128) one
#: program sums in its int32 accumulator without wrapping
INT8_PRODUCTS_MAX = INT32_MAX // (128 * 128)


def check_int8_sum(int8_dot: bool, k: int, block_k: int, split_k: int) -> None:
    """Refuse a generated kernel whose int8 x int8 contraction (two 8-bit operands) would sum more biased code
    products than its int32 accumulator holds: each program takes every ``split_k``-th chunk of ``block_k`` channels
    of k, and past `INT8_PRODUCTS_MAX` products (k = 131072 in one program) the sum wrapped and the output was
    silently wrong (codes mostly at the bottom of their range, as a ReLU's zeros against a pruned weight, get
    there)."""
    chunks = -(-k // block_k)
    if not int8_dot or -(-chunks // split_k) * block_k <= INT8_PRODUCTS_MAX:
        return
    fits = next((s for s in range(split_k + 1, 65) if -(-chunks // s) * block_k <= INT8_PRODUCTS_MAX), None)
    fix = (f"compile with split_k={fits} (foldc.compile(spec, target, split_k={fits})), whose programs sum a part "
           "of k each, or " if fits is not None else "compile with ")
    raise SpecError(f"k={k} with 8-bit weight and activation codes: a program of split_k={split_k} sums "
                    f"{-(-chunks // split_k) * block_k} int8 x int8 code products (each up to 128 * 128) in an int32 "
                    f"accumulator, which wraps past {INT8_PRODUCTS_MAX}; {fix}fold_policy='dequant' (both operands' "
                    "values rebuilt in float: no int8 products)")


@dataclass(frozen=True)
class GemmLaunch:
    """What one GEMM call launches: output dtype, ``m`` x ``n``, the grid (row tiles, column tiles,
    split-k) and the kernel's compile-time constants as (name, value) pairs."""

    dtype: torch.dtype
    m: int
    n: int
    grid: tuple
    split_k: int
    constants: tuple
    template: str = "generated"   # or "dequant": the dequantize-then-dot template (gemm_dequant.py)
    arch: str = "sm_90"           # the device's architecture the tiles were planned for
    rebuilds: tuple = ()          # the operands ("w", "x") whose values its plan rebuilds in ``dtype`` (fold dequant)


class TritonGemm:
    """The generated GEMM kernel as a callable ``y = gemm(x, w)``. Options: block_m, block_n,
    block_k (an upper bound), split_k (programs sharing the k axis of one output tile, adding
    float32 partials atomically), num_warps, num_stages (defaults from `launch_config` by m),
    out_dtype (encoded x only), fold_policy ("auto", or "dequant" to reconstruct every weight value in the kernel)."""

    def __init__(self, spec: GemmSpec, target: str, block_m: int | None = None, block_n: int | None = None,
                 block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, out_dtype: torch.dtype = torch.float16, fold_policy: str = "auto"):
        self.spec, self.target, self.fold_policy = spec, target, fold_policy
        gemm_plan(spec, fold_policy=fold_policy)  # raise now on a bad policy
        self.interpret = target == "interpret"
        options = (("block_m", block_m), ("block_n", block_n), ("block_k", block_k), ("split_k", split_k),
                   ("num_warps", num_warps), ("num_stages", num_stages))
        self.explicit = check_gemm_options(**dict(options))
        if out_dtype not in DTYPES:
            raise SpecError(f"out_dtype={out_dtype} must be torch.float16 or torch.bfloat16")
        self.out_dtype = out_dtype
        self._kernels: dict[str, tuple] = {}
        self._launches: dict[tuple, GemmLaunch] = {}   # plan_launch()'s memo
        self._dequant: dict = {}   # id(dequant launch) -> (launch, its constexpr dict)
        self._dequant_kernel = None   # the template behind FastLaunch, loaded at the first launch
        self._fits: set = set()       # ids of launches run once (an sm_100 build checked against tensor memory)
        self._rebuilt: dict = {}      # operands checked by `_check_rebuilt`: their tensors and versions

    def kernel(self, dtype: str):
        if dtype not in self._kernels:
            ks, the_plan = gemm_kernel_source(self.spec, dtype, self.fold_policy)
            self._kernels[dtype] = (load_module(ks.source, self.interpret), ks, the_plan)
        return self._kernels[dtype]

    def source(self, dtype: torch.dtype = torch.float16) -> str:
        return self.kernel(DTYPES[dtype])[1].source

    def plan_for(self, dtype: torch.dtype = torch.float16, m: int | None = None) -> GemmPlan:
        """The plan a call runs: at ``m`` rows the large-m template's where it takes the call (its
        plan at m rows), else the generated kernel's."""
        if m is not None and self.dequant_tile(dtype, m) is not None:
            return self._launches[("plan", dtype, m)]
        return self.kernel(DTYPES[dtype])[2]

    def __call__(self, x, w, out: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.spec
        m = check_operand("x", x, spec.activation, spec.m, spec.k)
        n = check_operand("w", w, spec.weight, spec.n, spec.k)
        if n != spec.n or (spec.m is not None and m != spec.m):
            raise InputError(f"x has {m} rows and w {n}; the spec says m={spec.m}, n={spec.n}")
        for name, t in (("x", x), ("w", w)):
            if isinstance(t, AffineTensor):
                check_kernel_layout(name, t)
        device = operand_device(x, w)
        if self.interpret and device.type != "cpu":
            raise InputError(f"target='interpret' runs on the CPU; x is on {device}")
        if not self.interpret and device.type != "cuda":
            raise InputError(f"target={self.target!r} runs on a CUDA GPU; x is on {device}")
        if isinstance(x, AffineTensor):
            dtype = self.out_dtype
        else:
            dtype = x.dtype
            allowed = (torch.float16,) if self.interpret else (torch.float16, torch.bfloat16)
            if dtype not in allowed:
                raise InputError(f"x dtype={dtype} must be one of {allowed} for target={self.target!r}")
            if x.stride(1) != 1:
                raise InputError(f"x must have unit stride along k; got strides {x.stride()}")
        if self.interpret and dtype != torch.float16:
            raise InputError("target='interpret' runs fp16 only (Triton's interpreter mishandles bf16)")
        if out is None:
            out = torch.empty(m, n, device=device, dtype=dtype)
        else:
            check_out(out, (m, n), device, (dtype,))
            check_no_overlap(out, "out", x=x, w=w)
        if m == 0:   # no rows: nothing to compute (as the reference returns [0, n])
            return out
        launch = self.plan_launch(dtype, m, num_sms(device), device_arch(device))
        check_tile_span(launch, x, w, out)
        for name in launch.rebuilds:
            self._check_rebuilt(name, x if name == "x" else w, dtype)
        self.run(launch, x, w, out)
        return without_backward(out, x, "the compiled GEMM (foldc.compile of a GemmSpec)")

    def _check_rebuilt(self, name: str, t: AffineTensor, dtype: torch.dtype) -> None:
        """Refuse an operand that a plan rebuilding its values in ``dtype`` would make inf (`check_rebuilt`). Once
        per operand (a weight is a model's constant): its codes, scale and zero tensors and their version counters
        (an in-place change bumps them) are kept, and a later call with the very same tensors is not read again. Not
        during a CUDA-graph capture (the check reads the device); a weight's first call is a warm-up's."""
        parts = (t.codes, t.scale, t.zero)
        key = (name, dtype, *map(id, parts))
        seen = self._rebuilt.get(key)
        versions = tuple(map(_version, parts))
        if seen is not None and all(ref() is p for ref, p in zip(seen[0], parts)) and seen[1] == versions:
            return
        if t.codes.is_cuda and STREAM_CAPTURING():
            return
        if dtype == torch.float16:
            fix = ("pass bfloat16 activations (x.bfloat16(), on a GPU target; the interpreter runs float16 only)"
                   if name == "w" else "pass out_dtype=torch.bfloat16 (on a GPU target)")
            fix += f", or quantize {name} with smaller scales and zeros (values within +-65504)"
        else:
            fix = f"quantize {name} with smaller scales and zeros"
        check_rebuilt(name, t, dtype, fix)
        if len(self._rebuilt) >= 256:   # many weights through one kernel: keep the memo bounded
            self._rebuilt.clear()
        self._rebuilt[key] = (tuple(weakref.ref(p) for p in parts), versions)

    def dequant_tile(self, dtype: torch.dtype, m: int) -> DequantTile | None:
        """The template's tile when a call with ``m`` rows of plain ``dtype`` activations runs it: the
        plan at m rows reconstructs the weight (eq. 16, or fold_policy="dequant") and no split-k or
        k chunk was asked for. That plan is proved (foldc.proof) before the template first runs it;
        memoised."""
        key = ("tile", dtype, m)
        if key not in self._launches:
            tile = None
            if self.spec.activation is None and not {"split_k", "block_k"} & set(self.explicit):
                plan = gemm_plan(GemmSpec(self.spec.n, self.spec.k, self.spec.weight, None, m=m),
                                 fold_policy=self.fold_policy)
                try:
                    tile = lower_dequant(plan, m)
                except NotDequantTemplate:
                    tile = None
                else:
                    prove(plan)
                    self._launches[("plan", dtype, m)] = plan
            self._launches[key] = tile
        return self._launches[key]

    def _dequant_launch(self, tile: DequantTile, dtype: torch.dtype, m: int, sms: int, arch: str) -> GemmLaunch:
        cfg = dequant_config(tile, m, self.spec.n, sms, arch=arch,
                             **{k: v for k, v in self.explicit.items()
                                if k in ("block_m", "block_n", "num_warps", "num_stages")})
        scale16 = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(tile.scale_dtype)
        math = 0 if scale16 != dtype else (1 if dtype == torch.float16 else (2 if tile.bits <= 4 else 0))
        if self.interpret and math == 1:   # the interpreter's tl.fma rounds the product and the sum apart (numpy):
            math = 0                       # float32, then one rounding, is its twin of the GPU's fused fp16 FMA
        asm, cons = ("", "") if self.interpret else unpack_asm(tile.bits, math == 2)
        constants = dict(K=tile.k, BITS=tile.bits, GROUP=tile.group, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                         BLOCK_K=tile.block_k, GROUP_M=cfg["group_m"], MATH=math, ASM=asm, CONS=cons,
                         SPLIT_K=cfg["split_k"], num_warps=cfg["num_warps"],
                         num_stages=cfg["num_stages"])
        grid = (triton_cdiv(m, cfg["block_m"]) * triton_cdiv(self.spec.n, cfg["block_n"]), cfg["split_k"])
        return GemmLaunch(dtype, m, self.spec.n, grid, cfg["split_k"], tuple(constants.items()), "dequant", arch,
                          ("w",))

    def plan_launch(self, dtype: torch.dtype, m: int, sms: int = 132, arch: str = "sm_90") -> GemmLaunch:
        """The `GemmLaunch` of a call with ``m`` rows of x and a ``dtype`` output, memoised: the
        dequantize-then-dot template where the plan at m rows reconstructs the weight, else the
        generated kernel with the tiles of `launch_config` (or the options given), the grid and the
        k chunk. ``sms``: the GPU's SM count, ``arch`` its architecture (the template's tile choice: sm_100's
        tensor memory bounds its tiles)."""
        key = (dtype, m, sms, arch)
        launch = self._launches.get(key)
        if launch is None:
            tile = self.dequant_tile(dtype, m)
            if tile is not None:
                launch = self._launches[key] = self._dequant_launch(tile, dtype, m, sms, arch)
        if launch is None:
            _, ks, the_plan = self.kernel(DTYPES[dtype])
            cfg = dict(launch_config(m, self.spec.n), **self.explicit)
            n, split = self.spec.n, cfg["split_k"]
            constants = dict(N=n, K=self.spec.k, GROUP=ks.group, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                             BLOCK_K=k_chunk(self.spec, ks.group, cfg["block_k"]), SPLIT_K=split,
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            check_int8_sum(ks.int8_dot, self.spec.k, constants["BLOCK_K"], split)
            launch = GemmLaunch(dtype, m, n, (triton_cdiv(m, cfg["block_m"]), triton_cdiv(n, cfg["block_n"]), split),
                                split, tuple(constants.items()), arch=arch,
                                rebuilds=tuple(op for op, f in the_plan.folds.items() if f == "dequant"))
            self._launches[key] = launch
        return launch

    def run(self, launch: GemmLaunch, x, w, out: torch.Tensor, partial: torch.Tensor | None = None) -> None:
        """Launch ``launch`` (from `plan_launch`) into ``out [m, n]``, no checks. With split-k, the
        programs add float32 partials into ``partial`` (zeroed here; allocated if None), then copied."""
        target = out
        if launch.split_k > 1:
            target = partial.zero_() if partial is not None else torch.zeros(launch.m, launch.n, device=out.device,
                                                                             dtype=torch.float32)
        with interpreter(self.interpret):
            if id(launch) not in self._fits:   # once per launch: sm_100 builds checked before they run
                self._check_tensor_memory(launch, x, w, target)
            if launch.template == "dequant":
                self._launch_dequant(launch, x, w, target)
            else:
                module, ks, _ = self.kernel(DTYPES[launch.dtype])
                runtime = runtime_arguments(x, w, target)
                module.foldc_gemm[launch.grid](*[runtime[a] for a in ks.args], **dict(launch.constants))
        if launch.split_k > 1:
            out.copy_(target)

    def _check_tensor_memory(self, launch: GemmLaunch, x, w, target: torch.Tensor) -> None:
        """On an architecture with tensor memory (sm_100), compile ``launch``'s kernel for these arguments (no
        launch) and refuse it where its tiles need more than a program has (`check_tensor_memory`)."""
        if tensor_memory(launch.arch):
            if launch.template == "dequant":
                kernel = load_module(DEQUANT_SOURCE, self.interpret).foldc_gemm_dequant
                args = (x, x.stride(0), w.codes, w.codes.stride(2), w.scale, w.zero, w.scale.stride(2), target,
                        target.stride(0), launch.m, launch.n)
            else:
                module, ks, _ = self.kernel(DTYPES[launch.dtype])
                runtime = runtime_arguments(x, w, target)
                kernel, args = module.foldc_gemm, tuple(runtime[a] for a in ks.args)
            compiled = kernel.warmup(*args, grid=launch.grid, **dict(launch.constants))
            check_tensor_memory(compiled, launch.arch, {k: v for k, v in launch.constants
                                                        if k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages")})
        self._fits.add(id(launch))

    def _launch_dequant(self, launch: GemmLaunch, x, w, target: torch.Tensor) -> None:
        # one FastLaunch of the template; one constexpr dict per launch (FastLaunch reads a dict once),
        # found by the launch's identity (plan_launch memoises launches; hashing one walks its constants)
        if self._dequant_kernel is None:
            self._dequant_kernel = FastLaunch(load_module(DEQUANT_SOURCE, self.interpret).foldc_gemm_dequant)
        entry = self._dequant.get(id(launch))
        if entry is None or entry[0] is not launch:
            entry = self._dequant[id(launch)] = (launch, dict(launch.constants))
        # the [1, 1, n, .] tensors themselves: their first row is where the [0, 0] views start
        codes, scale = w.codes, w.scale
        self._dequant_kernel[launch.grid](x, x.stride(0), codes, codes.stride(2), scale, w.zero, scale.stride(2),
                                          target, target.stride(0), launch.m, launch.n, **entry[1])


def _version(t: torch.Tensor):
    """``t``'s version counter (bumped by each in-place change), or None for an inference tensor (none kept)."""
    try:
        return t._version
    except RuntimeError:
        return None


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
