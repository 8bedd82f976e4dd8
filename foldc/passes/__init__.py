"""The fold passes, in pipeline order. Each cites the equation of docs/derivation.md it applies."""
from .axis_analysis import AxisAnalysis, encoded_operand, fold_from_axes
from .base import Pass, PassRecord, run_pipeline
from .break_even import BreakEven, FoldCosts, fold_cost, rows_sharing_group
from .fold_rewrite import FoldRewrite, check_code_bias
from .ordering import Ordering, TileConstraint, check_plan_rules, check_spec_inputs, tile_constraints


FOLD_POLICIES = ("auto", "dequant")


def default_passes(code_bias=None, fold_policy: str = "auto", rows_per_program: int | None = None,
                   fold_costs: FoldCosts | None = None) -> list[Pass]:
    return [AxisAnalysis(), BreakEven(policy=fold_policy, rows_per_program=rows_per_program, costs=fold_costs),
            FoldRewrite(code_bias=dict(code_bias or {})), Ordering()]


__all__ = [
    "FOLD_POLICIES", "AxisAnalysis", "BreakEven", "FoldCosts", "FoldRewrite", "Ordering", "Pass", "PassRecord",
    "TileConstraint", "check_code_bias", "check_plan_rules", "check_spec_inputs", "default_passes", "encoded_operand",
    "fold_cost", "fold_from_axes", "rows_sharing_group", "run_pipeline", "tile_constraints",
]
