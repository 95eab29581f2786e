"""The RL math, trainer-free: clip rules, aggregation, diagnostics, advantages, corrections, the KL.

    from clipbench.objectives import policy_loss, METHODS, AGGREGATIONS, validate_params, rule
    out = policy_loss("grpo", logp, old_logp, advantages, mask, agg="token-mean", eps_high=0.28)
    out.loss, out.token_loss, out.stats, out.sums
    bound = bind("grpo", {"eps_high": 0.28}, agg="token-mean")           # once per run: looked up, validated
    out = bound(RuleInputs.of(logp=logp, old_logp=old_logp, advantages=A, mask=mask,
                              counts=Counts(global_tokens=n)))           # per micro-batch: one bundle in

The rules are in rules/ (each reads as its formula; shared formulas in primitives.py); a user's own rule is one decorated function
(docs/plugins.md). The math contract is docs/objectives.md; internal contracts in docs/architecture.md.
"""

from clipbench.errors import RuleDefinitionError, RuleError
from clipbench.objectives import rules as _rules  # noqa: F401  (registers every built-in method)
from clipbench.objectives.aggregation import AGGREGATIONS, aggregate, global_counts
from clipbench.objectives.diagnostics import (
    CELLS,
    COUNTS,
    MASSES,
    all_reduce_sums,
    combine,
    finalize,
    histogram_dict,
    log_ratio_counts,
    log_ratio_histogram,
    reduce_sums,
    reduction,
)
from clipbench.objectives.inputs import Counts, RuleInputs
from clipbench.objectives.loss import BoundRule, PolicyLossOutput, bind, policy_loss
from clipbench.objectives.primitives import LOG_RATIO_CLAMP, kl_k3
from clipbench.objectives.registry import (
    METHODS,
    MethodSpec,
    PluginOrigin,
    effective_bounds,
    reads_rollout_logp,
    rule,
    validate_params,
)
from clipbench.objectives.signature import INPUTS, Param, greater_than_one, nonneg, positive, unit_interval

__all__ = [
    "AGGREGATIONS",
    "BoundRule",
    "CELLS",
    "COUNTS",
    "Counts",
    "INPUTS",
    "LOG_RATIO_CLAMP",
    "MASSES",
    "METHODS",
    "MethodSpec",
    "Param",
    "PluginOrigin",
    "PolicyLossOutput",
    "RuleDefinitionError",
    "RuleError",
    "RuleInputs",
    "aggregate",
    "all_reduce_sums",
    "bind",
    "combine",
    "effective_bounds",
    "finalize",
    "global_counts",
    "greater_than_one",
    "kl_k3",
    "histogram_dict",
    "log_ratio_counts",
    "log_ratio_histogram",
    "nonneg",
    "policy_loss",
    "positive",
    "reduce_sums",
    "reduction",
    "rule",
    "unit_interval",
    "reads_rollout_logp",
    "validate_params",
]
