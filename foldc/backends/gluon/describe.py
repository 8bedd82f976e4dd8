"""`foldc explain`'s paragraph on the register-operand kernel (registered as the gluon backend's
``describe``, foldc/registry.py)."""
from __future__ import annotations

from ...cost import GPUS, token_loop_lane_slots_per_byte
from ...errors import PlanError
from ...registry import attention_backend
from .launch import GluonAttention
from .lower import NotLowerable, gluon_plan, lower
from .warpgroup_launch import ROWS as TEMPLATE_ROWS
from .warpgroup_launch import warpgroup_applies


def describe(spec) -> str:
    """The register-operand kernel's paragraph, and where the warpgroup template takes the layout, a sentence on it."""
    text = _one_warp(spec)
    if warpgroup_applies(spec, "sm_90"):
        padding = TEMPLATE_ROWS - spec.q_per_kv
        text += (f". On sm_90 a contiguous cache (capacity a multiple of 8 tokens) at the launcher's defaults runs the "
                 f"warpgroup template instead: four warps sharing wgmma, a KV head's {TEMPLATE_ROWS} rows in one "
                 "program" + (f" ({padding} of them padding)" if padding else "") + " (docs/register_operands.md)")
    return text


def _one_warp(spec) -> str:
    """What the whole token loop of the sm_90 register-operand kernel asks of the H200's issue slots,
    where the spec lowers to it: the budget row above counts operand construction only, the loop
    also runs the online softmax, the per-token scales, addressing and barriers."""
    try:
        cfg = lower(gluon_plan(spec))
    except NotLowerable as e:
        triton = attention_backend("triton")
        ok, why = triton.lowerable(spec, "bf16")
        runs = "the generated Triton kernel runs it" if ok else \
            f"nor does the generated Triton kernel ({why}): only the float64 executor (target='reference') runs it"
        if ok:
            try:
                triton.target_plan(spec, "bf16")
            except PlanError as err:   # its default plan finds no operand precision (eq. 6a) either
                if err.rule != "precision":
                    raise
                runs = f"the generated Triton kernel runs it only with fold_policy='dequant' ({err.detail})"
        return f"register-operand kernel (sm_90): not used for this layout ({e}); {runs}"
    launcher = GluonAttention(spec)          # its defaults: KV heads per program and tokens per tile
    heads, block_n = launcher.heads, launcher.default_block_n
    blocks = f", {cfg.row_blocks} row blocks of {cfg.q_per_kv} query rows per KV head" if cfg.row_blocks > 1 else ""
    if cfg.head_rows:   # ragged: the last block takes the rest
        blocks += f" (the last {cfg.head_rows - (cfg.row_blocks - 1) * cfg.q_per_kv})"
    if cfg.key_tokens or cfg.value_tokens or cfg.key_plain or cfg.value_plain or cfg.rows == 16 or cfg.width > 128 \
            or cfg.narrow or cfg.padded_dim:
        return (f"register-operand kernel (sm_90, sm_100), {heads} KV head(s) per program{blocks}: no fitted "
                "whole-loop figure for this layout (the fit covers token-wise sides, 8 query rows per MMA, head_dim "
                "<= 128, eight or more words per token); `foldc compile --target sm_90` reports the SASS count per tile (instructions_per_tile) and "
                "docs/perf.md (\"Layout grid\") has its H200 time")
    h200 = next(g for g in GPUS if g.name == "H200")
    demand = token_loop_lane_slots_per_byte("sm_90", cfg.key_bits, cfg.head_dim, heads=heads, block_n=block_n,
                                            key_groups=cfg.key_groups, value_groups=cfg.value_groups,
                                            value_bits=cfg.value_bits)
    groups = "" if cfg.key_groups == cfg.value_groups == 1 else \
        f", {cfg.key_groups} K and {cfg.value_groups} V channel group(s) per token"
    return (f"register-operand kernel (sm_90, sm_100), whole token loop with {heads} KV head(s) per program and "
            f"{block_n}-token tiles{groups} (fitted to its SASS): {demand:.2f} of the {h200.name}'s "
            f"{h200.lane_slots_per_byte:.2f} lane-slots/byte "
            f"({100 * demand / h200.lane_slots_per_byte:.0f}% of the issue slots at full bandwidth; warps that wait "
            "on their own latencies kept the issue slots busy 47% of the time on the H200 at INT2 8 x 64K, Nsight "
            "Compute, docs/perf.md)")
