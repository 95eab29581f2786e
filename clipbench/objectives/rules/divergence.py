"""Trust regions that are not a ratio clip, and plain or tapered policy gradient: GPG, the unclipped
importance-sampled surrogate, TOPR, DRO's and Kimi k1.5's quadratic log-ratio penalties, CFPO's
quadratic ratio penalty, DPPO's binary TV / KL regions, Clip-Cov and KL-Cov's covariance-selected
tokens (verl).
"""

from __future__ import annotations

from typing import Literal

import torch

from clipbench.objectives.primitives import first_k, masked_mean, past_bound, ppo_clip, share_of_tokens
from clipbench.objectives.registry import rule
from clipbench.objectives.rules.common import EPS_CHECKS, VERL, clip_bounds
from clipbench.objectives.signature import nonneg, positive, unit_interval


@rule("gpg", source=f"GPG (arXiv 2504.02546); {VERL} `gpg`")
def gpg(logp, A):
    """-logp*A: GPG, plain policy gradient with no ratio and no clip"""
    return -logp * A


@rule(
    "unclipped",
    source="the importance-sampled policy-gradient surrogate of PPO (arXiv 1707.06347, L^CPI) with no clip; "
    "the positive control for the ratio clips off-policy",
)
def unclipped(r, A):
    """-r*A: the importance-sampled surrogate with no band (PPO's L^CPI), gradient -A*r*dlogp everywhere

    GRPO's gradient wherever GRPO's ratio stays in its band: the control that shows what a clip does
    once the data is off-policy (sampler.lag, docs/lag.md), since nothing here stops a token's ratio
    from growing: -A*r on every token, unbounded where GRPO's ratio leaves its band.
    """
    return -r * A


@rule("dro", source=f"{VERL} `dro` (verl#7245, docs/algo/dro.md)", checks={"dro_beta": positive})
def dro(logp, log_ratio, A, *, dro_beta: float = 0.05):
    """-(logp*A - dro_beta/2*(logp - old_logp)^2): DRO, policy gradient with a quadratic log-ratio penalty in place of a clip

    verl requires dro_beta to be set (no default); 0.05 is the value of verl's own test. DRO expects
    advantages built for its soft off-policy formulation.
    """
    return -(logp * A - 0.5 * dro_beta * log_ratio.square())


@rule(
    "kimi15",
    source="Kimi k1.5 (arXiv 2501.12599) Eq. 3; alibaba/ROLL @ 8eb27cc roll/pipeline/rlvr/actor_pg_worker.py "
    "_compute_kimi15_loss (pg_variant=kimi15, kimi15_tau 0.1)",
    checks={"tau": nonneg},
)
def kimi15(logp, log_ratio, A, *, tau: float = 0.1):
    """-A*logp + tau/2*(logp - old_logp)^2: Kimi k1.5's policy gradient with a squared log-ratio penalty

    The same loss as dro with dro_beta = tau (ROLL's default 0.1, verl's test 0.05). No ratio, no
    clip: the penalty pulls every token back toward old_logp, zero-advantage tokens included.
    """
    return -A * logp + 0.5 * tau * log_ratio.square()


@rule(
    "cfpo",
    source="CFPO, clip-free policy optimisation (arXiv 2601.22801); verl-project/verl PR #5252 @ 18bd5cd "
    "verl/trainer/ppo/core_algos.py compute_policy_loss_cfpo (epsilon = actor clip_ratio, 0.2)",
    checks={"eps": positive},
    band=lambda p: (1 - p["eps"], 1 + p["eps"]) * 2,
    bounds=lambda p: {
        "penalty": "|A| (r - 1)^2 / (2 eps)",
        "stationary_pos": 1 + p["eps"],
        "stationary_neg": 1 - p["eps"],
    },
)
def cfpo(r, A, *, eps: float = 0.2):
    """-(r*A - |A|*(r - 1)^2/(2*eps)): CFPO, a quadratic penalty on the ratio in place of PPO's clip

    The gradient -A*r + |A|*(r - 1)*r/eps is zero at r = 1 + eps (A>0) / 1 - eps (A<0), the PPO
    bound, and pushes the ratio back past it instead of vanishing: never zero for A != 0 off the
    stationary point. eps is verl's clip_ratio (one value for both sides, as the PR; engine: verl
    sets it). Reference band [1-eps, 1+eps].
    """
    return -(r * A - A.abs() * (r - 1).square() / (2 * eps))


_DPPO_CHECKS = {"div_low": nonneg, "div_high": nonneg, "is_cap": positive}


@rule(
    "dppo_tv",
    source=f"DPPO (arXiv 2602.04879); {VERL} `dppo_tv`",
    checks=_DPPO_CHECKS,
    bounds=lambda p: {"tv_low": p["div_low"], "tv_high": p["div_high"], "is_cap": p["is_cap"]},
)
def dppo_tv(r, A, logp, old_logp, *, div_low: float = 0.15, div_high: float = 0.15, is_cap: float = 20.0):
    """-A*sg(min(r, is_cap))*logp while p - q <= div_high (A>0) / p - q >= -div_low (A<=0), else 0: DPPO-Binary-TV

    p = exp(logp), q = exp(old_logp): the trust region is on the probability change (total
    variation of the binary distribution), not on the ratio. Thresholds: verl's example
    (clip_ratio 0.15); is_cap is verl's code default (its actor config's clip_ratio_c = 3.0 applies
    unless overridden; the paper recommends a large cap).
    """
    p, q = logp.detach().exp(), old_logp.exp()
    inside = torch.where(A > 0, p - q <= div_high, p - q >= -div_low)
    return torch.where(inside, -A * torch.clamp(r, max=is_cap).detach() * logp, 0.0)


