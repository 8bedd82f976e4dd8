"""Read a GEMM plan and decide whether the register-operand GEMV kernel (gemv.py) lowers it.

The kernel takes the weight's operand plan as it is: an acc-fold (eq. 3: each k group's partial sum
times the group's scale, plus zero x the group's sum of x, eq. 6) with code bias 0 (the codes enter
the MMA as fp16 subnormals, operands.py) or, for bf16 activations and 2- or 4-bit codes, the bias of 128
that `weight_code_bias` gives where the precision budget allows it (the codes enter a bf16 MMA as
``128 + code * 2^shift``, eq. 7), 2, 4 or 8 bits, k groups or one group per output channel,
fp16 / bf16 / fp32 scales, plain fp16 or bf16 activations and at most MAX_ROWS of them. A dequant
verdict (eq. 16: groups of at most twice the rows, for small groups and m near 16) or an encoded
activation is not its job: `NotLowerable` says why, and the generated Triton kernel runs the call.

Tiling, as numbers: a chunk is ``chunk_bytes`` bytes of every weight row of a block (D = chunk_bytes
x fields channels of k, OPERAND_K of them by default, one MMA operand); it is cut into ``pieces`` equal ranges of its
k index, each inside one bit field and one k group, so that no partial sum crosses a group.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...gemm.plan import GemmPlan, check_gemm_plan
from ...precision import code_bias_allowed
from .lower import NotLowerable
from .operands import BF16_CODE_BIAS

MAX_ROWS = 16               # activation rows on the MMA's N axis (8 or 16)
OPERAND_KS = (128, 256, 512)   # the channels of k per chunk a launch may ask for (`lower_gemv`'s operand_k)
# By default a chunk is 128 bytes of each weight row for 2- and 4-bit codes at m = 1 and 64 past 8 rows (512 and 256
# channels of k for 2 bits, 256 and 128 for 4), 256 channels at m = 2..8 (there the activation's chunk waits in
# registers, and 512 channels took 2-bit codes from 129 to 204 registers, AOT sm_90; 4-bit codes at m = 4 were 18%
# slower in them on an H100); 8-bit codes 256 and 128 channels. On an H100 (fp16 x, docs/gemm.md) 2-bit codes in
# 512-channel chunks took 5-14% off 256 at m = 1 at four shapes and were level at 4096 x 14336 (28672 x 8192 43.6 ->
# 37.4 µs: 29% fewer instructions per weight), at m = 16 in 256-channel ones 12-14% off 128; 4-bit codes in 512
# were up to 25% slower at 4096 x 14336 (half the chunks per program). At 9 to 16 rows 4-bit codes take 256 channels
# beside two row tiles a warp (gemv_launch.default_block_rows): 13-27% off 128 channels and one tile there.
OPERAND_K = {2: 512, 4: 256, 8: 256}         # channels of k per chunk by code width, one activation row
OPERAND_K_NARROW = {2: 256, 4: 256, 8: 256}  # ... 2 to 8 rows
OPERAND_K_WIDE = {2: 256, 4: 256, 8: 128}    # ... 9 to 16 rows (their [k, 16] operand takes twice the registers)


def default_operand_k(bits: int, rows: int) -> int:
    """Channels of k per chunk of a launch that asks for none: OPERAND_K, OPERAND_K_NARROW or OPERAND_K_WIDE."""
    return (OPERAND_K if rows == 1 else OPERAND_K_NARROW if rows <= 8 else OPERAND_K_WIDE)[bits]


MAX_PIECES = 8              # MMA chains per chunk (tile_operands.split_groups)
MIN_PIECE = 32              # k per MMA chain (16: the operand split fails to lower)
MIN_CHUNK_WORDS = 8         # the key operand's layout reads 8 words a row and more (tile_operands.key_words_layout)
SCALE_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}
ACTIVATION_DTYPES = ("fp16", "bf16")
BIASED_BITS = (2, 4)        # codes that fit a bf16's mantissa beside the bias (operands.biased_key_unpack_asm)


def weight_code_bias(bits: int, group: int, activation: str) -> int:
    """The weight's code bias the kernel's operand for ``activation`` ("fp16"/"bf16") activations carries:
    BF16_CODE_BIAS for bf16 and 2- or 4-bit codes where its accumulator error stays within the budget
    (precision.code_bias_allowed, eq. 6a: not 2-bit codes in one group of more than about 10K channels),
    else 0. The plan is made with it (eq. 7), proved, and the kernel reads it back from there."""
    if activation not in ACTIVATION_DTYPES:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATION_DTYPES}")
    if activation == "bf16" and bits in BIASED_BITS and code_bias_allowed("bf16", bits, group, BF16_CODE_BIAS):
        return BF16_CODE_BIAS
    return 0


@dataclass(frozen=True)
class GemvKernel:
    """What the GEMV kernel is specialised on, all read from the plan."""

    bits: int            # code width of the weight
    k: int               # reduced axis
    group: int           # k per scale group (k itself: one group per output channel)
    chunk_bytes: int     # bytes of each weight row per chunk
    pieces: int          # MMA chains per chunk (each inside one field and one group)
    scale_dtype: str
    fields: int          # codes per byte (the plan's packing)
    row_bytes: int       # bytes of a packed weight row
    code_bias: int = 0   # the plan's weight code bias: 0 (fp16 subnormal codes) or 128 (biased bf16 codes)

    @property
    def chunks(self) -> int:
        return self.row_bytes // self.chunk_bytes

    @property
    def piece_k(self) -> int:
        return self.chunk_bytes * self.fields // self.pieces

    def piece_group(self, chunk: int, piece: int) -> int:
        """The k group of piece ``piece`` of chunk ``chunk`` (the kernel's _piece_params)."""
        per_field = self.pieces // self.fields
        field, within = divmod(piece, per_field)
        return (field * self.row_bytes + chunk * self.chunk_bytes + within * self.piece_k) // self.group


def lower_gemv(plan: GemmPlan, rows: int, activation: str = "fp16", operand_k: int | None = None) -> GemvKernel:
    """The kernel's parameters for ``plan`` at ``rows`` activation rows of ``activation`` ("fp16"/"bf16"),
    or NotLowerable. ``operand_k``: channels of k per chunk, one of OPERAND_KS (None: `default_operand_k`); a
    chunk is halved where the row or the groups ask for it."""
    if operand_k is not None and operand_k not in OPERAND_KS:
        raise ValueError(f"operand_k={operand_k!r} is not one of {OPERAND_KS}")
    check_gemm_plan(plan)   # a decision that is not the proved graph's never reaches a kernel
    spec = plan.spec
    if spec.activation is not None:
        raise NotLowerable(f"activation={spec.activation.short()}: encoded activations run the Triton kernel")
    w = plan.operands.get("w")
    if w is None:
        raise NotLowerable("the weight is plain: nothing to unpack")
    if not 1 <= rows <= MAX_ROWS:
        raise NotLowerable(f"m={rows} rows: the GEMV kernel takes 1 to {MAX_ROWS}")
    if w.fold != "acc-fold":
        raise NotLowerable(f"the plan's weight fold is {w.fold} ({w.break_even or w.reason}); the GEMV kernel "
                           "lowers acc-fold")
    group = w.group_size or spec.k
    want = weight_code_bias(w.bits, group, activation)
    if w.code_bias != want:
        raise NotLowerable(f"weight code bias {w.code_bias}: the kernel's operand for {activation} activations and "
                           f"{w.bits}-bit codes in groups of {group} carries {want} (gemv_lower.weight_code_bias)")
    enc = spec.weight
    if str(enc.scale_dtype) not in SCALE_DTYPES:
        raise NotLowerable(f"scale dtype {enc.scale_dtype}: the kernel reads fp16, bf16 or fp32 scales")
    fields, row_bytes = w.fields, w.row_bytes
    chunk = (operand_k or default_operand_k(w.bits, rows)) // fields
    while chunk >= 4 * MIN_CHUNK_WORDS and row_bytes % chunk:
        chunk //= 2
    if chunk < 4 * MIN_CHUNK_WORDS or row_bytes % chunk:
        raise NotLowerable(f"k={spec.k}: {row_bytes} bytes per weight row is not a multiple of "
                           f"{4 * MIN_CHUNK_WORDS}")
    # a piece is a field's whole chunk, or one group of it when the group is shorter; a chunk holding
    # more groups than MAX_PIECES chains is halved
    while True:
        per_field = max(1, chunk // group) if group < row_bytes else 1
        pieces = fields * per_field
        if pieces <= MAX_PIECES or chunk <= 4 * MIN_CHUNK_WORDS:
            break
        chunk //= 2
    if group < row_bytes and (chunk % group and group % chunk):
        raise NotLowerable(f"group_size={group} and a {chunk}-byte chunk: neither divides the other")
    if pieces > MAX_PIECES or chunk * fields // pieces < MIN_PIECE:
        raise NotLowerable(f"group_size={group}: {pieces} groups per {chunk * fields}-channel chunk, more than "
                           f"{MAX_PIECES} MMA chains or pieces under {MIN_PIECE} channels")
    return GemvKernel(w.bits, spec.k, group, chunk, pieces, SCALE_DTYPES[str(enc.scale_dtype)], fields, row_bytes,
                      w.code_bias)


def lowerable_gemv(plan: GemmPlan, rows: int, activation: str = "fp16", operand_k: int | None = None
                   ) -> tuple[bool, str]:
    try:
        lower_gemv(plan, rows, activation, operand_k)
    except NotLowerable as e:
        return False, str(e)
    return True, ""
