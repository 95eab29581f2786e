"""Sequence-level ratios: GSPO (and its per-token form), LUSPO, GMPO's geometric mean, VESPO's
gamma weight. The cells use GSPO's s where the rule declares level='sequence'.
"""

from __future__ import annotations

import math

import torch

from clipbench.objectives.primitives import ppo_clip
from clipbench.objectives.registry import interval, rule
from clipbench.objectives.rules.common import EPS_CHECKS, TRL, VERL, clip_bounds
from clipbench.objectives.signature import nonneg

_GSPO_SRC = "GSPO (arXiv 2507.18071)"


@rule("gspo", source=_GSPO_SRC, level="sequence", checks=EPS_CHECKS, bounds=clip_bounds)
def gspo(s, A, *, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """-min(s*A, clip(s, 1-eps_low, 1+eps_high)*A), s = exp(mean_t(logp - old_logp)): sequence ratio, hard clip

    s is the mean over the sequence's valid tokens. Returns (B, 1): the whole sequence's gradient
    is zero when clipped.
    """
    return ppo_clip(s, A, 1 - eps_low, 1 + eps_high)


@rule("gspo_token", source=_GSPO_SRC + ", GSPO-token", level="sequence", checks=EPS_CHECKS, bounds=clip_bounds)
def gspo_token(s, logp, A, *, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """grpo's rule on s_tok = sg(s)*exp(logp - sg(logp)): GSPO-token, per-token s_tok with gspo's value and gradient

    s_tok has the value s and d s_tok / d logp_t = s, so each token carries the sequence's clip
    decision: the same gradient as gspo when the advantages are per sequence (tested).
    """
    s_tok = s.detach() * torch.exp(logp - logp.detach())  # (B, T)
    return ppo_clip(s_tok, A, 1 - eps_low, 1 + eps_high)


@rule(
    "luspo",
    source=f"LUSPO (arXiv 2602.05261); {TRL} loss_type='luspo'",
    level="sequence",
    checks=EPS_CHECKS,
    bounds=clip_bounds,
)
def luspo(s, A, mask, *, eps_low: float = 2e-3, eps_high: float = 2.5e-3):
    """|y|*(-min(s*A, clip(s, 1-eps_low, 1+eps_high)*A)), |y| = the sequence's tokens: LUSPO, GSPO's sequence loss scaled by its length

    Returns (B, 1). TRL averages it over sequences: use agg=seq-mean-token-mean (then luspo equals
    gspo under seq-mean-token-sum). eps: the paper's section 5.1.
    """
    return mask.sum(-1, keepdim=True) * ppo_clip(s, A, 1 - eps_low, 1 + eps_high)


@rule(
    "geo_mean",
    source=f"GMPO (arXiv 2507.20673); {VERL} `geo_mean`",
    checks=EPS_CHECKS,
    band=lambda p: (math.exp(-p["eps_low"]), math.exp(p["eps_high"])) * 2,
    bounds=lambda p: {"log_ratio_clip": interval(-p["eps_low"], p["eps_high"])},
)
def geo_mean(log_ratio, A, mask, *, eps_low: float = 0.4, eps_high: float = 0.4):
    """-A*exp(mean_t sgn(A)*min(sgn(A)*lr, sgn(A)*clip(lr, -eps_low, eps_high))): GMPO, geometric mean of the token ratios, clipped per token in log space

    Returns (B, 1) (verl averages it over sequences: agg=seq-mean-token-mean); the mean divides by
    (tokens + 1e-8) as verl does. Clipped tokens get zero gradient. eps_low and eps_high are in log
    space: the reference band is (e^-eps_low, e^eps_high); 0.4 is the paper's (e^-0.4, e^0.4) range
    (verl's config default would be 0.2).
    """
    sgn = torch.sign(A)
    lr = sgn * torch.minimum(sgn * log_ratio, sgn * torch.clamp(log_ratio, -eps_low, eps_high))
    return -A * torch.exp((lr * mask).sum(-1, keepdim=True) / (mask.sum(-1, keepdim=True) + 1e-8))


@rule(
    "vespo",
    source=f"VESPO (arXiv 2602.10693); {TRL} loss_type='vespo' (get_gamma_weights)",
    level="sequence",
    checks={"k_pos": nonneg, "k_neg": nonneg, "lambda_pos": nonneg, "lambda_neg": nonneg},
)
def vespo(
    log_ratio,
    A,
    logp,
    mask,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
):
    """-sg(phi(W))*A*logp, phi(W) = W^k * exp(lambda*(1 - W)), W = prod_t r_t: VESPO's gamma weight on the sequence ratio

    (k, lambda) = (k_pos, lambda_pos) for A >= 0 else (k_neg, lambda_neg), lambda >= 1e-4; log W sums
    the per-token log-ratios clamped to +-20, then is clamped to [log 1e-8, 20] (as TRL). TRL folds
    vLLM's importance-sampling correction into W; here it is the trainer's `weights` instead.
    """
    log_w = torch.clamp((torch.clamp(log_ratio, -20, 20) * mask).sum(-1, keepdim=True), math.log(1e-8), 20).detach()
    k = torch.where(A >= 0, k_pos, k_neg)
    lam = torch.where(A >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # (B, 1)
    return -phi * A * logp
