"""The dequantize-then-dot GEMM template: ``y = x @ w.T`` for the calls whose GEMM plan reconstructs
the weight (eq. 16: at m rows each weight tile is shared by more rows than the fold pays for), with
plain fp16 or bf16 activations.

Each program computes one ``BLOCK_M x BLOCK_N`` tile of y in one flat loop over chunks of
``BLOCK_K`` bytes of every weight row. A chunk holds ``F = 8 / bits`` bit fields, field ``f``
covering the k range ``f * K/F + j .. + BLOCK_K`` (the planar packing of foldc/encoding.py) inside
one k group (``BLOCK_K`` divides the group). Per field the codes become values in registers,

    v = scale[n, g] * code + zero[n, g]      (eq. 1, rounded once to the activation dtype)

and ``tl.dot`` takes them into the tensor cores (wgmma on sm_90) with the activation's matching k
range. The code enters floating point exactly through its bit pattern: ``code | 0x6400`` is the
fp16 ``1024 + code``, minus 1024. With fp16 scales and fp16 activations the value is one fp16
fused multiply-add (one rounding of the exact ``s * c + z``); otherwise it is formed in float32 and
rounded to the activation dtype, as the plan executor's dequantized values are.

The program computes y's tile transposed, ``w_tile @ x_tile.T``: the weight values are the dot's
A operand, which wgmma reads from registers, so they never pass through shared memory (docs/gemm.md
has the measurements against the other order). With ``SPLIT_K`` > 1 the programs of axis 1 each take
one part of every weight row's bytes and add float32 partials into Y atomically (the caller zeroes
Y and converts).

Rows and columns past m and n read the last row or column (in bounds) and are never stored, so the
loop has no masks. Programs walk the tiles in groups of ``GROUP_M`` row tiles per column tile, so
the row tiles that share a weight tile run together and read it from L2.

Which plans it takes and its tiles: `lower_dequant` (the plan's weight operand: fold ``dequant``,
bits, k group, scale dtype) and `dequant_config`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import SpecError
from ...gemm.plan import GemmPlan, check_gemm_plan

SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def _biased(wb, f: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, VT: tl.constexpr):
    """Field f of the code bytes wb as values MAGIC + code (exact) without inline PTX."""
    code = ((wb.to(tl.int16) >> (BITS * f)) & ((1 << BITS) - 1)) | MAGIC
    return code.to(VT, bitcast=True)


@triton.jit
def _unpack(wb, ASM: tl.constexpr, CONS: tl.constexpr, F: tl.constexpr, MATH: tl.constexpr):
    """Every field of the code bytes wb as values MAGIC + code (inline PTX, `unpack_asm`)."""
    if MATH == 2:
        if F == 1:
            out = (tl.inline_asm_elementwise(ASM, CONS, [wb], dtype=tl.bfloat16, is_pure=True, pack=4),)
        elif F == 2:
            out = tl.inline_asm_elementwise(ASM, CONS, [wb], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            out = tl.inline_asm_elementwise(ASM, CONS, [wb], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=4)
    else:
        if F == 1:
            out = (tl.inline_asm_elementwise(ASM, CONS, [wb], dtype=tl.float16, is_pure=True, pack=4),)
        elif F == 2:
            out = tl.inline_asm_elementwise(ASM, CONS, [wb], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            out = tl.inline_asm_elementwise(ASM, CONS, [wb], dtype=(tl.float16,) * 4, is_pure=True, pack=4)
    return out


@triton.jit
def foldc_gemm_dequant(X, stride_x, WC, stride_w, WS, WZ, stride_ws, Y, stride_y, M, N,
                       K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       MATH: tl.constexpr, ASM: tl.constexpr, CONS: tl.constexpr,
                       SPLIT_K: tl.constexpr):
    F: tl.constexpr = 8 // BITS
    ROW_BYTES: tl.constexpr = K // F
    # MATH 1: fp16 values, fp16 scales; 2: bf16 values and scales; 0: float32 arithmetic
    VT: tl.constexpr = tl.bfloat16 if MATH == 2 else tl.float16
    MAGIC: tl.constexpr = 0x4300 if MATH == 2 else 0x6400
    BIAS: tl.constexpr = 128.0 if MATH == 2 else 1024.0
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    # 64-bit addressing outside the loop: a row's offset (row x stride) can pass 2**31 - 1 (a weight over
    # 2 GiB, an output over 2**31 elements), so each pointer moves to the tile's first row in int64 and the
    # tile's offsets count from there in int32 (a tile spans less than 2**31 elements: the launcher checks)
    X += row0.to(tl.int64) * stride_x
    WC += col0.to(tl.int64) * stride_w
    WS += col0.to(tl.int64) * stride_ws
    WZ += col0.to(tl.int64) * stride_ws
    Y += row0.to(tl.int64) * stride_y
    kb = tl.arange(0, BLOCK_K)
    x_ptrs = X + (tl.minimum(rows, M - 1) - row0)[:, None] * stride_x + kb[None, :]
    cols_in = tl.minimum(cols, N - 1) - col0
    w_ptrs = WC + cols_in[:, None] * stride_w + kb[None, :]
    p_ptrs = cols_in * stride_ws
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)   # y's tile transposed: the weight is the A operand
    PART: tl.constexpr = ROW_BYTES // SPLIT_K
    j_first = tl.program_id(1) * PART
    for j0 in range(j_first, j_first + PART, BLOCK_K):
        wb = tl.load(w_ptrs + j0)
        if len(ASM) > 0:   # one PRMT per two bytes, one shift and LOP3 per field (operands.py's trick)
            fields = _unpack(wb, ASM, CONS, F, MATH)
        for f in tl.static_range(F):
            g = (f * ROW_BYTES + j0) // GROUP
            s = tl.load(WS + p_ptrs + g)
            z = tl.load(WZ + p_ptrs + g)
            if len(ASM) > 0:
                biased = fields[f]
            else:
                biased = _biased(wb, f, BITS, MAGIC, VT)
            c = biased - BIAS
            if MATH == 0:
                v = (c.to(tl.float32) * s.to(tl.float32)[:, None] + z.to(tl.float32)[:, None]).to(X.dtype.element_ty)
            else:
                v = tl.fma(c, s[:, None], z[:, None])
            xt = tl.load(x_ptrs + (f * ROW_BYTES + j0))
            acc = tl.dot(v, tl.trans(xt), acc)
    ok = (rows < M)[None, :] & (cols < N)[:, None]
    y_ptrs = Y + (rows - row0)[None, :] * stride_y + cols[:, None]
    if SPLIT_K > 1:
        tl.atomic_add(y_ptrs, acc, mask=ok, sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=ok)
'''

def unpack_asm(bits: int, bf16: bool) -> tuple[str, str]:
    """PTX and constraints for pack=4 over four code bytes (k, k+1, k+2, k+3): per bit field, two
    registers of 16-bit pairs ``MAGIC + code`` (fp16 1024 + code, or bf16 128 + code): a PRMT puts
    bytes (0, 1) and (2, 3) in the low bytes of the two halves, then a shift and one LOP3 per field."""
    fields = 8 // bits
    magic = "0x43004300" if bf16 else "0x64006400"
    mask = (1 << bits) - 1
    mask2 = f"0x{mask:04x}{mask:04x}"
    n = 2 * fields
    out = ["{ .reg .b32 a, b, t;", f"prmt.b32 a, ${n}, 0, 0x4140;", f"prmt.b32 b, ${n}, 0, 0x4342;"]
    for f in range(fields):
        for reg, src in ((2 * f, "a"), (2 * f + 1, "b")):
            if f:
                out.append(f"shr.b32 t, {src}, {bits * f};")
                src = "t"
            out.append(f"lop3.b32 ${reg}, {src}, {mask2}, {magic}, 0xea;")
    out.append("}")
    return " ".join(out), ",".join(["=r"] * n + ["r"])


MIN_ROWS = 17          # fewer rows: the register-operand GEMV or the generated kernel's small tiles
MAX_BLOCK_K = 64       # bytes of a weight row per chunk
CHUNK_K = 128          # channels of k per chunk, every field together (the activation tiles' shared memory)
SHARED_BYTES = 227 * 1024   # shared memory a program may take on the H200 and the B200
# On sm_100 (B200) Triton 3.6 keeps the template's accumulator and its weight operands in tensor memory, 512
# columns a program; past that it compiles the kernel to a bare `trap`. What a tile takes follows
# block_m * block_n * fields (its `tmem_size`, sm_100 builds of INT2/INT4 at block_m 64-256 and block_n 64-128:
# tests/backends/test_gemm_dequant.py): 512 columns at this product.
TMEM_TILE = 32768
TENSOR_MEMORY_COLUMNS = 512


def tensor_memory(arch: str) -> bool:
    """Whether ``arch`` (e.g. "sm_90", "sm_100") runs the template's dot from tensor memory (compute capability 10)."""
    return len(arch) == 6 and arch.startswith("sm_10")