@rule(
    "dppo_kl",
    source=f"DPPO (arXiv 2602.04879); {VERL} `dppo_kl`",
    checks=_DPPO_CHECKS,
    bounds=lambda p: {"kl_low": p["div_low"], "kl_high": p["div_high"], "is_cap": p["is_cap"]},
)
def dppo_kl(r, A, logp, old_logp, *, div_low: float = 0.05, div_high: float = 0.05, is_cap: float = 20.0):
    """-A*sg(min(r, is_cap))*logp while the binary KL(q || p) stays within div_high (A>0) / div_low (A<=0) or p moved back, else 0: DPPO-Binary-KL

    KL = q*log(q/p) + (1-q)*log((1-q+1e-8)/(1-p+1e-8)); an A>0 token with p <= q (an A<=0 token with
    p >= q) is always inside. Thresholds: verl's example (clip_ratio 0.05).
    """
    lp = logp.detach()
    p, q = lp.exp(), old_logp.exp()
    kl = q * (old_logp - lp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    inside = torch.where(A > 0, (kl <= div_high) | (p <= q), (kl <= div_low) | (p >= q))
    return torch.where(inside, -A * torch.clamp(r, max=is_cap).detach() * logp, 0.0)


@rule(
    "clip_cov",
    source=f"Clip-Cov (arXiv 2505.22617); {VERL} `clip_cov`",
    per_call=True,
    checks={**EPS_CHECKS, "clip_cov_ratio": unit_interval},
    bounds=lambda p: {**clip_bounds(p), "per_call": "covariance, token count and random choice per call"},
)
def clip_cov(
    r,
    A,
    logp,
    mask,
    u,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
):
    """grpo, with a random clip_cov_ratio share of the tokens whose (A - mean A)(logp - mean logp) lies in (lb, ub) detached: Clip-Cov

    The candidates are valid tokens that grpo did not clip; max(int(clip_cov_ratio * tokens), 1) of
    them (fewer if there are fewer) get zero loss and gradient, picked by the smallest u (verl:
    torch.randperm). Per call, as in verl: the means, the token count and the choice range over
    this call's tokens (verl's micro-batch), so it is exact over micro-batch splits only unsplit.
    """
    loss = ppo_clip(r, A, 1 - eps_low, 1 + eps_high)
    cov = (A - masked_mean(A, mask)) * (logp - masked_mean(logp, mask)).detach()  # (B, T)
    clipped = past_bound(r.detach(), A, 1 - eps_low, 1 + eps_high) > 0
    candidate = (mask > 0) & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    chosen = first_k(u, candidate, share_of_tokens(clip_cov_ratio, mask))
    return torch.where(chosen, torch.zeros_like(loss), loss)


@rule(
    "kl_cov",
    source=f"KL-Cov (arXiv 2505.22617); {VERL} `kl_cov`",
    per_call=True,
    checks={"kl_cov_ratio": unit_interval, "ppo_kl_coef": nonneg},
    bounds=lambda p: {"per_call": "covariance and token count per call"},
)
def kl_cov(r, A, logp, log_ratio, mask, *, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1):
    """-r*A, plus ppo_kl_coef*|logp - old_logp| on the kl_cov_ratio share of tokens of largest (A - mean A)(logp - mean logp): KL-Cov

    max(int(kl_cov_ratio * tokens), 1) tokens get the penalty (ties: the earlier position); no clip.
    Per call, as in verl: the means, the token count and the top-k range over this call's tokens.
    The default coefficient is verl's config default (its code falls back to 1.0 when unset).
    """
    cov = (A - masked_mean(A, mask)) * (logp - masked_mean(logp, mask)).detach()  # (B, T)
    top = first_k(-cov, mask > 0, share_of_tokens(kl_cov_ratio, mask))
    return -r * A + torch.where(top, ppo_kl_coef * log_ratio.abs(), 0.0)


@rule(
    "topr",
    source="TOPR (arXiv 2503.14286); alibaba/ROLL @ 8eb27cc roll/pipeline/rlvr/actor_pg_worker.py "
    "_compute_topr_loss (pg_variant=topr; actor_train.topr_positive_weight / topr_negative_weight)",
    checks={"positive_weight": nonneg, "negative_weight": nonneg},
    bounds=lambda p: {
        "truncation": "[0, 1]",
        "split": "reward > 0" if p["zero"] == "negative" else "reward >= 0",
        "ratio_truncated": p["ratio"],
    },
)
def topr(
    r,
    A,
    logp,
    log_ratio,
    reward,
    *,
    zero: Literal["negative", "positive"] = "negative",
    ratio: Literal["token", "sequence"] = "token",
    positive_weight: float = 1.0,
    negative_weight: float = 1.0,
):
    """-positive_weight*A*logp if reward > 0, else -negative_weight*sg(min(r, 1))*A*logp: TOPR, plain policy gradient on positive-reward sequences, truncated IS on the rest

    The split is on the sequence's reward, never on the sign of A (ROLL: score > 0 vs score <= 0;
    zero=positive sends a zero reward to the plain branch, the paper's R >= 0). ratio=token
    truncates each token's ratio (ROLL); sequence truncates the trajectory ratio exp(sum_t log r)
    (the paper). The weight is the advantage A (ROLL); the paper's is the reward R.
    """
    plain = reward > 0 if zero == "negative" else reward >= 0  # (B, 1)
    w = (
        torch.clamp(r, max=1.0)
        if ratio == "token"
        else torch.exp(torch.clamp(log_ratio.sum(-1, keepdim=True), max=0.0))
    )
    return torch.where(plain, -positive_weight * A * logp, -negative_weight * w.detach() * A * logp)
