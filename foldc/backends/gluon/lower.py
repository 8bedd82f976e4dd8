"""Read a plan and decide whether the register-operand (Gluon) kernel can lower it.

The Gluon kernel feeds packed codes to the tensor cores from registers (kernel.py). It lowers
the plans whose two products fold with one scale and zero per token:

- qk: an acc-fold (eq. 3) whose groups span the whole head_dim, so each token's partial sum is
  scaled once (scores are K'.Q'^T with tokens on the MMA's M axis, scale per row of M);
- pv: an operand-fold (eq. 4) with the same groups, so P is multiplied by the token's scale
  before the product (the MMA computes V'^T.P'^T, channels on M, tokens on K);
- both corrections as the plan states them (zero x sum(q) before the softmax, sum(p x zero)
  before the division), and the code bias the plan records: the key codes carry the OR-trick
  bias 1024 folded into the correction (eq. 7), the value codes none (the kernel subtracts it
  per value, exact), as ../shared/notes/fold-kernel-probe.md requires on real tensor cores.

Everything else (channel-wise groups, groups smaller than head_dim, dequant or plain
operands) goes to the generated Triton kernel (foldc/backends/triton), which lowers any plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...plan import Plan, plan
from ...spec import AttentionSpec

KEY_BIAS = 1024    # fp16 0x6400: the OR trick puts a code in the mantissa of 1024 (eq. 7)
VALUE_BIAS = 0     # value codes are made exact before the product
MAX_ROWS = 16      # query rows per KV head the MMA's N axis holds (8 or 16)


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

    @property
    def words_per_token(self) -> int:
        return self.head_dim * self.bits // 32


def gluon_plan(spec: AttentionSpec) -> Plan:
    """The plan the Gluon kernel runs: the key codes carry the OR-trick bias, the values none."""
    return plan(spec, code_bias={"key": KEY_BIAS, "value": VALUE_BIAS})


def lower(the_plan: Plan) -> FoldKernel:
    """The kernel configuration for ``the_plan``; raises NotLowerable with the reason otherwise."""
    spec = the_plan.spec
    qk, pv = the_plan.products["qk"], the_plan.products["pv"]
    if qk.fold != "acc-fold" or pv.fold != "operand-fold":
        raise NotLowerable(f"needs qk acc-fold and pv operand-fold (one scale per token); the plan has "
                           f"qk {qk.fold}, pv {pv.fold}")
    for p in (qk, pv):
        if p.group_size != spec.head_dim:
            raise NotLowerable(f"{p.product}: groups of {p.group_size} channels; the register-operand kernel "
                               f"needs one group per token (group_size == head_dim == {spec.head_dim})")
        if p.correction == "MISSING":
            raise NotLowerable(f"{p.product}: the plan has no zero correction")
    if qk.bits != pv.bits or qk.bits not in (2, 4):
        raise NotLowerable(f"needs K and V at the same width, 2 or 4 bits; got {qk.bits} and {pv.bits}")
    words = spec.head_dim * qk.bits // 32
    if words not in (8, 16):
        raise NotLowerable(f"head_dim x bits = {spec.head_dim * qk.bits} bits per token; the register layouts "
                           "need 256 or 512 (e.g. 128 channels at 2 or 4 bits, 64 at 4, 256 at 2)")
    if spec.q_per_kv > MAX_ROWS:
        raise NotLowerable(f"q_per_kv={spec.q_per_kv} query heads per KV head; at most {MAX_ROWS}")
    if qk.code_bias != KEY_BIAS or pv.code_bias != VALUE_BIAS:
        raise NotLowerable(f"the plan's code biases are key {qk.code_bias}, value {pv.code_bias}; this kernel "
                           f"builds key {KEY_BIAS}, value {VALUE_BIAS} (plan it with gluon_plan)")
    rows = 8 if spec.q_per_kv <= 8 else 16
    return FoldKernel(bits=qk.bits, head_dim=spec.head_dim, q_per_kv=spec.q_per_kv, rows=rows, key_bias=KEY_BIAS)


def lowerable(spec: AttentionSpec) -> tuple[bool, str]:
    """(True, "") if the Gluon kernel lowers ``spec``'s plan, else (False, reason)."""
    try:
        lower(gluon_plan(spec))
    except NotLowerable as e:
        return False, str(e)
    return True, ""
