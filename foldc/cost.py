"""Cost model: scale-and-offset operations per stored value (eq. 12) and lane-slots per byte
against each GPU's issue budget at peak bandwidth (eq. 13).

Budget (lane-slots the SMs can issue per byte the HBM delivers):
``SMs * 4 schedulers * 32 lanes * clock / bandwidth``.

Demand per packed byte = values per byte * (operand construction + affine work per value):

- per-value reconstruction: construction (shift, mask, convert) plus one paired FMA per two
  values (0.5 per value);
- fold: the construction of the MMA operand from codes plus the fold's 2*h/g per value.

The construction constants are calibrated so that INT2 at h = 4, g = 128 reproduces the
reference paper's counts quoted in the seed (H100-class: 6 for reconstruction, 4.25 folded;
B200: 8 and 1.00). Other bit widths scale with values per byte: those figures are a model, to
be checked against SASS counts of the generated kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class GPU:
    name: str
    arch: str
    sms: int
    clock_ghz: float
    hbm_tb_s: float

    @property
    def lane_slots_per_byte(self) -> float:
        """Issue budget at peak HBM bandwidth (eq. 13)."""
        return self.sms * 4 * 32 * self.clock_ghz * 1e9 / (self.hbm_tb_s * 1e12)


GPUS = (
    GPU("H100 SXM", "sm_90", 132, 1.98, 3.35),
    GPU("H200", "sm_90", 132, 1.98, 4.8),
    GPU("B200", "sm_100", 148, 1.965, 8.0),
)

#: lane-slots per value to build a tensor-core operand: (per-value reconstruction, fold)
CONSTRUCTION = {"sm_90": (1.0, 1.0), "sm_100": (1.5, 0.1875)}
PAIRED_FMA_PER_VALUE = 0.5


def lane_slots_per_byte(arch: str, fold: str, bits: int, fold_ops_per_value: float) -> float:
    """Issue demand per packed byte of codes for one encoded operand (eq. 13)."""
    if arch not in CONSTRUCTION:
        raise ValueError(f"arch={arch!r} has no cost figures; use one of {sorted(CONSTRUCTION)}")
    values_per_byte = 8 // bits
    recon, folded = CONSTRUCTION[arch]
    if fold == "dequant":
        return values_per_byte * (recon + PAIRED_FMA_PER_VALUE)
    if fold in ("acc-fold", "operand-fold"):
        return values_per_byte * (folded + fold_ops_per_value)
    raise ValueError(f"fold={fold!r} reads no codes")


@dataclass(frozen=True)
class IssueVerdict:
    gpu: GPU
    demand: float
    budget: float

    @property
    def bound(self) -> str:
        return "bandwidth-bound" if self.demand < self.budget else "issue-bound"

    def __str__(self) -> str:
        return (f"{self.gpu.name}: {self.demand:.2f} of {self.budget:.2f} lane-slots/byte "
                f"({100 * self.demand / self.budget:.0f}%) -> {self.bound}")


def verdicts(fold: str, bits: int, fold_ops_per_value: Fraction | float) -> list[IssueVerdict]:
    return [IssueVerdict(g, lane_slots_per_byte(g.arch, fold, bits, float(fold_ops_per_value)),
                         g.lane_slots_per_byte) for g in GPUS]


# --- the whole token loop of the register-operand kernel (foldc/backends/gluon) -----------------
#
# The per-value figures above count operand construction only. The SASS of the register-operand
# kernel's token loop (sm_90, INT2, 32-token tiles, tests/backends/test_gluon_aot.py) shows what
# they leave out: of 524 instructions per warp and tile, 216 build operands (one LOP3 per two
# codes on both sides, then one sub.f16x2 per two value codes, two PRMT per four value words) and 308
# do per-token work that does not shrink with the code width -- the online softmax over the
# padded query rows, per-token scale and zero, addressing, barriers. When H KV heads share one
# program (their query rows fill the MMA's N axis), the softmax, the barriers and the addressing
# are done once for all H: the same SASS with H = 2, 4, 8 (846, 1438, 2644 instructions per tile)
# splits the 308 into about 200 shared and 108 per head.
#: lane-slots per token (one warp-instruction per token per instruction per tile of 32)
PER_TOKEN_LANE_SLOTS = {"sm_90": 308.0}
#: the part of PER_TOKEN_LANE_SLOTS that packed heads share (softmax, barriers, addressing)
PER_TOKEN_SHARED_LANE_SLOTS = {"sm_90": 200.0}
#: lane-slots per stored value to build the operands: key (LOP3 / 2), value (AND / 2: the codes are
#: used as fp16 subnormals, gluon/operands.py) plus the word gather (2 PRMT per 16 codes)
KEY_CONSTRUCTION, VALUE_CONSTRUCTION = 0.5, 0.5 + 0.125


def token_loop_lane_slots_per_byte(arch: str, bits: int, head_dim: int, param_bytes: int = 2,
                                   heads: int = 1) -> float:
    """Issue demand of the register-operand kernel's whole token loop per byte it reads (token-wise
    K and V, fp16 scale and zero per token): construction of both operands plus the per-token work,
    which ``heads`` KV heads packed into one program's query rows share."""
    if arch not in PER_TOKEN_LANE_SLOTS:
        raise ValueError(f"arch={arch!r} has no measured token-loop figure; use one of {sorted(PER_TOKEN_LANE_SLOTS)}")
    values = head_dim                                   # per operand, per token
    bytes_per_token = 2 * (head_dim * bits / 8 + 2 * param_bytes)
    build = values * (KEY_CONSTRUCTION + VALUE_CONSTRUCTION)
    shared = PER_TOKEN_SHARED_LANE_SLOTS[arch]
    per_token = PER_TOKEN_LANE_SLOTS[arch] - shared + shared / heads
    return (build + per_token) / bytes_per_token
