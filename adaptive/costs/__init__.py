"""Costs: the pure arithmetic of speculative decoding (:mod:`.model`), its measurement (:mod:`.measure`) and
how busy the machine was meanwhile (:mod:`.busy`)."""

from adaptive.costs.busy import BUSY_SHARE, CpuWatch, busy_warning, is_busy, others_share
from adaptive.costs.measure import (
    measure_costs,
    measure_draft_cost,
    measure_head_costs,
    measure_prefill,
    measure_verify_costs,
)
from adaptive.costs.model import (
    STAT_DRAFT_COST,
    CostModel,
    acceptance_needed,
    best_draft_length,
    best_split,
    cascade_expected_tokens,
    cascade_speedup,
    expected_speedup,
    expected_tokens_per_step,
    extrapolate,
    interpolate_points,
    reach,
    verify_table,
)

__all__ = ["BUSY_SHARE", "STAT_DRAFT_COST", "CostModel", "CpuWatch", "busy_warning", "is_busy", "others_share",
           "acceptance_needed", "best_draft_length", "best_split",
           "cascade_expected_tokens", "cascade_speedup", "expected_speedup", "expected_tokens_per_step",
           "extrapolate", "interpolate_points", "measure_costs", "measure_draft_cost", "measure_head_costs",
           "measure_prefill", "measure_verify_costs",
           "reach", "verify_table"]