def check_tensor_memory(compiled, arch: str, tiles: dict) -> None:
    """Refuse a kernel ``compiled`` for ``arch`` whose ``tiles`` need more tensor memory than a program has there
    (Triton 3.6 builds it as a bare trap, which would take the process's CUDA context down at launch)."""
    columns = getattr(getattr(compiled, "metadata", None), "tmem_size", 0) or 0
    if tensor_memory(arch) and columns > TENSOR_MEMORY_COLUMNS:
        shown = ", ".join(f"{k.lower()}={v}" for k, v in tiles.items())
        raise SpecError(f"the GEMM kernel's tiles ({shown}) need {columns} columns of tensor memory on {arch}, which "
                        f"has {TENSOR_MEMORY_COLUMNS} a program (Triton compiles it to a trap); pick a smaller "
                        "block_m or block_n")


class NotDequantTemplate(Exception):
    """The plan is not the template's (the reason is the message)."""


@dataclass(frozen=True)
class DequantTile:
    """What the template is specialised on, read from the plan's weight operand."""

    bits: int
    k: int
    group: int          # k per scale group (k: one group per output channel)
    scale_dtype: str    # "fp16", "bf16" or "fp32"
    fields: int         # codes per byte (the plan's packing)
    row_bytes: int      # bytes of a packed weight row

    @property
    def block_k(self) -> int:
        """Bytes per chunk: at most MAX_BLOCK_K and CHUNK_K channels of k (all fields), inside one group
        and one bit field."""
        bk = min(MAX_BLOCK_K, CHUNK_K // self.fields)
        while bk > 16 and (self.group % bk or self.row_bytes % bk):
            bk //= 2
        return bk


SCALE_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}


