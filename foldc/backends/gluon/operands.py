"""How packed codes become tensor-core operands in registers (GPU only: inline PTX).

Codes are read as 32-bit words of the planar packing (foldc/encoding.py: byte j, bit field i
holds channel i*W8 + j, W8 = head_dim*bits/8 bytes per token). One AND ``word & m`` turns two
codes into an fp16 pair of *subnormals*: bit pattern m is m * 2^-24 exactly, so field i of code c
is ``c * 2^(bits*i) * 2^-24``, with no magic number and no subtraction (the tensor cores take fp16
subnormals as they are). The field is masked where it lies, never shifted, so field i carries the
power-of-two weight 2^(bits*i). The kernel folds that weight and the 2^24 into the query and the
logits (key side) or into the output rows (value side); power-of-two scalings are exact in
floating point.

Key side (scores S^T = K'.Q'^T, tokens on the MMA's M axis): the MMA's A operand with
k_width=8 wants 8 consecutive k per thread; a thread reads two consecutive words of one token,
and result ``2i+p`` of `key_unpack_asm` holds field i of bytes (p, p+2) of the word, so the
k index of an operand element is ``4*word + 2*p + e`` for byte ``4*word + p + 2*e``: bits 0 and
1 of the byte index swapped (`key_channel` gives the query channel of each k).

Value side (O^T = V'^T.P'^T, channels on M, tokens on K): the A operand wants consecutive
tokens of one channel per register pair, so `value_unpack_asm` takes four tokens' words, gathers
byte b of each with two PRMTs and unpacks two tokens per AND, as subnormals (here a folded 1024
bias would cost precision, docs/derivation.md section 7).
The kernel multiplies each output row by 2^(VALUE_EXPONENT - bits*i) at the end. Row m of the operand is
channel ``i*W8 + 4*(m % W) + (m // W) % 4`` with ``W`` words per token (`value_channel`).
"""
from __future__ import annotations

from triton import constexpr_function

MAGIC = 0x64006400  # fp16 pair (1024, 1024)
VALUE_EXPONENT = 24  # an fp16 bit pattern m below 0x0400 (a subnormal) is m * 2^-24
KEY_EXPONENT = VALUE_EXPONENT   # subnormal key codes: the same unit
NARROW_WORDS = 4    # words per token (head_dim 64 at 2 bits) below the MMA's eight lane rows: key_k, value_row


def _mask(bits: int, field: int) -> int:
    return (((1 << bits) - 1) << (bits * field)) * 0x00010001


def key_unpack_asm(bits: int, integer: bool = False) -> tuple[str, str]:
    """PTX and constraints for pack=2 over (word, the same word): 2*fields fp16 pairs, result
    ``2i+p`` = field i of bytes (p, p+2), the masked field as an fp16 subnormal,
    ``2^(bits*i)*code * 2^-24`` exactly (one AND; the kernel scales the logits by 2^KEY_EXPONENT, or a
    dequant plan's `DEQUANT_ASM` takes it with ``a`` times 2^KEY_EXPONENT). ``integer``: the OR trick's
    1024 added and subtracted again, ``2^(bits*i)*code`` as an exact fp16 integer (LOP3 + HSUB2; the
    tests' reference)."""
    fields = 8 // bits
    n = 2 * fields
    out = ["{ .reg .b32 t, m;", f"mov.b32 m, {MAGIC};"] if integer else ["{ .reg .b32 t;"]
    out.append(f"shr.b32 t, ${n}, 8;")
    for i in range(fields):
        for reg, src in ((2 * i, f"${n}"), (2 * i + 1, "t")):
            if integer:
                out.append(f"lop3.b32 ${reg}, {src}, {_mask(bits, i)}, m, 0xea;")
            else:
                out.append(f"and.b32 ${reg}, {src}, {_mask(bits, i)};")
            if integer:
                out.append(f"sub.f16x2 ${reg}, ${reg}, m;")
    out.append("}")
    return " ".join(out), ",".join(["=r"] * n + ["r", "r"])


