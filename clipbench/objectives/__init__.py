"""Clip objectives: the registry of policy-loss rules, aggregation and clipping diagnostics.

    from clipbench.objectives import policy_loss, METHODS, AGGREGATIONS, validate_params
    out = policy_loss("grpo", logp, old_logp, advantages, mask, agg="token-mean", eps_high=0.28)
    out.loss, out.token_loss, out.stats

The math contract is ../shared/docs/objectives.md; internal contracts in docs/architecture.md.
"""

from clipbench.objectives import rules as _rules  # noqa: F401  (registers every method)
from clipbench.objectives.aggregation import AGGREGATIONS, aggregate
from clipbench.objectives.context import RatioContext, RuleOut
from clipbench.objectives.diagnostics import CELLS, COUNTS, log_ratio_histogram
from clipbench.objectives.loss import PolicyLossOutput, kl_k3, policy_loss
from clipbench.objectives.registry import (LOG_RATIO_CLAMP, METHODS, MethodSpec, Param, effective_bounds,
                                           register, validate_params)

__all__ = [
    "AGGREGATIONS", "CELLS", "COUNTS", "LOG_RATIO_CLAMP", "METHODS", "MethodSpec", "Param", "PolicyLossOutput",
    "RatioContext", "RuleOut", "aggregate", "effective_bounds", "kl_k3", "log_ratio_histogram", "policy_loss",
    "register", "validate_params",
]