def lower_dequant(plan: GemmPlan, rows: int) -> DequantTile:
    """The template's parameters for ``plan`` at ``rows`` activation rows, or NotDequantTemplate."""
    check_gemm_plan(plan)   # a decision that is not the proved graph's never reaches a kernel
    spec = plan.spec
    if spec.activation is not None:
        raise NotDequantTemplate(f"activation={spec.activation.short()}: encoded activations run the generated kernel")
    w = plan.operands.get("w")
    if w is None:
        raise NotDequantTemplate("the weight is plain")
    if w.fold != "dequant":
        raise NotDequantTemplate(f"the plan folds the weight ({w.fold}); the template reconstructs it")
    if rows < MIN_ROWS:
        raise NotDequantTemplate(f"m={rows} rows: the template takes {MIN_ROWS} and more")
    if w.bits == 8:
        # on the H200, 8-bit weights with fp16 values in 128 x 128 tiles of 8 warps split 8 ways gave
        # errors up to 13x torch's that changed from run to run (benchmarks/gemm_dequant_repeat.py);
        # 2- and 4-bit weights stayed exact and deterministic in every tile and split there
        raise NotDequantTemplate("8-bit weights: the generated kernel takes them (an unexplained, run-to-run "
                                 "error in the template; docs/gemm.md)")
    if w.code_bias != 0:
        raise NotDequantTemplate(f"weight code bias {w.code_bias}: the template reads the codes as stored")
    scale = SCALE_DTYPES.get(str(spec.weight.scale_dtype))
    if scale is None:
        raise NotDequantTemplate(f"scale dtype {spec.weight.scale_dtype}")
    tile = DequantTile(w.bits, spec.k, w.group_size or spec.k, scale, w.fields, w.row_bytes)
    bk = tile.block_k
    if tile.group % bk or tile.row_bytes % bk or bk < 16:
        raise NotDequantTemplate(f"k={spec.k}, group {tile.group}: no chunk of 16 bytes or more lies inside one group "
                                 "and one bit field")
    return tile


