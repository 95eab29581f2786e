"""Sampler/trainer mismatch: how far the sampler's log-probs are from the trainer's, and the
truncated importance-sampling (TIS) weights that correct for it.

    out = sampler_mismatch(sampler_logp, trainer_logp, mask, mode="token", cap=2.0)  # whole rollout batch
    policy_loss(..., weights=out.weights[rows])    # (B, T) detached multiplier of the policy term
    metrics = mismatch_stats(out.sums)             # after combining micro-batches and ranks (`combine`)

The sampler (vLLM, bf16 kernels, its own top-p) and the trainer (transformers, a different kernel
and reduction order) give the same tokens different probabilities even with identical weights, so
the rollout comes from pi_sampler while the update treats it as pi_old. With d = log pi_old(y_t) -
log pi_sampler(y_t) (pi_old: the trainer's log-probs of the rollout policy, `sampler.old_logp:
recompute`):

    token     w_t = min(exp(d_t), C)                    one weight per token
    sequence  w_t = min(exp(sum_t' d_t'), C)            one weight per sequence, on all its tokens

C is `sampler.mismatch_is_cap`, default 2 as verl's (`algorithm.rollout_correction.rollout_is:
token | sequence`, `rollout_is_threshold: 2.0`); the correction is Yao et al. 2025's "truncated
importance sampling" (Your efficient RL framework secretly brings you off-policy RL training).
With `sampler.old_logp: sampler` (verl's bypass mode) the clipped ratio is already taken against
the sampler, so the correction is not offered there. The weights are
detached: they re-weight the policy-gradient term, they are not differentiated. The exponent is
clamped at log C before exp, so no weight overflows.

It runs once per rollout batch (the old log-probs exist for the whole batch before the update).
The metrics are kept as sums (and a maximum, its key ending in `/max`) so that micro-batches and
ranks combine exactly by the objectives' rule (`clipbench.objectives.combine`, `reduction`): mean
and max |d| over valid tokens always, and with a correction the mean weight and the share of
tokens (or sequences) at the cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MODES = ("none", "token", "sequence")


@dataclass
class Mismatch:
    weights: torch.Tensor | None     # (B, T) detached TIS weights (0 at padding); None for mode "none"
    sums: dict[str, torch.Tensor]    # 0-d tensors; keys ending in /max combine by max, the others add


def sampler_mismatch(sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor, *,
                     mode: str = "none", cap: float = 2.0, counted: torch.Tensor | None = None) -> Mismatch:
    """TIS weights and mismatch sums of one batch.

    sampler_logp, trainer_logp: (B, T) log-probs of the sampled tokens under the sampler and under
    the trainer's rollout policy; mask: (B, T) 1 on completion tokens; counted: bool, broadcastable
    to (B, T), the tokens the sums count (default all: a rank counts its own rows, so that the sums
    of all ranks cover the batch once; the weights are every row's). Nothing here syncs the host."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not (math.isfinite(cap) and cap >= 1):
        raise ValueError(f"cap must be a finite number >= 1, got {cap!r}")
    if not sampler_logp.shape == trainer_logp.shape == mask.shape:
        raise ValueError(f"sampler_logp {tuple(sampler_logp.shape)}, trainer_logp {tuple(trainer_logp.shape)} "
                         f"and mask {tuple(mask.shape)} must have the same (B, T) shape")
    valid = mask > 0                                                        # (B, T)
    count = valid if counted is None else valid & counted                  # (B, T): what the sums count
    d = torch.where(valid, trainer_logp.detach().float() - sampler_logp.detach().float(), 0.0)  # (B, T)
    dc = torch.where(count, d, 0.0).abs()                                   # (B, T)
    sums = {"mismatch/abs_sum": dc.sum(), "mismatch/tokens": count.sum().float(),
            "mismatch/abs/max": dc.max() if dc.numel() else dc.new_zeros(())}
    if mode == "none":
        return Mismatch(None, sums)
    log_cap = math.log(cap)
    if mode == "token":
        w = torch.exp(d.clamp(max=log_cap))                                 # (B, T)
        units, capped = count, count & (d > log_cap)                        # per token
    else:
        seq = d.sum(-1, keepdim=True)                                       # (B, 1)
        w = torch.exp(seq.clamp(max=log_cap)).expand_as(d)                 # (B, T)
        units = count.any(-1, keepdim=True)                                 # (B, 1): sequences with a token
        capped = units & (seq > log_cap)
    w = torch.where(valid, w, 0.0)
    per_unit = w if mode == "token" else w[:, :1]                           # one weight per token / sequence
    sums.update({"mismatch/is_weight_sum": (per_unit * units).sum(), "mismatch/is_capped": capped.sum().float(),
                 "mismatch/is_units": units.sum().float()})
    return Mismatch(w, sums)


def mismatch_stats(sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Logged metrics from (combined) sums: mismatch/abs_mean, mismatch/abs_max, and with a
    correction mismatch/is_weight_mean and mismatch/is_capped_frac."""
    f = {k: float(v) for k, v in sums.items()}
    out = {"mismatch/abs_mean": f["mismatch/abs_sum"] / max(f["mismatch/tokens"], 1.0),
           "mismatch/abs_max": f["mismatch/abs/max"]}
    if "mismatch/is_units" in f:
        units = max(f["mismatch/is_units"], 1.0)
        out.update({"mismatch/is_weight_mean": f["mismatch/is_weight_sum"] / units,
                    "mismatch/is_capped_frac": f["mismatch/is_capped"] / units})
    return out

