"""Dequant plans on the register-operand kernel (kernel.py): where the break-even of eq. 12 says a
fold does not pay (groups of at most twice the query rows a program takes), each value is rebuilt
in registers as ``code x scale + zero`` (eq. 1) and the MMA takes plain fp16 values, with no
correction term.

The value codes come unpacked as exact fp16 integers ``code x 2^(bits*field)`` (operands.py,
``integer``), the key codes as fp16 subnormals ``code x 2^(bits*field) x 2^-24`` (one AND per two,
no subtraction); one HFMA2 per two values (operands.DEQUANT_ASM) computes ``code x a + b`` with
``a = scale x 2^(e + unit - bits*field)`` (unit 24 for the keys, 0 for the values) and
``b = zero x 2^e``, rounded once to fp16. The power of two 2^e (`dequant_exponent`) puts the largest
reconstructed value of a token (token-wise sides) or of a group (channel-wise sides) in [2^13, 2^15)
for values and in [2^-9, 2^-7) for keys (where ``a`` stays below 2^16): any scale and zero fit fp16,
and the products keep fp16's relative precision (docs/derivation.md section 12). It is undone
exactly: on the key side by 2^-e on the scores (per token row, or in the logits' factor per group),
on the value side by 2^-e on P before the product.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl

from foldc.backends.gluon.operands import (DEQUANT_ASM, DEQUANT_KEY_EXPONENTS, DEQUANT_KEY_TOP, DEQUANT_VALUE_EXPONENTS,
                                           DEQUANT_VALUE_TOP, KEY_EXPONENT)
from foldc.backends.gluon.tile_operands import NARROW

DEQ: gl.constexpr = gl.constexpr(DEQUANT_ASM[0])
DEQ_CONS: gl.constexpr = gl.constexpr(DEQUANT_ASM[1])
# the bounds of e (operands.DEQUANT_KEY_EXPONENTS, DEQUANT_VALUE_EXPONENTS)
KEY_E_LO: gl.constexpr = gl.constexpr(DEQUANT_KEY_EXPONENTS[0])
KEY_E_HI: gl.constexpr = gl.constexpr(DEQUANT_KEY_EXPONENTS[1])
VALUE_E_LO: gl.constexpr = gl.constexpr(DEQUANT_VALUE_EXPONENTS[0])
VALUE_E_HI: gl.constexpr = gl.constexpr(DEQUANT_VALUE_EXPONENTS[1])
KEY_TOP: gl.constexpr = gl.constexpr(DEQUANT_KEY_TOP)
VALUE_TOP: gl.constexpr = gl.constexpr(DEQUANT_VALUE_TOP)
KEY_UNIT: gl.constexpr = gl.constexpr(KEY_EXPONENT)   # the key codes are subnormals: code x 2^(bits*field) x 2^-24


@constexpr_function
def _SPREAD(D):
    """A [D] layout of one warp with D/32 consecutive entries per lane: a group's parameters, each once."""
    return gl.BlockedLayout([D // 32], [32], [1], [0])


@gluon.jit
def pow2(n):
    """2^n exactly, float32, for int32 n in [-126, 127]."""
    return ((n + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _floor_log2(x):
    """floor(log2 x) of float32 x > 0 from its exponent bits; -127 for 0 and subnormals."""
    return ((x.to(gl.int32, bitcast=True) >> 23) & 255) - 127


@gluon.jit
def _magnitude(s, z, BITS: gl.constexpr):
    return gl.maximum(gl.abs(s.to(gl.float32)) * (2.0 ** BITS), gl.abs(z.to(gl.float32)))


@gluon.jit
def dequant_exponent(m, LO: gl.constexpr, HI: gl.constexpr, TOP: gl.constexpr):
    """e with m x 2^e in [2^TOP, 2^(TOP+1)), clamped to [LO, HI]: for m = max(|scale| x 2^bits, |zero|),
    every ``(scale x code + zero) x 2^e`` with code < 2^bits is below 2^(TOP+2) (operands.dequant_exponent
    is the same in Python; TOP: VALUE_TOP or KEY_TOP)."""
    return gl.minimum(gl.maximum(TOP - _floor_log2(m), LO), HI)


@gluon.jit
def token_exponent(s, z, BITS: gl.constexpr, NG: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
                   TOP: gl.constexpr):
    """Per token of a token-wise side (s, z: [BN], or tuples of NG channel groups): its 2^e."""
    if NG == 1:
        m = _magnitude(s, z, BITS)
    else:
        m = gl.maximum(_magnitude(s[0], z[0], BITS), _magnitude(s[1], z[1], BITS))
        if NG == 3:
            m = gl.maximum(m, _magnitude(s[2], z[2], BITS))
        elif NG == 4:
            m = gl.maximum(m, gl.maximum(_magnitude(s[2], z[2], BITS), _magnitude(s[3], z[3], BITS)))
    return dequant_exponent(m, LO, HI, TOP)


@gluon.jit
def rebuild(codes, a, b):
    """codes x a + b per value, two per HFMA2 (all three fp16 of one shape and layout)."""
    return gl.inline_asm_elementwise(DEQ, DEQ_CONS, [codes, a, b], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _select(x, grp, NG: gl.constexpr, AXIS: gl.constexpr):
    """Per element, group grp's parameter: x a tuple of NG per-token tensors (or one), expanded
    along AXIS (the token axis of the operand) against grp (the channel axis' group)."""
    if NG == 1:
        out = gl.expand_dims(x.to(gl.float32), AXIS)
    else:
        out = gl.expand_dims(x[0].to(gl.float32), AXIS) + gl.expand_dims(grp * 0, 1 - AXIS).to(gl.float32)
        for g in gl.static_range(1, NG):
            out = gl.where(gl.expand_dims(grp == g, 1 - AXIS), gl.expand_dims(x[g].to(gl.float32), AXIS), out)
    return out


@gluon.jit
def key_fields(k, D: gl.constexpr, NB: gl.constexpr):
    """(bit field, channel in the registers) of each k index of the key operand (operands.key_channel)."""
    if NB == 4 * NARROW:
        field = 2 * ((k >> 5) & 1) + ((k >> 2) & 1)
        chan = field * NB + 4 * ((k >> 3) & 3) + ((k >> 1) & 1) + 2 * (k & 1)
    else:
        field = k // NB
        j = k % NB
        chan = field * NB + ((j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1))
    return field, chan


@gluon.jit
def value_fields(m, D: gl.constexpr, NB: gl.constexpr):
    """(bit field, channel in the registers) of each row m of the value operand (operands.value_channel)."""
    W: gl.constexpr = NB // 4
    field = m // NB
    if W == NARROW:
        r = m & 7
        chan = field * NB + 4 * (r & 3) + ((m >> 3) & 1) + 2 * (r >> 2)
    else:
        chan = field * NB + 4 * (m % W) + (m // W) % 4
    return field, chan


@gluon.jit
def _to_layout(x, layout: gl.constexpr, NG: gl.constexpr):
    """x (a tensor, or a tuple of NG) converted to ``layout``."""
    if NG == 1:
        out = gl.convert_layout(x, layout)
    elif NG == 2:
        out = (gl.convert_layout(x[0], layout), gl.convert_layout(x[1], layout))
    elif NG == 3:
        out = (gl.convert_layout(x[0], layout), gl.convert_layout(x[1], layout), gl.convert_layout(x[2], layout))
    else:
        out = (gl.convert_layout(x[0], layout), gl.convert_layout(x[1], layout), gl.convert_layout(x[2], layout),
               gl.convert_layout(x[3], layout))
    return out


@gluon.jit
def channel_group(field, chan, D: gl.constexpr, F: gl.constexpr, NG: gl.constexpr, DR: gl.constexpr):
    """The token-wise group of each register channel: its cache channel's, field * DR/F + its place in
    the field, on a padded head_dim (DR > 0 and != D); else chan // (D / NG)."""
    if DR > 0 and DR != D and (DR // F) % 8 == 0 and (DR // NG) % 8 == 0:
        # every boundary on a multiple of 8 channels: the low three bits of the channel never move the
        # group, and dropping them lets the compiler see one group per lane and field (one select per
        # token, not per value)
        out = (field * (DR // F) + (chan % (D // F) & ~7)) // (DR // NG)
    elif DR > 0 and DR != D:
        out = (field * (DR // F) + chan % (D // F)) // (DR // NG)
    else:
        out = chan // (D // NG)
    return out


@gluon.jit
def _rebuild_tokens(codes, s, z, e, field, grp, tok_l: gl.constexpr, BITS: gl.constexpr, NG: gl.constexpr,
                    TOK: gl.constexpr, UNIT: gl.constexpr):
    """A token-wise side's operand ``codes`` (codes x 2^(bits*field - UNIT), tokens on axis TOK) rebuilt
    per value with each token's scale and zero (its channel group's: ``grp`` along the other axis, NG
    per token) times 2^e[token]; ``field`` is each channel's bit field."""
    e_t = gl.expand_dims(gl.convert_layout(e, tok_l), 1 - TOK)
    a = (_select(_to_layout(s, tok_l, NG), grp, NG, 1 - TOK) * pow2(e_t + UNIT - gl.expand_dims(field * BITS, TOK)))
    a = a.to(gl.float16)
    b = (_select(_to_layout(z, tok_l, NG), grp, NG, 1 - TOK) * pow2(e_t)).to(gl.float16)
    b, _ = gl.broadcast(b, a)
    return rebuild(codes, a, b)


@gluon.jit
def key_token_dequant(ka, ks, kz, e, a_l: gl.constexpr, D: gl.constexpr, F: gl.constexpr, NG: gl.constexpr,
                      DR: gl.constexpr = 0):
    """Token-wise K: the key operand ka [BN, D] (subnormal codes) rebuilt per value with each token's
    scale and zero (its group's, NG per token) times 2^e[token] (e: int32 [BN], KEY_TOP). DR: the real
    head_dim of a padded one (a channel's group is its cache channel's)."""
    field, chan = key_fields(gl.arange(0, D, layout=gl.SliceLayout(0, a_l)), D, D // F)
    return _rebuild_tokens(ka, ks, kz, e, field, channel_group(field, chan, D, F, NG, DR), gl.SliceLayout(1, a_l), 8 // F,
                           NG, 0, KEY_UNIT)


@gluon.jit
def value_token_dequant(va, vs, vz, e, a_l: gl.constexpr, D: gl.constexpr, F: gl.constexpr, NG: gl.constexpr,
                        DR: gl.constexpr = 0):
    """Token-wise V: the value operand va [D, BN] (integer codes, tokens on K) rebuilt per value
    with each token's scale and zero (its channel group's) times 2^e[token]."""
    field, chan = value_fields(gl.arange(0, D, layout=gl.SliceLayout(1, a_l)), D, D // F)
    return _rebuild_tokens(va, vs, vz, e, field, channel_group(field, chan, D, F, NG, DR), gl.SliceLayout(0, a_l), 8 // F,
                           NG, 1, 0)


@gluon.jit
def _scale_zero(S, Z, off, ok, MASKED: gl.constexpr):
    """A channel-wise group's scales and zeros at ``off`` in float32 (zero where not ``ok``, if MASKED)."""
    if MASKED:
        out = gl.load(S + off, mask=ok, other=0).to(gl.float32), gl.load(Z + off, mask=ok, other=0).to(gl.float32)
    else:
        out = gl.load(S + off).to(gl.float32), gl.load(Z + off).to(gl.float32)
    return out


@gluon.jit
def key_group_dequant(query, KSg, KZg, a_l: gl.constexpr, D: gl.constexpr, F: gl.constexpr, CH: gl.constexpr,
                      CHR: gl.constexpr):
    """Channel-wise K, one token group: ``query`` is (the query with each row times its power of two
    c in fp16, qk_scale / c per row), made once before the token loop; returns that fp16 query, the
    group's per-k ``a``, ``b`` (fp16 [D]) and the logits' factor qk_scale x 2^-e / c per row."""
    BITS: gl.constexpr = 8 // F
    # each lane loads and rebuilds D/32 of the group's k indices once (the operand layout holds every k
    # in eight lanes), then the fp16 a and b move to the operand's layout
    field, chan = key_fields(gl.arange(0, D, layout=_SPREAD(D)), D, D // F)
    if CH != CHR:   # a padded head_dim: the padding channels load zero
        s, z = _scale_zero(KSg, KZg, (chan // CH) * CHR + chan % CH, chan % CH < CHR, True)
    else:
        s, z = _scale_zero(KSg, KZg, chan, None, False)
    e = dequant_exponent(gl.max(_magnitude(s, z, BITS), axis=0), KEY_E_LO, KEY_E_HI, KEY_TOP)
    a = gl.convert_layout((s * pow2(e + KEY_UNIT - field * BITS)).to(gl.float16), gl.SliceLayout(0, a_l))
    b = gl.convert_layout((z * pow2(e)).to(gl.float16), gl.SliceLayout(0, a_l))
    q16, q_factor = query
    return q16, (a, b), q_factor * pow2(-e)


@gluon.jit
def value_group_dequant(VSg, VZg, chan_o, cm, ok, D: gl.constexpr, F: gl.constexpr, PAD: gl.constexpr):
    """Channel-wise V, one token group: per output row (cache channel chan_o, operand row cm) the
    fp16 ``a``, ``b`` of `rebuild`, and P's factor 2^-e (one per group)."""
    BITS: gl.constexpr = 8 // F
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)   # the accumulator's rows (output channels)
    # each lane loads and rebuilds D/32 rows once (the accumulator's layout holds every row in four lanes)
    chan_s = gl.convert_layout(chan_o, _SPREAD(D))
    if PAD:
        ok = gl.convert_layout(ok, _SPREAD(D))
    s, z = _scale_zero(VSg, VZg, chan_s, ok, PAD)
    e = dequant_exponent(gl.max(_magnitude(s, z, BITS), axis=0), VALUE_E_LO, VALUE_E_HI, VALUE_TOP)
    field = gl.convert_layout(cm, _SPREAD(D)) // (D // F)
    a = gl.convert_layout((s * pow2(e - field * BITS)).to(gl.float16), row_l)
    b = gl.convert_layout((z * pow2(e)).to(gl.float16), row_l)
    return a, b, pow2(-e)