def natural_key_unpack_asm(bits: int) -> tuple[str, str]:
    """`key_unpack_asm` (subnormal codes, pack=2 over (word, the same word)) with the k index in channel
    order: result ``2i+p`` = field i of bytes (2p, 2p+1) of the word, so that k = ``4*word + 2*p + e`` is
    byte ``4*word + 2*p + e``, the planar packing's own order. Two PRMTs gather the byte pairs (one SHR
    in `key_unpack_asm`; for 8-bit codes they write zero bytes between, and no AND follows); the other operand
    then needs no reordering (the GEMV's activation, read from shared memory as it lies in global memory)."""
    fields = 8 // bits
    n = 2 * fields
    if bits == 8:   # the PRMTs take zero for bytes 1 and 3 (selector nibble 4: the second operand's byte 0)
        return (f"{{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, ${n}, z, 0x4140; prmt.b32 $1, ${n}, z, 0x4342; }}",
                ",".join(["=r"] * n + ["r", "r"]))
    # PRMT selector nibble k = the source byte of result byte k; bytes 1 and 3 are masked off below
    out = ["{ .reg .b32 u, v;", f"prmt.b32 u, ${n}, ${n}, 0x3110;", f"prmt.b32 v, ${n}, ${n}, 0x3332;"]
    for i in range(fields):
        out.append(f"and.b32 ${2 * i}, u, {_mask(bits, i)};")
        out.append(f"and.b32 ${2 * i + 1}, v, {_mask(bits, i)};")
    out.append("}")
    return " ".join(out), ",".join(["=r"] * n + ["r", "r"])


#: the bf16 pair (128, 128): ``0x4300 | m`` is the bf16 ``128 + m`` exactly for m < 128 (`biased_key_unpack_asm`)
BF16_MAGIC = 0x43004300
#: the code bias a bf16 operand built by `biased_key_unpack_asm` carries (in field 0's units; eq. 7)
BF16_CODE_BIAS = 128


def biased_field_shift(bits: int, field: int) -> int:
    """log2 of field ``field``'s weight in `biased_key_unpack_asm`'s values: bits * field, less one for the
    field whose top bit is the byte's bit 7 (shifted down one place: that bit is a bf16's exponent)."""
    return bits * field - (1 if bits * (field + 1) > 7 else 0)


def biased_key_unpack_asm(bits: int) -> tuple[str, str]:
    """`key_unpack_asm`'s words and k order (result ``2i+p`` = field i of bytes (p, p+2)) as bf16 pairs
    ``128 + code * 2^biased_field_shift(bits, i)``: one LOP3 each, ``(w & mask) | BF16_MAGIC``, the top
    field shifted down one place first. For bf16 activations, whose MMA is then bf16 x bf16 with no
    conversion; the plan's code bias of 128 (eq. 7) takes the 128 back through the zero. 2- and 4-bit codes
    (an 8-bit code would reach the exponent)."""
    if bits not in (2, 4):
        raise ValueError(f"bits={bits}: the biased bf16 unpack takes 2- and 4-bit codes")
    fields = 8 // bits
    n = 2 * fields
    out = ["{ .reg .b32 t, u, v;", f"shr.b32 t, ${n}, 8;", f"shr.b32 u, ${n}, 1;", f"shr.b32 v, ${n}, 9;"]
    for i in range(fields):
        top = bits * (i + 1) > 7
        mask = _mask(bits, i) >> (1 if top else 0)
        for reg, src in ((2 * i, "u" if top else f"${n}"), (2 * i + 1, "v" if top else "t")):
            out.append(f"lop3.b32 ${reg}, {src}, {mask}, {BF16_MAGIC}, 0xea;")
    out.append("}")
    return " ".join(out), ",".join(["=r"] * n + ["r", "r"])


