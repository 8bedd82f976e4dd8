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
# kernel's token loop (sm_90, tests/backends/test_gluon_aot.py) has four parts, fitted to the
# builds of INT2 and INT4 at 32- and 64-token tiles with 1, 2 and 4 KV heads per program (2026-12-01,
# after the P mask by ANDs; every build within 3.6% of the fit):
#   - construction, per head and token: one LOP3 per two codes on each side, the key words'
#     second byte pair by one SHF per word, the value words' gather by two PRMT per word, and the
#     shared-memory loads of the words (one LDS.64 per two words, each side);
#   - each packed head's P operand masked to its own query rows (`p_mask_per_head`, by design:
#     one AND per register with two heads, a SEL per half and two PRMT per register with more);
#   - per-head work per token that does not shrink with the code width (scales and zeros, their
#     loads and conversion): about 51 warp-instructions per 32 tokens per head;
#   - work the packed heads share (the online softmax over the query rows, the matrix
#     instructions' bookkeeping): about 164 per 32 tokens;
#   - per tile, whatever its size (barriers, the copy issue, loop control): about 95;
#   (the value unit of token-wise values, tile_values.value_unit: the largest scale of each tile, its power of two
#   in the running offset, added about 7.5 per 32 tokens and 13 a tile to the fit's 156.5 and 81.5: 17-31 SASS
#   instructions a tile over twelve builds of 2026-12-08)
#   - with several channel groups per token (token-wise sides, groups of whole bit fields), each
#     group past the first on each side: its own score accumulator or scaled P, scale and zero
#     conversions (a token's groups load as one word); about 24 per 32 tokens shared by the packed
#     heads and 5.5 per head (fitted to seven builds: INT2 groups of 32 and 64 channels and INT4
#     groups of 64, 32- and 64-token tiles, 1 and 2 heads; every build within 2.8%).
#: lane-slots per stored value to build the operands, by code width (see above)
def key_construction(bits: int) -> float:
    return 0.5 + bits / 32 + bits / 64


def value_construction(bits: int) -> float:
    return 0.5 + bits / 16 + bits / 64


def p_mask_per_head(heads: int) -> float:
    """Warp-instructions per 32 tokens and packed head that keep each head's P to its own query rows
    (8 rows: 4 registers of P per 32 tokens): none for one head, an AND per register for two
    (kernel.py's _and_p), else a SEL per half and two PRMT per register."""
    return 0.0 if heads == 1 else 4.0 if heads == 2 else 16.0


#: warp-instructions per 32 tokens: per head, shared by the packed heads; and per tile
PER_HEAD_PER_32_TOKENS = {"sm_90": 50.7}
SHARED_PER_32_TOKENS = {"sm_90": 164.0}
PER_TILE = {"sm_90": 94.5}
#: warp-instructions per 32 tokens for each channel group past the first, per side: shared, per head
GROUP_SHARED_PER_32_TOKENS = {"sm_90": 24.1}
GROUP_PER_HEAD_PER_32_TOKENS = {"sm_90": 5.5}


def token_loop_instructions_per_tile(arch: str, bits: int, head_dim: int, heads: int = 1, block_n: int = 32,
                                     key_groups: int = 1, value_groups: int = 1,
                                     value_bits: int | None = None) -> float:
    """Warp-instructions one program issues per tile of ``block_n`` tokens of ``heads`` KV heads
    (token-wise K at ``bits`` and V at ``value_bits``, default the same, with ``key_groups`` /
    ``value_groups`` channel groups per token): the fit above."""
    if arch not in PER_TILE:
        raise ValueError(f"arch={arch!r} has no measured token-loop figure; use one of {sorted(PER_TILE)}")
    value_bits = bits if value_bits is None else value_bits
    build = head_dim * (key_construction(bits) + value_construction(value_bits))   # per 32 tokens per head
    per_32 = heads * (build + p_mask_per_head(heads) + PER_HEAD_PER_32_TOKENS[arch]) + SHARED_PER_32_TOKENS[arch]
    extra_groups = key_groups - 1 + value_groups - 1
    per_32 += extra_groups * (GROUP_SHARED_PER_32_TOKENS[arch] + heads * GROUP_PER_HEAD_PER_32_TOKENS[arch])
    return block_n / 32 * per_32 + PER_TILE[arch]


def token_loop_lane_slots_per_byte(arch: str, bits: int, head_dim: int, param_bytes: int = 2,
                                   heads: int = 1, block_n: int = 32, key_groups: int = 1,
                                   value_groups: int = 1, value_bits: int | None = None) -> float:
    """Issue demand of the register-operand kernel's whole token loop per byte it reads (token-wise
    K at ``bits`` and V at ``value_bits`` (default the same), fp16 scale and zero per channel group of
    each token): construction of both operands plus the per-token and per-tile work, part of which
    the ``heads`` KV heads packed into one program share."""
    value_bits = bits if value_bits is None else value_bits
    bytes_per_tile = heads * block_n * (head_dim * (bits + value_bits) / 8
                                        + 2 * param_bytes * (key_groups + value_groups))
    return 32 * token_loop_instructions_per_tile(arch, bits, head_dim, heads, block_n, key_groups,
                                                 value_groups, value_bits) / bytes_per_tile
