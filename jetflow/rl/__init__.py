"""RL math for GRPO: advantages, policy loss, rollout correction, mismatch metrics.

Pure tensor code: imports torch and the standard library only, nothing else from jetflow.
"""

from .advantage import NORMS, group_advantages
from .correction import (
    CORRECTIONS,
    CorrectionResult,
    ais_diagnostics,
    apply_correction,
    correction_parameters,
)
from .loss import AGGREGATIONS, agg_denominator, aggregate, policy_loss
from .mismatch import LOW_PROB_THRESHOLD, low_prob_metrics, mismatch_metrics, mismatch_position_curves, split_mismatch

__all__ = [
    "LOW_PROB_THRESHOLD",
    "AGGREGATIONS",
    "CORRECTIONS",
    "NORMS",
    "CorrectionResult",
    "agg_denominator",
    "aggregate",
    "ais_diagnostics",
    "apply_correction",
    "correction_parameters",
    "group_advantages",
    "low_prob_metrics",
    "mismatch_metrics",
    "mismatch_position_curves",
    "split_mismatch",
    "policy_loss",
]