def value_unpack_asm(bits: int, byte: int, integer: bool = False) -> tuple[str, str]:
    """PTX and constraints for pack=4 over four tokens' words: result i = field i of byte
    ``byte`` of tokens (t0, t1), (t2, t3) as fp16 subnormals, code * 2^(bits*i) * 2^-24 exactly;
    ``integer`` (a dequant plan): as exact fp16 integers code * 2^(bits*i) (the OR trick's 1024 added
    and subtracted, LOP3 + HSUB2)."""
    fields = 8 // bits
    n = 2 * fields
    sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12)
    out = ["{ .reg .b32 u, v" + (", m;" if integer else ";"), f"prmt.b32 u, ${n}, ${n + 1}, {sel};",
           f"prmt.b32 v, ${n + 2}, ${n + 3}, {sel};"]
    if integer:
        out.append(f"mov.b32 m, {MAGIC};")
    for i in range(fields):
        for reg, src in ((2 * i, "u"), (2 * i + 1, "v")):
            if integer:
                out.append(f"lop3.b32 ${reg}, {src}, {_mask(bits, i)}, m, 0xea;")
                out.append(f"sub.f16x2 ${reg}, ${reg}, m;")
            else:
                out.append(f"and.b32 ${reg}, {src}, {_mask(bits, i)};")
    out.append("}")
    return " ".join(out), ",".join(["=r"] * n + ["r"] * 4)


def lane_value_unpack_asm(bits: int) -> tuple[str, str]:
    """`value_unpack_asm` with the byte chosen per lane: pack=4 over four tokens' words and four copies of a
    PRMT selector ``byte | byte << 4 | (4 + byte) << 8 | (4 + byte) << 12`` (the first is used). The
    warpgroup template (warpgroup.py) gives each lane one byte of its tokens' words, since its MMA's
    lane rows are channels spread over four warps."""
    fields = 8 // bits
    n = 2 * fields
    out = ["{ .reg .b32 u, v;", f"prmt.b32 u, ${n}, ${n + 1}, ${n + 4};", f"prmt.b32 v, ${n + 2}, ${n + 3}, ${n + 4};"]
    for i in range(fields):
        for reg, src in ((2 * i, "u"), (2 * i + 1, "v")):
            out.append(f"and.b32 ${reg}, {src}, {_mask(bits, i)};")
    out.append("}")
    return " ".join(out), ",".join(["=r"] * n + ["r"] * 8)


#: a dequant plan's per-value reconstruction (eq. 1), two values per instruction: code x a + b, one
#: rounding to fp16, with a = scale x 2^(e + unit - bits*field) and b = zero x 2^e for a power of two
#: 2^e that keeps every reconstructed value in fp16's range (tile_dequant.dequant_exponent); unit is
#: the codes' own: 0 for the value side's exact fp16 integers, KEY_EXPONENT for the key side's
#: subnormal codes (code x 2^(bits*field) x 2^-24, one AND each, no subtraction)
DEQUANT_ASM = ("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r")
#: bounds of that e: the key side's 2^-e is applied in fp32 (to the scores), the value side's rides on
#: P in fp16, where P x 2^-e must stay below 2^15 (P <= 1) and in fp16's normal range for P near 1
DEQUANT_KEY_EXPONENTS = (-100, 100)
DEQUANT_VALUE_EXPONENTS = (-15, 10)
#: m x 2^e lands in [2^top, 2^(top+1)): values below 2^15 (top 13); keys below 2^-7 (top -9), where
#: a = scale x 2^(e + 24 - bits*field) stays below 2^16 for subnormal codes
DEQUANT_VALUE_TOP = 13
DEQUANT_KEY_TOP = -9


def dequant_exponent(scale: float, zero: float, bits: int, bounds: tuple[int, int],
                     top: int = DEQUANT_VALUE_TOP) -> int:
    """The power of two 2^e a dequant plan's values are rebuilt at (tile_dequant.dequant_exponent,
    here in Python for the tests): m = max(|scale| x 2^bits, |zero|) in float32, e = top - floor(log2 m)
    from m's exponent bits (floor(log2 0) = -127), clamped to ``bounds``; then every
    ``(scale x code + zero) x 2^e`` with code < 2^bits is below 2^(top + 2)."""
    import struct

    m = struct.unpack("<f", struct.pack("<f", max(abs(scale) * 2.0 ** bits, abs(zero))))[0]
    exponent = ((struct.unpack("<I", struct.pack("<f", m))[0] >> 23) & 255) - 127
    return min(max(top - exponent, bounds[0]), bounds[1])


