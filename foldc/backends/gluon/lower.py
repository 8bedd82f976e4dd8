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
(a folded 1024 bias there costs precision on real tensor cores, ../shared/notes/fold-kernel-probe.md);
on the key side it saves the per-score removal of ``1024 x sum(q')``. A plan whose key codes carry
the OR-trick bias 1024 (folded into the correction, eq. 7) lowers too.

Token-wise groups smaller than head_dim lower when each group is whole bit fields of the planar
packing (group_size a multiple of head_dim x bits / 8 channels): a group is then a contiguous range
of the key operand's K index and of the value operand's M index (operands.py), and at most
MAX_GROUPS_PER_TOKEN of them. Everything else (other groups, dequant or plain operands, other
widths) goes to the generated Triton kernel (foldc/backends/triton), which lowers any plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...plan import Plan, plan
from ...precision import OperandPrecision
from ...spec import AttentionSpec
from .operands import MAGIC_VALUE

KEY_BIAS = 0       # key codes enter as exact fp16 subnormals too (operands.py): no bias to fold
KEY_BIASES = (0, MAGIC_VALUE)   # what the key unpack builds: subnormal codes, or the OR trick's 1024 + code (eq. 7)
VALUE_BIAS = 0     # value codes enter as exact fp16 subnormals (operands.py): no bias to fold
MAX_ROWS = 16      # query rows per KV head the MMA's N axis holds (8 or 16)
MAX_GROUPS_PER_TOKEN = 4   # token-wise channel groups per token: one score accumulator and one P each


class NotLowerable(Exception):
    """The plan is exact, but this backend has no lowering for it (the reason says why)."""


@dataclass(frozen=True)
class FoldKernel:
    """What the Gluon kernel is specialised on, all read from the plan."""

    bits: int            # code width of K and V
    head_dim: int
    q_per_kv: int
    rows: int            # q_per_kv padded to the MMA's N (8 or 16)
    key_bias: int        # bias carried by the key operand, removed through sum(q') (eq. 7)
    key_tokens: int      # 0: token-wise K (acc-fold); G: channel-wise K in groups of G tokens
    value_tokens: int    # 0: token-wise V (operand-fold); G: channel-wise V in groups of G tokens
    key_groups: int = 1      # token-wise K: channel groups per token (head_dim // group_size)
    value_groups: int = 1    # token-wise V: channel groups per token
    key_precision: OperandPrecision | None = None     # the plan's operand precision (eq. 6a), None if
    value_precision: OperandPrecision | None = None   # the plan was made without a dtype


    @property
    def words_per_token(self) -> int:
        return self.head_dim * self.bits // 32


#: the query dtypes the kernel takes, and why not fp16: its error against plain fp16 attention reached
#: 2.2-2.8x on the H200 on values with large zeros (one large negative outlier per token or channel,
#: INT2 g128; benchmarks/precision_check.py, docs/derivation.md eq. 6a), above the 2x bar, with hi + lo
#: operands too and with exact powers of two for the query's row scale; the excess follows the key
#: side (it goes with q's scale and away with near-uniform logits), and no data-free bound covers it.
#: Under bf16 queries the same kernel stays within 0.65x of plain bf16 attention. fp16 queries run the
#: generated Triton kernel, which meets the bar (0.57-0.98x on the same data).
QUERY_DTYPES = ("bf16",)
FP16_REASON = ("fp16 queries: the register-operand kernel's error reached 2.2-2.8x plain fp16 attention's on the "
               "H200 (values with large zeros), above the 2x bar of docs/derivation.md eq. 6a; they run the "
               "generated Triton kernel (kernel='auto' or 'triton')")
#: the operand precisions the kernel implements (eq. 6a): its pre-scaled operands (P x scale for
#: token-wise V, q x scale for channel-wise K) rounded once to fp16
PRECISIONS = (OperandPrecision.PLAIN, OperandPrecision.SINGLE)


def gluon_plan(spec: AttentionSpec, dtype: str = "bf16") -> Plan:
    """The plan the Gluon kernel runs for ``dtype`` queries: no code bias on either side (subnormal
    codes) and fp16 operands, so each product carries the operand precision the error model of
    eq. 6a picks against plain ``dtype`` attention (bf16 queries: one fp16 rounding up to groups of
    128). NotLowerable for fp16 queries (`FP16_REASON`)."""
    if dtype == "fp16":
        raise NotLowerable(FP16_REASON)
    if dtype not in QUERY_DTYPES:
        raise NotLowerable(f"dtype={dtype!r}: the register-operand kernel takes {QUERY_DTYPES} queries")
    return plan(spec, code_bias={"key": KEY_BIAS, "value": VALUE_BIAS}, dtype=dtype, operand_dtype="fp16")


def lower(the_plan: Plan) -> FoldKernel:
    """The kernel configuration for ``the_plan``; raises NotLowerable with the reason otherwise.
    A plan made for a query dtype must ask for precisions the kernel implements (eq. 6a); one made
    without a dtype is lowered as one fp16 rounding."""
    spec = the_plan.spec
    qk, pv = the_plan.products["qk"], the_plan.products["pv"]
    token_groups, channel_groups = {}, {}
    for p, tokenwise_fold in ((qk, "acc-fold"), (pv, "operand-fold")):
        if p.fold not in ("acc-fold", "operand-fold"):
            raise NotLowerable(f"{p.product} is {p.fold}; the register-operand kernel lowers folded products only")
        if p.correction == "MISSING":
            raise NotLowerable(f"{p.product}: the plan has no zero correction")
        if p.group_axis == "channel":   # token-wise encoding: groups run along head_dim
            if p.fold != tokenwise_fold:
                raise NotLowerable(f"{p.product}: token-wise groups folded as {p.fold}; the register-operand "
                                   f"kernel folds token-wise {p.product} as {tokenwise_fold}")
            field = spec.head_dim * p.bits // 8   # channels per bit field of the planar packing
            groups = spec.head_dim // p.group_size
            if p.group_size % field or groups > MAX_GROUPS_PER_TOKEN:
                raise NotLowerable(f"{p.product}: token-wise groups of {p.group_size} channels; the register-operand "
                                   f"kernel needs whole bit fields of {field} channels (head_dim x bits / 8) per "
                                   f"group and at most {MAX_GROUPS_PER_TOKEN} groups per token, e.g. group_size "
                                   f"{max(field, spec.head_dim // MAX_GROUPS_PER_TOKEN)} or {spec.head_dim}")
            token_groups[p.product] = 0
            channel_groups[p.product] = groups
        else:                           # channel-wise encoding: groups of G tokens
            if p.group_size % 32:
                raise NotLowerable(f"{p.product}: channel-wise groups of {p.group_size} tokens; the register-operand "
                                   "kernel needs a multiple of 32 (a token tile must lie in one group)")
            token_groups[p.product] = p.group_size
            channel_groups[p.product] = 1
    if qk.bits != pv.bits or qk.bits not in (2, 4):
        raise NotLowerable(f"needs K and V at the same width, 2 or 4 bits; got {qk.bits} and {pv.bits}")
    words = spec.head_dim * qk.bits // 32
    if words not in (8, 16):
        raise NotLowerable(f"head_dim x bits = {spec.head_dim * qk.bits} bits per token; the register layouts "
                           "need 256 or 512 (e.g. 128 channels at 2 or 4 bits, 64 at 4, 256 at 2)")
    if spec.q_per_kv > MAX_ROWS:
        raise NotLowerable(f"q_per_kv={spec.q_per_kv} query heads per KV head; at most {MAX_ROWS}")
    if qk.code_bias not in KEY_BIASES or pv.code_bias != VALUE_BIAS:
        raise NotLowerable(f"the plan's code biases are key {qk.code_bias}, value {pv.code_bias}; this kernel "
                           f"builds key {' or '.join(map(str, KEY_BIASES))}, value {VALUE_BIAS} (plan it with "
                           "gluon_plan)")
    if qk.code_bias and channel_groups["qk"] > 1:
        raise NotLowerable(f"key code bias {qk.code_bias} with {channel_groups['qk']} channel groups per token; the "
                           "kernel removes a folded key bias for one group per token only (plan it with gluon_plan)")
    operands = the_plan.operand_dtype or the_plan.dtype
    if the_plan.dtype is not None and operands != "fp16":
        raise NotLowerable(f"the plan's precision is for {operands} operands; the kernel's are fp16 "
                           "(plan it with gluon_plan)")
    for p in (qk, pv):   # eq. 6a: the plan's error model decides how the pre-scaled operand is carried
        if p.precision is not None and p.precision.precision not in PRECISIONS:
            raise NotLowerable(f"{p.product}: the error model asks for operand precision {p.precision.precision} "
                               f"(eq. 6a); the register-operand kernel rounds its pre-scaled operand once")
    rows = 8 if spec.q_per_kv <= 8 else 16
    return FoldKernel(bits=qk.bits, head_dim=spec.head_dim, q_per_kv=spec.q_per_kv, rows=rows, key_bias=qk.code_bias,
                      key_tokens=token_groups["qk"], value_tokens=token_groups["pv"],
                      key_groups=channel_groups["qk"], value_groups=channel_groups["pv"],
                      key_precision=qk.precision.precision if qk.precision is not None else None,
                      value_precision=pv.precision.precision if pv.precision is not None else None)


def lowerable(spec: AttentionSpec, dtype: str = "bf16") -> tuple[bool, str]:
    """(True, "") if the Gluon kernel lowers ``spec``'s plan for ``dtype`` queries, else (False, reason)."""
    try:
        lower(gluon_plan(spec, dtype))
    except NotLowerable as e:
        return False, str(e)
    return True, ""
