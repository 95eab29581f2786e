"""Sampler/trainer corrections: an axis of their own, next to the rule and the aggregation.

The sampler (vLLM, its own kernels and reduction order) and the trainer give the same tokens
different probabilities even with identical weights, so the rollout comes from pi_sampler while the
update treats it as pi_old. With d = log rho = log pi_old(y_t) - log pi_sampler(y_t) (pi_old: the
trainer's log-probs of the rollout policy, `sampler.old_logp: recompute`), a correction turns d into
a detached per-token weight of the policy term (`policy_loss(..., weights=)`): truncated importance
sampling, IcePop's token mask, sequence masks, verl's rejection sampling (builtin.py; `clipbench
methods` lists them). With `sampler.old_logp: sampler` the rule's ratio is already taken against the
sampler (rho = 1), so no correction is offered there.

    out = apply_correction({"name": "tis", "cap": 2.0}, sampler_logp, trainer_logp, mask)  # whole rollout batch
    policy_loss(..., weights=out.weights[rows], correction_status=out.status[rows])
    metrics = correction_stats(out.sums)             # after combining micro-batches and ranks

It runs once per rollout batch (the old log-probs exist for the whole batch before the update): the
weights of a token depend on its own row only, so they are exact under any micro-batch or rank split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clipbench.objectives.corrections import builtin as _builtin  # noqa: F401  (registers the built-ins)
from clipbench.objectives.corrections.apply import (
    Corrected,
    apply_correction,
    correction_stats,
    is_batch_metric,
    mismatch_sums,
)
from clipbench.objectives.corrections.registry import (
    CORRECTION_INPUTS,
    CORRECTIONS,
    KEPT,
    MASKED,
    NONE,
    REJECTED,
    STATUS,
    TRUNCATED,
    Applied,
    CorrectionSpec,
    applied,
    correction,
    correction_names,
    correction_params,
    describe,
    get_correction,
    validate_correction,
)

MODES = ("none", "token", "sequence")  # the former sampler.mismatch_is values (truncated IS)


def legacy_setting(mode: str, cap: float = 2.0) -> dict:
    """The correction of the former `sampler.mismatch_is` / `mismatch_is_cap` keys (unchanged in value)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return {"name": NONE} if mode == "none" else {"name": "tis", "level": mode, "cap": cap}


@dataclass
class Mismatch:
    weights: torch.Tensor | None
    sums: dict[str, torch.Tensor]


def sampler_mismatch(
    sampler_logp, trainer_logp, mask, *, mode: str = "none", cap: float = 2.0, counted: torch.Tensor | None = None
) -> Mismatch:
    """Truncated IS by its former name (mode none | token | sequence, cap C): `apply_correction` of
    `legacy_setting(mode, cap)`."""
    out = apply_correction(legacy_setting(mode, cap), sampler_logp, trainer_logp, mask, counted=counted)
    return Mismatch(out.weights, out.sums)


mismatch_stats = correction_stats

__all__ = [
    "Applied",
    "CORRECTIONS",
    "CORRECTION_INPUTS",
    "Corrected",
    "CorrectionSpec",
    "KEPT",
    "MASKED",
    "MODES",
    "Mismatch",
    "NONE",
    "REJECTED",
    "STATUS",
    "TRUNCATED",
    "applied",
    "apply_correction",
    "correction",
    "correction_names",
    "correction_params",
    "correction_stats",
    "describe",
    "get_correction",
    "is_batch_metric",
    "legacy_setting",
    "mismatch_stats",
    "mismatch_sums",
    "sampler_mismatch",
    "validate_correction",
]
