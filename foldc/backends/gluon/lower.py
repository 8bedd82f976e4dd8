"""Read a plan and decide whether the register-operand (Gluon) kernel can lower it.

The Gluon kernel feeds packed codes to the tensor cores from registers (kernel.py). Scores are
K'.Q'^T (tokens on the MMA's M axis), values V'^T.P'^T (channels on M, tokens on K). Each
product's fold decides where its scale goes, as the plan states:

- qk acc-fold (eq. 3), token-wise K: the token's scale multiplies its row of the scores, the zero
  times sum(q) is added (eq. 6). With several channel groups per token, each group's channels get
  their own MMA accumulator, scaled by that group's scale before the groups are summed (no unscaled
  partial sum crosses a group boundary);
- qk operand-fold (eq. 4), channel-wise K (groups of G tokens): the query is pre-scaled by the
  group's per-channel scales once per group, the correction sum(q x zero) added per row;
- pv operand-fold (eq. 4), token-wise V: P is multiplied by the token's scale before the product,
  sum(P x zero) added per row; with several channel groups per token, once per group, each group's
  output channels taking its own scaled P;
- pv acc-fold (eq. 3), channel-wise V: each tile's product (a tile lies in one group) is scaled
  per output channel and gets zero x sum(P) before it joins the accumulator.

The code bias is the plan's. `gluon_plan` gives both sides none: the codes enter the MMA as fp16
subnormals, code x 2^-24, exact with no per-value subtraction (operands.py). The value side must
(a folded 1024 bias there costs precision on real tensor cores, docs/derivation.md section 7);
on the key side it saves the per-score removal of ``1024 x sum(q')``. A plan with any other code
bias is refused (NotLowerable).

Token-wise groups smaller than head_dim lower when each group is whole bit fields of the planar
packing (group_size a multiple of head_dim x bits / 8 channels): a group is then a contiguous range
of the key operand's K index and of the value operand's M index (operands.py), and at most
MAX_GROUPS_PER_TOKEN of them.

A dequant product (the break-even of eq. 12 says a fold does not pay: groups of at most twice the
rows a program takes) gets the same tiles and groups; its codes are unpacked as exact fp16
integers (values) or fp16 subnormals (keys) and rebuilt per value as ``code x scale + zero`` (one
HFMA2 per two values), times a
power of two per token (token-wise) or per group (channel-wise) that keeps them in fp16's range,
undone on the scores or on P; the MMA then takes plain values and there is no correction.
Everything else (other groups, other widths) goes to the generated Triton kernel
(foldc/backends/triton), which lowers any plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...decisions import FoldKind, GroupAxis
from ...errors import PlanError
from ...plan import Plan, check_plan, plan
from ...passes import FoldCosts
from ...precision import OperandPrecision
from ...spec import AttentionSpec

KEY_BIAS = 0       # key codes enter as exact fp16 subnormals too (operands.py): no bias to fold
VALUE_BIAS = 0     # value codes enter as exact fp16 subnormals (operands.py): no bias to fold
MAX_ROWS = 16      # query rows one program's MMA N axis holds (8 or 16); more per KV head: row blocks
BITS = (2, 4, 8)   # code widths the unpack builds (operands.py), each side on its own
WORDS = (4, 8, 16, 32, 64)   # 32-bit code words per token the register layouts read (tile_operands.py)
NARROW_BITS = 2    # four words per token (head_dim 64): only 2-bit codes, four fields per byte (operands.key_k)
PLAIN_BITS = 16    # a plain side: bf16 values, read from shared memory as the MMA operand (kernel.py)
PLAIN_WORDS = (32, 64, 128)   # bf16 pairs per token of a plain side
MAX_GROUPS_PER_TOKEN = 8   # token-wise channel groups per token: one score accumulator and one P each
MAX_DEQUANT_GROUPS = 4     # a dequant plan's token-wise groups per token (tile_dequant.token_exponent)
MIN_GROUP = 32     # token-wise channels per group inside a bit field: 8 words, the value operand's lane rows
HALF_TILE_GROUP = 16   # channel-wise groups of 16 tokens: two per 32-token tile, token bit 4 a register bit of the
#                        key operand's M (one MMA per half) and of P (one value product per half, P zeroed past it)
PADDED_WIDTHS = (128, 256)   # register widths a head_dim between powers of two is padded to (96 -> 128, 160 -> 256)


class NotLowerable(Exception):
    """The plan is exact, but this backend has no lowering for it (the reason says why)."""


@dataclass(frozen=True)
class FoldKernel:
    """What the Gluon kernel is specialised on, all read from the plan."""

    key_bits: int        # code width of K (2, 4 or 8; PLAIN_BITS: plain bf16 keys)
    value_bits: int      # code width of V
    head_dim: int
    q_per_kv: int        # query rows of one KV head a program takes (all of them, or one row block's)
    rows: int            # q_per_kv padded to the MMA's N (8 or 16)
    key_tokens: int      # 0: token-wise K (acc-fold); G: channel-wise K in groups of G tokens
    value_tokens: int    # 0: token-wise V (operand-fold); G: channel-wise V in groups of G tokens
    key_groups: int = 1      # token-wise K: channel groups per token (head_dim // group_size)
    value_groups: int = 1    # token-wise V: channel groups per token
    key_precision: OperandPrecision | None = None     # the plan's operand precision (eq. 6a), None if
    value_precision: OperandPrecision | None = None   # the plan was made without a dtype
    row_blocks: int = 1  # programs per KV head, each taking q_per_kv of its query rows (> 1: more rows
    #                      per KV head than the MMA's N axis holds)
    head_rows: int = 0   # ragged row blocks: the KV head's query rows when they are not row_blocks x q_per_kv
    #                      (the last block takes the rest, its other rows padding); 0 when the blocks are equal
    padded_dim: int = 0  # head_dim rounded up to the register layouts' width (0: head_dim, a power of two):
    #                      each bit field of a token padded with zero codes and zero query channels
    key_dequant: bool = False    # the plan dequantizes K (eq. 12's verdict): each value rebuilt as
    value_dequant: bool = False  # code x scale + zero in fp16 before a plain MMA, no correction
    key_masked_groups: bool = False    # token-wise groups across a padded head_dim's bit fields: the operand
    value_masked_groups: bool = False  # in pieces, each piece's MMA once per group it meets (operands.piece_groups)

    @property
    def width(self) -> int:
        """Channels the registers hold per token: head_dim, or the power of two it is padded to."""
        return self.padded_dim or self.head_dim

    @property
    def key_tile_words(self) -> int:
        """32-bit words per token of a key tile in the registers (the padded width's)."""
        return self.width // 2 if self.key_plain else self.width * self.key_bits // 32

    @property
    def value_tile_words(self) -> int:
        return self.width // 2 if self.value_plain else self.width * self.value_bits // 32

    @property
    def key_plain(self) -> bool:
        """K is a plain bf16 operand (no encoding)."""
        return self.key_bits == PLAIN_BITS

    @property
    def value_plain(self) -> bool:
        return self.value_bits == PLAIN_BITS

    @property
    def key_words(self) -> int:
        """32-bit words of key codes per token."""
        return self.head_dim * self.key_bits // 32

    @property
    def value_words(self) -> int:
        return self.head_dim * self.value_bits // 32

    @property
    def narrow(self) -> bool:
        """A side of four words per token (head_dim 64 at 2 bits): its words read once per lane on the
        key side and twice on the value side (operands.key_k, value_row)."""
        return WORDS[0] in [w for w, plain in ((self.key_tile_words, self.key_plain),
                                               (self.value_tile_words, self.value_plain)) if not plain]

    @property
    def code_bytes_per_token(self) -> int:
        """Bytes of K and V codes per token and KV head."""
        return 4 * (self.key_words + self.value_words)


#: the query dtypes the kernel takes, and the bar each is held to (docs/derivation.md eq. 6a): its error
#: against plain fp16 attention reached 2.2-2.8x on the H200 on values with large zeros (INT2 g128,
#: benchmarks/precision_check.py), above a 2x bar in fp16, with hi + lo operands too; no data-free bound
#: covers that excess. So fp16 queries are held to plain bf16 attention's error, the bar bf16 queries
#: meet (its operands are fp16 in both cases); `kernel="triton"` keeps plain fp16 attention's bar.
QUERY_DTYPES = ("bf16", "fp16")
BAR_DTYPE = "bf16"
FP16_BAR_REASON = ("a plan for fp16 queries held to plain fp16 attention's error: the register-operand kernel's reached "
                   "2.2-2.8x that on the H200 (values with large zeros, docs/derivation.md eq. 6a); it holds fp16 "
                   "queries to plain bf16 attention's (plan it with gluon_plan), the Triton kernel to fp16's "
                   "(kernel='triton')")
#: the operand precisions the kernel implements (eq. 6a): its pre-scaled operands (P x scale for
#: token-wise V, q x scale for channel-wise K) rounded once to fp16
PRECISIONS = (OperandPrecision.PLAIN, OperandPrecision.SINGLE)


#: Where this kernel departs from eq. 12's count (eq. 12a). H100, 8 x 64K, each choice beside the other in one run
#: (`benchmarks/variants/fold_or_dequant.py`, docs/results/fold_or_dequant*_h100_2026-12-06.json): token-wise groups
#: of 32 at the tie (16 rows a program) folded 1.06-1.22x faster than reconstructed (INT2, INT4, INT8; 64/4, 64/2,
#: 32/2); channel-wise keys in groups of 32-128 reconstructed 1.01-1.26x faster than folded at 12 and 16 rows a
#: program, and 1.03-1.17x slower at 8 (one MMA n-tile of query rows: the fold's per-group query operand fits beside
#: the accumulators there). This rule against eq. 12 alone: 1.00-1.40x at 16 layouts of head_dim 64, 96 and 128
#: (docs/results/fold_tie_ab_h100_2026-12-06.json and fold_costs_ab_h100_2026-12-06.json; the latter's
#: token:4:32 / channel:2:32 row ran an earlier draft that kept the tie for token-wise groups only)
FOLD_COSTS = FoldCosts("the register-operand kernel", fold_at_tie=True, resident_rows=8)


def gluon_plan(spec: AttentionSpec, dtype: str = "bf16") -> Plan:
    """The plan the Gluon kernel runs for ``dtype`` queries: no code bias on either side (subnormal
    codes) and fp16 operands, so each product carries the operand precision the error model of
    eq. 6a picks against plain bf16 attention (`BAR_DTYPE`: one fp16 rounding up to groups of 128);
    with row blocks, the break-even of one block's rows."""
    if dtype not in QUERY_DTYPES:
        raise NotLowerable(f"dtype={dtype!r}: the register-operand kernel takes {QUERY_DTYPES} queries")
    # past the rows one program holds, each block of rows reads and rebuilds the codes itself: the
    # break-even weighs a fold against one block's rows (eq. 12)
    blocks, rows = row_blocks(spec.q_per_kv, max_rows(register_width(spec.head_dim)))
    try:
        return plan(spec, code_bias={"key": KEY_BIAS, "value": VALUE_BIAS}, dtype=dtype, operand_dtype="fp16",
                    rows_per_program=rows if blocks > 1 else None,
                    bar_dtype=BAR_DTYPE if dtype != BAR_DTYPE else None, fold_costs=FOLD_COSTS)
    except PlanError as e:   # no operand precision meets the bar (channel-wise groups of millions of tokens): the
        if e.rule != "precision":   # reference plan runs it, this kernel does not (lowerable's callers read why)
            raise
        raise NotLowerable(str(e)) from None


def lower(the_plan: Plan) -> FoldKernel:
    """The kernel configuration for ``the_plan``; raises NotLowerable with the reason otherwise.
    A plan made for a query dtype must ask for precisions the kernel implements (eq. 6a); one made
    without a dtype is lowered as one fp16 rounding."""
    check_plan(the_plan)   # a wrong plan (a key correction after the softmax, ...) never reaches code generation
    spec = the_plan.spec
    qk, pv = the_plan.products["qk"], the_plan.products["pv"]
    width = register_width(spec.head_dim)
    padded = width != spec.head_dim
    token_groups, channel_groups = {}, {}
    plain = {}
    dequant = {}
    masked = {"qk": False, "pv": False}
    for p, tokenwise_fold in ((qk, FoldKind.ACC_FOLD), (pv, FoldKind.OPERAND_FOLD)):
        plain[p.product] = p.fold is FoldKind.NONE
        dequant[p.product] = p.fold is FoldKind.DEQUANT
        if plain[p.product]:   # a plain (bf16) operand: read as it is, no fold
            token_groups[p.product], channel_groups[p.product] = 0, 1
            continue
        if not (p.fold.folded or dequant[p.product]):
            raise NotLowerable(f"{p.product} is {p.fold}; the register-operand kernel lowers folded and dequant "
                               "products and plain operands")
        if p.fold.folded and p.correction_missing:
            raise NotLowerable(f"{p.product}: the plan has no zero correction")
        if dequant[p.product] and p.code_bias:
            raise NotLowerable(f"{p.product}: a dequant plan with code bias {p.code_bias}; the kernel rebuilds "
                               "values from unbiased codes (plan it with gluon_plan)")
        if p.group_axis is GroupAxis.CHANNEL:   # token-wise encoding: groups run along head_dim
            if p.fold.folded and p.fold != tokenwise_fold:
                raise NotLowerable(f"{p.product}: token-wise groups folded as {p.fold}; the register-operand "
                                   f"kernel folds token-wise {p.product} as {tokenwise_fold}")
            field = p.tiling.channels_per_field   # channels per bit field of the planar packing
            groups = spec.head_dim // p.tiling.channel_group
            # a group is whole fields, or an aligned part of one of at least 32 channels: a contiguous
            # range of the key operand's K index, register bits of the value operand's M index
            fits = p.group_size % field == 0 or (field % p.group_size == 0 and p.group_size >= MIN_GROUP
                                                 and not padded)
            # a padded head_dim's bit fields hold fewer channels than the registers' (96 -> 24 of 32 at 2
            # bits): a group that is not whole fields is no range of K or M there; the operand is cut into
            # pieces of 32 k indices (keys) or rows (values), each piece's MMA taken once per group it meets,
            # with the other groups' query channels zero (keys) or its rows of other groups left out (values)
            across = not fits and padded and p.group_size >= MIN_GROUP
            masked[p.product] = across and not dequant[p.product]   # a dequant plan selects per value instead
            fits = fits or across
            if not fits or groups > MAX_GROUPS_PER_TOKEN:
                raise NotLowerable(f"{p.product}: token-wise groups of {p.group_size} channels; the register-operand "
                                   f"kernel needs groups of whole bit fields of {field} channels (head_dim x bits / 8) "
                                   f"or of an aligned part of one of >= {MIN_GROUP} channels, and at most "
                                   f"{MAX_GROUPS_PER_TOKEN} groups per token, e.g. group_size "
                                   f"{max(MIN_GROUP, spec.head_dim // MAX_GROUPS_PER_TOKEN)} or {spec.head_dim}")
            if dequant[p.product] and groups > MAX_DEQUANT_GROUPS:
                raise NotLowerable(f"{p.product}: a dequant plan with {groups} token-wise groups per token; the "
                                   f"register-operand kernel rebuilds values with at most {MAX_DEQUANT_GROUPS}")
            token_groups[p.product] = 0
            channel_groups[p.product] = groups
        else:                           # channel-wise encoding: a token tile inside one group of G tokens
            if p.token_tile_multiple % 32 and p.token_tile_multiple != HALF_TILE_GROUP:
                raise NotLowerable(f"{p.product}: channel-wise groups of {p.token_tile_multiple} tokens; the "
                                   f"register-operand kernel takes {HALF_TILE_GROUP} (two groups per 32-token tile) or "
                                   "a multiple of 32 (a tile inside one group)")
            token_groups[p.product] = p.token_tile_multiple
            channel_groups[p.product] = 1
    if plain["qk"] and plain["pv"]:
        raise NotLowerable("qk and pv are both plain (no encoding); the register-operand kernel reads codes on at "
                           "least one side; the generated Triton kernel runs plain attention")
    for p in (qk, pv):
        if plain[p.product]:
            if width // 2 not in PLAIN_WORDS:
                raise NotLowerable(f"{p.product}: a plain side of head_dim={spec.head_dim}; the register-operand kernel "
                                   "reads plain bf16 rows of 64, 128 or 256 channels")
            continue
        if p.bits not in BITS:
            raise NotLowerable(f"{p.product}: {p.bits}-bit codes; the register-operand kernel unpacks {BITS} bits")
        words = width * p.bits // 32
        if spec.head_dim * p.bits % 32 or words not in WORDS or (words == WORDS[0] and (p.bits != NARROW_BITS
                                                                                         or padded)):
            raise NotLowerable(f"{p.product}: head_dim x bits = {spec.head_dim * p.bits} bits per token; the register "
                               f"layouts need {' or '.join(str(32 * w) for w in WORDS[1:])}, or 128 at 2 bits (e.g. 128 "
                               "channels at 2, 4 or 8 bits, 64 at 2, 4 or 8, 256 at 2 or 4)")
    blocks, block_rows = row_blocks(spec.q_per_kv, max_rows(width))
    if the_plan.rows_per_program not in (None, block_rows):
        raise NotLowerable(f"the plan weighs its folds for {the_plan.rows_per_program} query rows per program; the "
                           f"kernel's programs take {block_rows} (plan it with gluon_plan)")
    if qk.code_bias != KEY_BIAS or pv.code_bias != VALUE_BIAS:
        raise NotLowerable(f"the plan's code biases are key {qk.code_bias}, value {pv.code_bias}; this kernel's "
                           f"codes enter as exact fp16 subnormals, key {KEY_BIAS} and value {VALUE_BIAS} (plan it "
                           "with gluon_plan)")
    operands = the_plan.operand_dtype or the_plan.dtype
    if the_plan.dtype is not None and operands != "fp16":
        raise NotLowerable(f"the plan's precision is for {operands} operands; the kernel's are fp16 "
                           "(plan it with gluon_plan)")
    if the_plan.dtype == "fp16" and the_plan.bar_dtype != BAR_DTYPE:
        raise NotLowerable(FP16_BAR_REASON)
    for p in (qk, pv):   # eq. 6a: the plan's error model decides how the pre-scaled operand is carried
        if p.precision is not None and p.precision.precision not in PRECISIONS:
            raise NotLowerable(f"{p.product}: the error model asks for operand precision {p.precision.precision} "
                               f"(eq. 6a); the register-operand kernel rounds its pre-scaled operand once")
    rows = 8 if block_rows <= 8 else 16   # the MMA's N: 8 or 16
    return FoldKernel(key_bits=PLAIN_BITS if plain["qk"] else qk.bits, value_bits=PLAIN_BITS if plain["pv"] else pv.bits,
                      head_dim=spec.head_dim, q_per_kv=block_rows, rows=rows,
                      row_blocks=blocks, head_rows=spec.q_per_kv if blocks * block_rows != spec.q_per_kv else 0,
                      key_tokens=token_groups["qk"], value_tokens=token_groups["pv"],
                      key_groups=channel_groups["qk"], value_groups=channel_groups["pv"],
                      key_precision=qk.precision.precision if qk.precision is not None else None,
                      value_precision=pv.precision.precision if pv.precision is not None else None,
                      padded_dim=width if padded else 0, key_dequant=dequant["qk"], value_dequant=dequant["pv"],
                      key_masked_groups=masked["qk"], value_masked_groups=masked["pv"])


def register_width(head_dim: int) -> int:
    """Channels per token the register layouts hold for ``head_dim``: itself when a power of two, else
    the next of PADDED_WIDTHS (96 -> 128, 160 -> 256); the codes of each bit field and the query are
    padded with zeros, which add nothing to a score or an output (NotLowerable past 256)."""
    if head_dim & (head_dim - 1) == 0:
        return head_dim
    for width in PADDED_WIDTHS:
        if head_dim < width:
            return width
    raise NotLowerable(f"head_dim={head_dim}: the register-operand kernel pads a head_dim to at most "
                       f"{PADDED_WIDTHS[-1]} channels")


def max_rows(head_dim: int) -> int:
    """Query rows one program's MMA N axis takes: 16, or 8 past 128 channels, where the output
    accumulator [head_dim, rows] in float32 would take more than 64 of a lane's registers."""
    return MAX_ROWS if head_dim <= 128 else MAX_ROWS // 2


def row_blocks(q_per_kv: int, most: int) -> tuple[int, int]:
    """(programs per KV head, query rows each takes): one program when the head's query rows fit ``most``
    rows of the MMA's N axis, else the fewest blocks of at most ``most`` rows, as even as can be: each
    block takes ceil(q_per_kv / blocks) rows and the last one the rest (17 rows: 9 + 8; 25: 13 + 12), so
    every block fills more than half the N axis. Each program reads the head's codes; the blocks are
    neighbours in the grid, so all but the first read them from L2 when they run together."""
    blocks = -(-q_per_kv // most)
    return blocks, -(-q_per_kv // blocks)


def lowerable(spec: AttentionSpec, dtype: str = "bf16") -> tuple[bool, str]:
    """(True, "") if the Gluon kernel lowers ``spec``'s plan for ``dtype`` queries, else (False, reason)."""
    try:
        lower(gluon_plan(spec, dtype))
    except NotLowerable as e:
        return False, str(e)
    return True, ""
