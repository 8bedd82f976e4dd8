"""The register-operand GEMV kernel (gemv.py) as a callable ``y = gemv(x, w)`` for sm_90 and sm_100.

``GluonGemv(spec, target)`` lowers the spec's plan at each call's activation dtype and row count
(gemv_lower.py: bf16 activations plan the weight with the code bias of `weight_code_bias`) and
launches a program of one warp (or `warps`) per (block of output channels, split of k). ``lowers(m)`` says
whether it takes a call with m rows; the GEMM callable of `foldc.compile` (foldc/gemm/compile.py) sends the others to
the generated Triton kernel. Calls are CUDA-graph capturable: the split-k workspace and the block
counters are allocated once per device and row count, and the kernel leaves the counters at zero.
Two streams must not run one GluonGemv at the same time (they would share the counters).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...encoding import AffineTensor
from ...errors import InputError, InputTypeError, SpecError
from ...gemm.plan import GemmPlan, gemm_plan
from ...gemm.spec import GemmSpec, gemm_text
from ...validate import check_no_overlap, check_out
from ..runtime.fast_launch import Bindings, FastLaunch, keywords
from ..runtime.launch import stream_handle
from ..runtime.modules import num_sms
from ..runtime.offsets import check_offsets, last_offset
from .gemv_lower import OPERAND_KS, GemvKernel, NotLowerable, lower_gemv, weight_code_bias
from .operands import VALUE_EXPONENT, biased_key_unpack_asm, key_unpack_asm, natural_key_unpack_asm

DTYPES = (torch.float16, torch.bfloat16)
ACTIVATION = {torch.float16: "fp16", torch.bfloat16: "bf16"}
BLOCK_ROWS = (16, 32, 64)      # output channels per warp of a program (row tiles of 16 channels: 1, 2 or 4)
WARPS = (1, 2, 4)              # warps per program, each on its own 16 channels of a row tile
STAGES = 3                     # pipeline stages in flight per program (cp.async), each `default_sub` chunks
WARPS_PER_SM = 16              # the split-k heuristic's least: this many warps per SM
CHUNKS_PER_PROGRAM = 12        # ... and its aim for each program's length
WIDE_PROGRAMS_PER_SM = 3.5     # ... for warps of two row tiles at 9-16 rows (`default_block_rows`): this many
WIDE_CHUNKS_PER_PROGRAM = 16   # programs per SM at the least, and about this many chunks each
MAX_SPLIT = 64
SUBS = (1, 2, 4, 8)
#: code widths whose unpack keeps the channel order (operands.natural_key_unpack_asm: two PRMTs that write the
#: zero bytes too, no AND, for 8-bit codes); the others unpack with one SHR and the activation is permuted to
#: match (tile_operands.swap_k01, PRMTs that also build the MMA's register pairs)
NATURAL_ORDER_BITS = (8,)
SCALE_KINDS = {"fp16": 0, "bf16": 1, "fp32": 2}   # the kernel's KIND: how it reads a scale word


# The activation's row goes through shared memory at m = 1 (the kernel's X_SHARED) for 2- and 4-bit codes: on the
# H200 at 4096 x 14336, INT4 g128 13.8 against 14.9 µs with the row in registers, but INT8 24.9 against 22.5
# (benchmarks/gemv_ab.py --variant '{"X_SHARED": false}', docs/results/gemv_ab_h200_2026-12-04.json). At m > 8 every
# row of the activation's chunk does for 4-bit codes (X_SHARED 2): on the H100 at m = 16, 28672 x 8192 86.5 against
# 102.6 µs in registers, 4096 x 14336 26.8 against 31.2; at 2 bits it was slower (112.3 against 100.4 at 28672 x
# 8192), and 8 bits were not measured (docs/results/gemv_xrows_ab_h100_2026-12-05.json, docs/gemm.md).

def activation_copies(m: int, bits: int) -> int:
    """The kernel's X_SHARED for m activation rows and ``bits``-bit codes: 1 the one row in shared memory, 2 every
    row of a chunk there, 0 the chunk in registers."""
    if bits >= 8:
        return 0
    return 1 if m == 1 else 2 if m > 8 and bits == 4 else 0


@dataclass(frozen=True)
class GemvLaunch:
    """One call's launch: rows m, the grid (channel blocks, splits) and the kernel's constants."""

    kernel: GemvKernel
    m: int
    grid: tuple[int, int]
    chunks_per_split: int
    constants: tuple
    x_shared: int = 0   # the kernel copies the activation's row (1) or rows (2) into shared memory (16-byte cp.async)


PARAM_RUN_BYTES = 256          # shared memory per output channel for a program's scale and zero words (`param_words`)


def param_words(kernel: GemvKernel, per: int) -> int:
    """32-bit words per bit field, row and parameter that a program of ``per`` chunks copies (the kernel's
    GW): the words holding every group its k range of each field meets, from the word that holds the
    first (a 16-bit parameter's first group may be the word's upper half)."""
    groups = 1 if kernel.group >= kernel.k else -(-per * kernel.chunk_bytes // kernel.group) + 1
    return groups if kernel.scale_dtype == "fp32" else (groups + 2) // 2


def max_chunks(kernel: GemvKernel) -> int:
    """Most chunks a program may take so that its parameter words fit PARAM_RUN_BYTES per output channel."""
    per = kernel.chunks
    while per > 1 and kernel.fields * param_words(kernel, per) * 8 > PARAM_RUN_BYTES:
        per -= 1
    return per


def default_sub(kernel: GemvKernel) -> int:
    """Chunks per pipeline stage: one. Four (each weight row read 512 contiguous bytes at a time) was
    1.3x slower on the H200 at 4096 x 14336 (the stages' shared memory costs resident programs;
    docs/gemm.md)."""
    return 1


def default_block_rows(kernel: GemvKernel, rows: int) -> int:
    """Output channels per warp of a launch that asks for none: 16 (one row tile), or 32 (two row tiles sharing
    each chunk's activation operand and its sums) at 9-16 rows of 4-bit codes. There, with 256-channel chunks
    (gemv_lower.OPERAND_K_WIDE) and `default_split`'s programs, 28672 x 8192 took 80.4 -> 64.7 µs, 4096 x 14336
    24.1 -> 18.0, 14336 x 4096 23.0 -> 20.0 on an H100 at m = 16 (docs/gemm.md): 169 SASS per KB of codes against
    301, at 224 registers. Two-bit codes were slower in two tiles (87.5 -> 92.9 µs at 28672 x 8192)."""
    return 32 if rows > 8 and kernel.bits == 4 else 16


def default_split(kernel: GemvKernel, n: int, block_rows: int, sms: int, sub: int = 1, warps: int = 1,
                  m: int = 1) -> int:
    """Splits of k per block of ``block_rows`` channels (programs of ``warps`` warps): programs of about
    CHUNKS_PER_PROGRAM chunks, and at least WARPS_PER_SM warps per SM, each program with at least two
    pipeline stages of ``sub`` chunks, for m activation rows. On the H200 (INT4 g128, m = 1, one-warp programs, docs/gemm.md): 7
    chunks a program (16 per SM) beat 12 (8 per SM) at 4096 x 14336, 15.9 against 17.8 µs; 11 beat 2 and 30
    at 28672 x 8192. Warps of two row tiles or more at 9-16 rows take about 224 registers (9 one-warp programs an
    SM): programs of about WIDE_CHUNKS_PER_PROGRAM chunks, at least WIDE_PROGRAMS_PER_SM an SM. On an H100 at m = 16
    that picks the fastest split timed at each of three shapes: 4096 x 14336 18.0 µs at 4 splits (26.2 at 2, 21.3-21.5
    at 6 and 8, 29.0 at 14), 14336 x 4096 20.0 at 2 (20.7-25.5 at 4-8), 28672 x 8192 64.7 at 2 (66.8-74.9 at 3-8)."""
    blocks = -(-n // block_rows)
    if m > 8 and block_rows // warps >= 32:
        want = max(-(-kernel.chunks // WIDE_CHUNKS_PER_PROGRAM), -(-int(WIDE_PROGRAMS_PER_SM * sms) // blocks))
    else:
        want = max(-(-kernel.chunks // CHUNKS_PER_PROGRAM), -(-WARPS_PER_SM * sms // (blocks * warps)))
    return max(1, min(want, kernel.chunks // (2 * sub), MAX_SPLIT))


class GluonGemv:
    """``y = gemv(x, w)`` for x [m, k] fp16/bf16 (m <= 16) and w an AffineTensor [1, 1, n, k].
    Options: block_rows (output channels per warp: 16, 32 or 64), warps (per program, 1, 2 or 4: a program
    takes warps x block_rows channels, its warps sharing the activation's chunk in shared memory at m = 1, the
    pipeline's barriers and the split-k counter), split_k (None: `default_split`), stages (cp.async depth,
    2-8), sub (chunks per stage), maxnreg (a register cap per thread, 32-255: fewer registers let more
    programs reside per SM, at the risk of spills; None: the compiler's choice), chunk_k (channels of k per
    chunk, one of OPERAND_KS: a chunk's MMA operand; None: `lower_gemv`'s default for the row count)."""

    def __init__(self, spec: GemmSpec, target: str, block_rows: int | None = None, split_k: int | None = None,
                 stages: int | None = None, sub: int | None = None, maxnreg: int | None = None,
                 warps: int | None = None, chunk_k: int | None = None):
        if target not in ("sm_90", "sm_100"):
            raise SpecError(f"target={target!r}: the register-operand GEMV runs on sm_90 and sm_100")
        if block_rows is not None and block_rows not in BLOCK_ROWS:
            raise SpecError(f"block_rows={block_rows!r} must be one of {BLOCK_ROWS}")
        if warps is not None and (isinstance(warps, bool) or warps not in WARPS):
            raise SpecError(f"warps={warps!r} (warps per program) must be one of {WARPS}")
        if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int)
                                    or not 1 <= split_k <= MAX_SPLIT):
            raise SpecError(f"split_k={split_k!r} must be an integer from 1 to {MAX_SPLIT}")
        if stages is not None and stages not in range(2, 9):
            raise SpecError(f"stages={stages!r} must be 2 to 8")
        if sub is not None and sub not in SUBS:
            raise SpecError(f"sub={sub!r} (chunks per pipeline stage) must be one of {SUBS}")
        if maxnreg is not None and (isinstance(maxnreg, bool) or not isinstance(maxnreg, int)
                                    or not 32 <= maxnreg <= 255):
            raise SpecError(f"maxnreg={maxnreg!r} must be an integer from 32 to 255 or None")
        if chunk_k is not None and (isinstance(chunk_k, bool) or chunk_k not in OPERAND_KS):
            raise SpecError(f"chunk_k={chunk_k!r} (channels of k per chunk) must be one of {OPERAND_KS}")
        self.spec, self.target, self.sub, self.maxnreg, self.chunk_k = spec, target, sub, maxnreg, chunk_k
        self.block_rows, self.split_k, self.stages = block_rows, split_k, stages or STAGES   # None: per launch
        self.warps = warps or 1
        self._plans: dict[tuple, GemmPlan] = {}
        self._lowers: dict[tuple, tuple[bool, str]] = {}
        self._launches: dict[tuple, GemvLaunch] = {}
        self._buffers: dict[tuple, tuple] = {}
        self._bindings = Bindings()   # run_rows' bound launches
        self._kernel = None

    def plan_for(self, dtype: torch.dtype, m: int) -> GemmPlan:
        """The plan the kernel runs for m rows of ``dtype`` activations (the break-even of eq. 16 depends on m;
        the weight's code bias on the dtype, `weight_code_bias`)."""
        key = (dtype, m)
        if key not in self._plans:
            if dtype not in ACTIVATION:
                raise InputError(f"activation dtype={dtype} must be torch.float16 or torch.bfloat16")
            enc = self.spec.weight
            bias = weight_code_bias(enc.bits, enc.group_size or self.spec.k, ACTIVATION[dtype])
            self._plans[key] = gemm_plan(GemmSpec(self.spec.n, self.spec.k, enc, None, m=m),
                                         code_bias={"weight": bias} if bias else None)
        return self._plans[key]

    def lowers(self, dtype: torch.dtype, m: int) -> tuple[bool, str]:
        """(True, "") when a call with m rows of ``dtype`` lowers, else (False, why); memoised (every call asks)."""
        key = (dtype, m)
        if key not in self._lowers:
            if dtype not in ACTIVATION:
                return False, f"activation dtype={dtype}: the GEMV takes torch.float16 and torch.bfloat16"
            try:
                lower_gemv(self.plan_for(dtype, m), m, ACTIVATION[dtype], self.chunk_k)
                self._lowers[key] = (True, "")
            except NotLowerable as e:
                self._lowers[key] = (False, str(e))
        return self._lowers[key]

    def plan_launch(self, dtype: torch.dtype, m: int, sms: int) -> GemvLaunch:
        """The launch of a call with ``m`` rows of ``dtype`` on a GPU of ``sms`` SMs (memoised)."""
        key = (dtype, m, sms)
        launch = self._launches.get(key)
        if launch is None:
            kernel = lower_gemv(self.plan_for(dtype, m), m, ACTIVATION[dtype], self.chunk_k)
            sub = self.sub or default_sub(kernel)
            rows = (self.block_rows or default_block_rows(kernel, m)) * self.warps   # output channels per program
            split = self.split_k or default_split(kernel, self.spec.n, rows, sms, sub, self.warps, m)
            most = max_chunks(kernel)                             # a program's parameter words fit
            split = max(split, -(-kernel.chunks // most))
            per = -(-kernel.chunks // min(split, kernel.chunks))  # the chunks spread evenly
            per = min(-(-per // sub) * sub, kernel.chunks, most)  # whole stages per program where it can
            split = -(-kernel.chunks // per)
            swap = kernel.bits not in NATURAL_ORDER_BITS   # (biased codes: 2 and 4 bits, in key_unpack_asm's order)
            if kernel.code_bias:
                asm, cons = biased_key_unpack_asm(kernel.bits)
            else:
                asm, cons = (key_unpack_asm if swap else natural_key_unpack_asm)(kernel.bits)
            constants = dict(BN=rows, W=kernel.chunk_bytes // 4, F=kernel.fields, NG=kernel.pieces,
                             ROWS=8 if m <= 8 else 16, ROW_BYTES=kernel.row_bytes, G=kernel.group, BITS=kernel.bits,
                             STAGES=self.stages, SPLIT=split, ASM=asm, CONS=cons, VALUE_EXP=VALUE_EXPONENT,
                             KIND=SCALE_KINDS[kernel.scale_dtype], SUB=sub, GW=param_words(kernel, per),
                             X_SHARED=activation_copies(m, kernel.bits), SWAP=swap, XF16=dtype == torch.float16,
                             BIAS=kernel.code_bias, num_warps=self.warps)
            if self.maxnreg is not None:
                constants["maxnreg"] = self.maxnreg
            launch = GemvLaunch(kernel, m, (-(-self.spec.n // rows), split), per,
                                tuple(constants.items()), constants["X_SHARED"])
            self._launches[key] = launch
        return launch

    def buffers(self, launch: GemvLaunch, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The split-k workspace [split, m, n] and the block counters (zero; the kernel leaves them so), one set
        per CUDA stream: calls on one stream run in order and may share them, calls on two may run at once."""
        split = launch.grid[1]
        key = (str(device), launch.m, launch.grid, stream_handle(device))
        if key not in self._buffers:
            part = torch.empty(split * launch.m * self.spec.n if split > 1 else 1, device=device, dtype=torch.float32)
            counters = torch.zeros(launch.grid[0], device=device, dtype=torch.int32)
            self._buffers[key] = (part, counters)
        return self._buffers[key]

    def takes(self, x, w) -> bool:
        """Whether a call with these tensors runs here (else the caller's other kernel takes it): a
        2-D fp16/bf16 x on a GPU and a weight whose code rows are 16-byte aligned, at a row count
        whose plan lowers."""
        if isinstance(x, AffineTensor) or not isinstance(x, torch.Tensor) or x.dim() != 2 or \
                not isinstance(w, AffineTensor) or w.codes.dim() != 4:
            return False
        return x.dtype in DTYPES and x.is_cuda and _aligned(w.codes[0, 0]) and _params_aligned(w) and \
            self.lowers(x.dtype, x.shape[0])[0]

    def bind(self, m: int, dtype: torch.dtype, device, w) -> tuple[GemvLaunch, tuple] | None:
        """(launch, the weight's 2-D rows) for calls of ``m`` rows of ``dtype`` on ``device`` with weight ``w``,
        where `takes` would take them; else None. A caller holding one weight makes this once and then
        launches ``run_rows(launch, x, *rows, out, counters)``, checking only x."""
        if getattr(device, "type", None) != "cuda" or dtype not in DTYPES or not self.lowers(dtype, m)[0] \
                or not isinstance(w, AffineTensor) or w.codes.device != device:
            return None
        rows = self.weight_rows(w)
        return None if rows is None else (self.launch_for(dtype, m, device), rows)

    def weight_rows(self, w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The 2-D parts `run_rows` takes of weight ``w`` (an AffineTensor [1, 1, n, k] of the spec's encoding,
        checked as a call checks it), or None where the kernel cannot read them as they are (the checked
        call then says why)."""
        try:
            self._check_weight(w)
        except (InputError, InputTypeError):
            return None
        return w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]

    def launch_for(self, dtype: torch.dtype, m: int, device) -> GemvLaunch:
        """`plan_launch` for a call with ``m`` rows of ``dtype`` on ``device``."""
        return self.plan_launch(dtype, m, num_sms(device))

    def check(self, x, w) -> int:
        spec = self.spec
        if isinstance(x, AffineTensor) or not isinstance(x, torch.Tensor):
            raise InputTypeError(f"x must be a plain fp16/bf16 [m, k] tensor; got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != spec.k:
            raise InputError(f"x has shape {tuple(x.shape)}; the spec needs [m, k={spec.k}]")
        if x.dtype not in DTYPES:
            raise InputError(f"x dtype={x.dtype} must be torch.float16 or torch.bfloat16")
        if x.device.type != "cuda":
            raise InputError(f"target={self.target!r} runs on a CUDA GPU; x is on {x.device}")
        if x.stride(1) != 1:
            raise InputError(f"x must have unit stride along k; got strides {x.stride()}")
        self._check_weight(w)
        if w.codes.device != x.device:
            raise InputError(f"w is on {w.codes.device} and x on {x.device}; put them on one device")
        return x.shape[0]

    def _check_weight(self, w) -> None:
        spec = self.spec
        if not isinstance(w, AffineTensor):
            raise InputTypeError(f"w must be an AffineTensor (foldc.gemm.quantize_2d); got {type(w).__name__}")
        want = spec.weight.affine(spec.k)
        if w.encoding != want or tuple(w.shape) != (1, 1, spec.n, spec.k):
            raise InputError(f"w has encoding {gemm_text(w.encoding, w.head_dim, 'weight')} and shape "
                             f"{tuple(w.shape)}; the spec needs {spec.weight.short()} with shape (1, 1, {spec.n}, "
                             f"{spec.k})")
        codes, scale, zero = w.codes[0, 0], w.scale[0, 0], w.zero[0, 0]
        if not _aligned(codes):
            raise InputError(f"w.codes must be rows with unit stride, each row 16-byte aligned (strides "
                             f"{codes.stride()}); pass w with contiguous codes (quantize_2d gives them)")
        if scale.stride() != zero.stride() or scale.stride(1) != 1:
            raise InputError(f"w.scale strides {scale.stride()} and w.zero strides {zero.stride()} must match, "
                             "with unit stride along the groups")
        if not _params_aligned(w):
            raise InputError(f"w.scale and w.zero start {scale.data_ptr() % 4} and {zero.data_ptr() % 4} bytes past a "
                             "4-byte boundary (a view from an odd row or group?): the kernel reads 16-bit scales and "
                             "zeros as 32-bit words; pass w with copies, w.scale.clone() and w.zero.clone()")

    def __call__(self, x, w, out: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
        """``y = x @ w.T`` into ``out`` (or a new tensor). ``counters``: the split-k block counters from the
        caller (int32 zeros on x's device, at least ``ceil(n / 16)`` of them, left at zero by the kernel),
        for callers whose memory must not be held here: then the split-k workspace is allocated per call
        too, and this object keeps no buffer (`foldc.nn.FoldLinear` passes its own, so that
        CUDA-graph trees under torch.compile see every allocation of a step)."""
        m = self.check(x, w)
        ok, why = self.lowers(x.dtype, m)
        if not ok:
            raise InputError(f"m={m}: the register-operand GEMV does not take this call ({why})")
        if counters is not None:
            need = -(-self.spec.n // min(BLOCK_ROWS))
            if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or \
                    counters.device != x.device or counters.dim() != 1 or counters.numel() < need or \
                    counters.stride(0) != 1:
                got = (f"{counters.dtype} {tuple(counters.shape)} on {counters.device}"
                       if isinstance(counters, torch.Tensor) else type(counters).__name__)
                raise InputError(f"counters: {got}; pass torch.zeros({need}, dtype=torch.int32, device=x.device) "
                                 "(one per block of 16 output channels; the kernel leaves them at zero)")
        if out is None:
            out = torch.empty(m, self.spec.n, device=x.device, dtype=x.dtype)
        else:
            check_out(out, (m, self.spec.n), x.device, (x.dtype,))
            check_no_overlap(out, "out", x=x, w=w)
        self.run(self.plan_launch(x.dtype, m, num_sms(x.device)), x, w, out, counters)
        return out

    def run(self, launch: GemvLaunch, x, w, out: torch.Tensor, counters: torch.Tensor | None = None) -> None:
        """Launch ``launch`` into ``out`` [m, n], no checks; ``counters`` as in `__call__` (None: this
        object's own, with its cached workspace)."""
        self.run_rows(launch, x, w.codes[0, 0], w.scale[0, 0], w.zero[0, 0], out, counters)

    def run_rows(self, launch: GemvLaunch, x, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 out: torch.Tensor, counters: torch.Tensor | None = None, workspace: torch.Tensor | None = None):
        """`run` with the weight as its 2-D parts (codes [n, row bytes] uint8, scale and zero [n, groups]),
        which a caller holding one weight makes once (`foldc.nn.FoldLinear`'s eager calls); no checks. Returns
        the bound launch that ran it (given x's, the parts', out's, the workspace's and the counters' addresses),
        None where the launch was keyed. ``counters`` (int32 zeros, a block's at least) and ``workspace`` (float32,
        split x m x n at least) are the caller's, or this stream's own (`buffers`) where counters is None; a
        workspace not given with the counters is made for the call."""
        if self._kernel is None:
            from .gemv import foldc_gemv_gluon

            self._kernel = FastLaunch(foldc_gemv_gluon)
        # the activation's 16-byte copies need aligned rows (a slice at an odd offset, a row stride not a multiple
        # of 16 elements): a copy of x, not a failed build
        if launch.x_shared and (x.data_ptr() % 16 or (launch.x_shared == 2 and x.stride(0) % 16)):
            x = x.clone()
        if counters is None:
            part, counters = self.buffers(launch, x.device)
        elif workspace is not None:
            part = workspace
        else:
            split = launch.grid[1]
            part = torch.empty(split * launch.m * self.spec.n if split > 1 else 1, device=x.device,
                               dtype=torch.float32)
        # a launch seen before with these strides and dtypes: the compiled kernel with the tensors' addresses alone
        key = (id(launch), x.dtype, x.stride(0), codes.stride(0), scale.dtype, scale.stride(0), out.dtype,
               out.stride(0))
        state = self._bindings.get(key, launch)
        if type(state) is tuple and state and state[0]((x.data_ptr(), codes.data_ptr(), scale.data_ptr(),
                                                        zero.data_ptr(), out.data_ptr(), part.data_ptr(),
                                                        counters.data_ptr())):
            return state[0]
        # the kernel's chunk loop keeps 32-bit offsets (64-bit row bases would cost instructions there): refused
        # past them, as every later call of this key (the same strides and shapes) would be
        check_offsets("register-operand GEMV", {"x": last_offset(x), "w.codes (32-bit words)": last_offset(
            codes.view(torch.int32)), "w.scale": last_offset(scale), "w.zero": last_offset(zero),
            "out": last_offset(out), "the split-k workspace": launch.grid[1] * launch.m * self.spec.n - 1},
            "split the weight's output channels (n) over several GEMVs, or call the Triton GEMM "
            "(foldc.compile(spec, target=..., kernel='triton')), whose row offsets are 64-bit")
        args = (x, codes.view(torch.int32), scale, zero, out, part, counters, launch.m, self.spec.n, x.stride(0),
                codes.stride(0) // 4, scale.stride(0), out.stride(0), launch.chunks_per_split)
        kwargs = keywords(launch)
        self._kernel[launch.grid](*args, **kwargs)
        self._bindings.note(key, launch, state, lambda: (self._kernel.bind(launch.grid, args, kwargs),))
        return None


def _aligned(codes: torch.Tensor) -> bool:
    """Code rows with unit stride, each 16-byte aligned (the kernel's 16-byte cp.async)."""
    return codes.stride(1) == 1 and codes.stride(0) % 16 == 0 and codes.data_ptr() % 16 == 0


def _params_aligned(w: AffineTensor) -> bool:
    """Scales and zeros whose first element starts a 32-bit word: the kernel copies 16-bit ones as words counted
    from there (`gemv._copy_runs`), which a view starting at an odd element would misalign."""
    return w.scale.element_size() == 4 or (w.scale.data_ptr() % 4 == 0 and w.zero.data_ptr() % 4 == 0)


def gemv_bytes(spec: GemmSpec) -> int:
    """Bytes the kernel must read for one call: codes plus one scale and one zero per group."""
    enc = spec.weight
    groups = spec.k // (enc.group_size or spec.k)
    size = torch.empty(0, dtype=enc.scale_dtype).element_size()
    return spec.n * spec.k * enc.bits // 8 + 2 * spec.n * groups * size


__all__ = ["GluonGemv", "GemvLaunch", "default_split", "gemv_bytes"]
