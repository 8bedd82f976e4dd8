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