def shared_bytes(tile: DequantTile, block_m: int, block_n: int, stages: int) -> int:
    """Shared memory of a program as Triton 3.6 lays it out for sm_90 (checked against its compiler
    in tests/backends/test_gemm_dequant.py): per pipeline stage the activation tiles of every field,
    and two buffers of code bytes (the codes go on to registers)."""
    bk = tile.block_k
    return stages * tile.fields * block_m * bk * 2 + 2 * block_n * bk


def dequant_config(tile: DequantTile, m: int, n: int, sms: int, block_m: int | None = None,
                   block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   split_k: int | None = None, arch: str = "sm_90") -> dict:
    """Tiles for a call with m rows and n output channels on a GPU of ``sms`` SMs (the ones given are
    kept): 128 weight rows on 8 warps against 64, 128 or 256 activation rows by m (docs/gemm.md,
    "The large-m template", has the sweep); on sm_100 at most what fits tensor memory (TMEM_TILE: 128
    rows for 4-bit weights, 64 for 2-bit). A grid that fills less than half the SMs splits every
    weight row's bytes into up to 8 parts (float32 partials added atomically) while each part keeps
    4 chunks or more. As many pipeline stages, up to 4, as fit SHARED_BYTES."""
    explicit_m = block_m
    block_n = block_n or 128
    block_m = block_m or (64 if m <= 64 else 128 if m <= 128 else 256)
    if tensor_memory(arch):
        if block_n > 128:
            raise SpecError(f"block_n={block_n} on {arch}: the template's tiles there take at most 128 weight rows "
                            "(tensor memory); pick block_n <= 128")
        fits = TMEM_TILE // (block_n * tile.fields)
        if block_m > fits:
            if explicit_m is not None:
                raise SpecError(f"block_m={block_m} with block_n={block_n} at {tile.bits}-bit weights does not fit "
                                f"{arch}'s tensor memory (block_m x block_n x {tile.fields} fields at most "
                                f"{TMEM_TILE}); pick block_m <= {fits}")
            block_m = fits
    num_warps = num_warps or (8 if block_n >= 128 else 4)
    if num_stages is None:
        num_stages = 4
        while num_stages > 2 and shared_bytes(tile, block_m, block_n, num_stages) > SHARED_BYTES:
            num_stages -= 1
    tiles = -(-m // block_m) * -(-n // block_n)
    if split_k is None:
        split_k = 1
        if 2 * tiles < sms:
            while (split_k < 8 and tiles * split_k * 2 <= 2 * sms
                   and tile.row_bytes % (split_k * 2 * tile.block_k) == 0
                   and tile.row_bytes // (split_k * 2) >= 4 * tile.block_k):
                split_k *= 2
    if split_k < 1 or tile.row_bytes % (split_k * tile.block_k):
        raise SpecError(f"split_k={split_k}: the {tile.row_bytes} code bytes of a weight row do not split into parts "
                        f"of whole {tile.block_k}-byte chunks")
    return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, "group_m": 8,
            "split_k": split_k}