@constexpr_function
def key_channel(k: int, bits: int, head_dim: int) -> int:
    """Channel of k index ``k`` of the key operand (field-major, byte bits 0 and 1 swapped; with
    four words per token, `key_k`'s order)."""
    nb = head_dim * bits // 8
    if nb == 4 * NARROW_WORDS:
        field = 2 * ((k >> 5) & 1) + ((k >> 2) & 1)
        byte = 4 * ((k >> 3) & 3) + ((k >> 1) & 1) + 2 * (k & 1)
        return field * nb + byte
    field, j = divmod(k, nb)
    return field * nb + ((j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1))


def key_k(word: int, field: int, p: int, e: int, bits: int, head_dim: int) -> int:
    """k index of half ``e`` of key unpack result ``2*field + p`` of word ``word`` (byte
    ``4*word + p + 2*e``). Eight or more words per token: a lane reads two words and k is
    ``field*NB + 4*word + 2*p + e``. Four words (head_dim 64 at 2 bits): a lane reads one word, the
    MMA's lane bits of k (3, 4) are the word, and the fields take the register bits 2 and 5:
    ``k = 32*(field // 2) + 8*word + 4*(field % 2) + 2*p + e``."""
    nb = head_dim * bits // 8
    if nb == 4 * NARROW_WORDS:
        return 32 * (field // 2) + 8 * word + 4 * (field % 2) + 2 * p + e
    return field * nb + 4 * word + 2 * p + e


@constexpr_function
def value_channel(m: int, bits: int, head_dim: int) -> int:
    """Channel of row ``m`` of the value operand (`value_row`'s order)."""
    nb = head_dim * bits // 8
    w = nb // 4
    if w == NARROW_WORDS:
        r = m & 7
        return (m // nb) * nb + 4 * (r & 3) + ((m >> 3) & 1) + 2 * (r >> 2)
    return (m // nb) * nb + 4 * (m % w) + (m // w) % 4


def value_row(word: int, byte: int, field: int, bits: int, head_dim: int) -> int:
    """Row of the value operand that holds field ``field`` of byte ``byte`` of word ``word``. Eight
    or more words: ``field*NB + W*byte + word``. Four words (head_dim 64 at 2 bits): the eight lane
    rows of the MMA need eight words, so the kernel reads each word twice, as row ``r = word`` and
    as row ``r = word + 4`` shifted right by 16 bits, and unpacks bytes 0 and 1 of each:
    ``row = 16*field + 8*(byte % 2) + word + 4*(byte // 2)``."""
    nb = head_dim * bits // 8
    w = nb // 4
    if w == NARROW_WORDS:
        return 16 * field + 8 * (byte % 2) + word + 4 * (byte // 2)
    return field * nb + w * byte + word


@constexpr_function
def cache_channel(c: int, per_field: int, per_field_cache: int) -> int | None:
    """The cache's channel of register channel ``c`` when a head_dim between powers of two is padded
    (each bit field holds ``per_field`` channels in the registers, ``per_field_cache`` in the cache,
    the rest zero codes); None for a padding channel. The kernel computes the same inline."""
    field, j = divmod(c, per_field)
    return field * per_field_cache + j if j < per_field_cache else None


PIECE = 32   # k indices of the key operand, or rows of the value operand, in one operand piece (tile_operands.split_groups)


@constexpr_function   # also called by kernel code at compile time (tile_groups.py)
def piece_groups(side: str, piece: int, bits: int, width: int, head_dim: int, groups: int,
                 rows: int = PIECE) -> tuple[int, ...]:
    """The token-wise channel groups that piece ``piece`` of an operand meets (``rows`` consecutive k indices of the
    key operand, ``side`` "key", or rows of the value operand, "value"; PIECE in the kernel) when a head_dim between
    powers of two is padded to ``width`` register channels and split into ``groups`` groups: the groups of the cache
    channels its k indices or rows hold, in order (empty for a piece of padding alone). A piece meets one group, or
    more where a group's boundary falls inside a bit field's channels."""
    channel = key_channel if side == "key" else value_channel
    per_field, per_field_cache = width * bits // 8, head_dim * bits // 8
    size = head_dim // groups
    met = {c // size for r in range(piece * rows, (piece + 1) * rows)
           if (c := cache_channel(channel(r, bits, width), per_field, per_field_cache)) is not None}
    return tuple(sorted(met))
