"""Rules whose clipped tokens keep a gradient: CISPO's clipped IS weight (verl's and TRL's forms),
SAPO's soft gate, GPPO's and CE-GPPO's gradient-preserving clips, ASPO's flipped weight and soft dual clips.
"""

from __future__ import annotations

import torch

from clipbench.objectives.primitives import past_bound
from clipbench.objectives.registry import interval, rule
from clipbench.objectives.rules.common import EPS_CHECKS, TRL, clip_bounds
from clipbench.objectives.signature import greater_than_one, nonneg, positive, unit_interval


@rule(
    "cispo",
    source="CISPO, MiniMax-M1 (arXiv 2506.13585); verl core_algos.py `cispo` (two-sided); unified_mask: "
    "MiniMax-M1 Eq. 7, alibaba/ROLL @ 8eb27cc roll/pipeline/rlvr/actor_pg_worker.py _compute_cispo_loss "
    "(cispo_use_unified_mask)",
    checks=EPS_CHECKS,
    bounds=lambda p: {
        "weight_cap": interval(max(0.0, 1 - p["eps_low"]), 1 + p["eps_high"]),
        "weight_low": 1 - p["eps_low"],
        "weight_high": 1 + p["eps_high"],
        **({"unified_mask": "zero where PPO's clip zeroes"} if p.get("unified_mask") else {}),
    },
)
def cispo(r, A, logp, *, eps_low: float = 1.0, eps_high: float = 4.0, unified_mask: bool = False):
    """-sg(clip(r, 1-eps_low, 1+eps_high))*A*logp: clipped importance-sampling weight on a REINFORCE term; never zero (unless unified_mask)

    The weight is clipped two-sided around 1 (verl's parametrisation); the defaults (no lower cap,
    cap at 5) are TRL's `cispo`, see cispo_cap for its absolute-cap parametrisation. unified_mask:
    MiniMax-M1's Eq. 7 mask M, 0 where PPO's clip zeroes the gradient, (A>0, r > 1+eps_high) and
    (A<0, r < 1-eps_low) (strict, ROLL's cispo_use_unified_mask), 1 elsewhere; off (the default),
    it is left out of the run id. Without the mask the gradient is never zero; the weight is capped.
    Other frameworks use other caps: the effective bounds are logged (rule.*).
    """
    loss = -torch.clamp(r, 1 - eps_low, 1 + eps_high).detach() * A * logp
    if not unified_mask:
        return loss
    rd = r.detach()
    masked = ((A > 0) & (rd > 1 + eps_high)) | ((A < 0) & (rd < 1 - eps_low))
    return torch.where(masked, 0.0, loss)


@rule(
    "sapo",
    source="SAPO (arXiv 2511.20347)",
    checks={"tau_pos": positive, "tau_neg": positive},
    bounds=lambda p: {"gate": "sigmoid", "tau_pos": p["tau_pos"], "tau_neg": p["tau_neg"]},
)
def sapo(r, A, *, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """-(4/tau)*sigmoid(tau*(r-1))*A, tau = tau_pos if A>0 else tau_neg: soft adaptive gate, slope 1 at r=1

    A smooth gate in place of a clip: the gradient shrinks away from r = 1 and never vanishes.
    """
    tau = torch.where(A > 0, tau_pos, tau_neg)  # (B, 1)
    return -(4 / tau) * torch.sigmoid(tau * (r - 1)) * A


@rule(
    "gppo",
    source="GPPO, Klear-Reasoner (arXiv 2508.07629)",
    checks={**EPS_CHECKS, "beta_low": nonneg, "beta_high": nonneg},
    bounds=lambda p: {
        **clip_bounds(p),
        "grad_past_high": p["beta_high"] * (1 + p["eps_high"]),
        "grad_past_low": p["beta_low"] * (1 - p["eps_low"]),
    },
)
def gppo(r, A, *, eps_low: float = 0.2, eps_high: float = 0.28, beta_low: float = 1.0, beta_high: float = 1.0):
    """grpo, but -beta*b*r/sg(r)*A where grpo clips: gradient-preserving clip, constant-magnitude gradient past the bound

    In the two cells grpo zeroes, the loss is -beta*b*r/sg(r)*A, b the bound hit: 1+eps_high with
    beta_high (A>0), 1-eps_low with beta_low (A<0). A constant-magnitude gradient instead of zero: a
    deterministic alternative near and far past the bound.
    """
    lo, hi = 1 - eps_low, 1 + eps_high
    clipped = past_bound(r.detach(), A, lo, hi) > 0
    beta_b = torch.where(A > 0, beta_high * hi, beta_low * lo)  # (B, 1)
    return torch.where(clipped, -beta_b * r / r.detach() * A, -r * A)


@rule(
    "cispo_cap",
    source=f"CISPO (arXiv 2506.13585); ScaleRL (arXiv 2510.13786); {TRL} loss_type='cispo'",
    checks={"cap": positive},
    band=lambda p: (0.0, p["cap"], 0.0, p["cap"]),
    bounds=lambda p: {"weight_cap": interval(0.0, p["cap"])},
)
def cispo_cap(r, A, logp, *, cap: float = 5.0):
    """-sg(min(r, cap))*A*logp: CISPO with TRL's absolute cap on the IS weight (TRL's epsilon_high)

    The same rule as cispo with eps_low=1, eps_high=cap-1; cispo clips two-sided around 1 (verl).
    The cap is TRL's epsilon_high; 5.0 is ScaleRL's.
    """
    return -torch.clamp(r, max=cap).detach() * A * logp


@rule(
    "ce_gppo",
    source="CE-GPPO (arXiv 2509.20712); Kwai-Klear/CE-GPPO README compute_gppo_loss_general_beta",
    checks={**EPS_CHECKS, "beta_low": nonneg, "beta_high": nonneg, "c": greater_than_one},
    bounds=lambda p: {
        **clip_bounds(p),
        "grad_past_high": p["beta_high"] * (1 + p["eps_high"]),
        "grad_past_low": p["beta_low"] * (1 - p["eps_low"]),
        "dual_clip_c": p["c"],
    },
)
def ce_gppo(
    r,
    A,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta_low: float = 0.75,
    beta_high: float = 1.0,
    c: float = 10.0,
):
    """gppo, and min(gppo, -c*A) for A<0: CE-GPPO, gradient-preserving clip with scales beta_low (beta1) / beta_high (beta2) and PPO's dual clip

    Defaults: the authors' 7B recipe (beta1 = 0.75, 0.5 for 1.5B; eps 0.2/0.2; clip_ratio_c = 10).
    """
    loss = gppo(r, A, eps_low=eps_low, eps_high=eps_high, beta_low=beta_low, beta_high=beta_high)
    return torch.where(A < 0, torch.minimum(loss, -c * A), loss)


def _entropy_bands(entropy, mask, q: float, narrow: float, wide: float) -> torch.Tensor:
    """(B, T) eps per token: narrow on each sequence's low-entropy tokens (entropy <= the row's
    q-quantile, linear interpolation, ties included), wide on the rest (the top 1-q)."""
    ent = torch.where(mask > 0, entropy, float("nan"))
    cut = torch.nanquantile(ent, q, dim=-1, keepdim=True)  # (B, 1); nan for a row without tokens
    return torch.where(ent <= cut, narrow, wide)


@rule(
    "aspo",
    source="ASPO (arXiv 2510.06062); wizard-III/Archer2.0 @ b08d963 verl/trainer/ppo/core_algos.py "
    "compute_policy_loss_archer, verl/workers/actor/dp_actor.py (token_entropy_quantile 0.8, eps 0.2 / 0.4, "
    "clip_ratio_c 3)",
    checks={
        "eps_narrow": nonneg,
        "eps_wide": nonneg,
        "entropy_quantile": unit_interval,
        "c_neg": greater_than_one,
        "c_pos": greater_than_one,
    },
    band=lambda p: (1 - p["eps_narrow"], 1 + p["eps_narrow"], 1 - p["eps_narrow"], 1 + p["eps_narrow"]),
    bounds=lambda p: {
        "clip_narrow": interval(1 - p["eps_narrow"], 1 + p["eps_narrow"]),
        "clip_wide": interval(1 - p["eps_wide"], 1 + p["eps_wide"]),
        "entropy_quantile": p["entropy_quantile"],
        "dual_clip_neg": p["c_neg"],
        "dual_clip_pos": p["c_pos"],
    },
)
def aspo(
    r,
    A,
    logp,
    entropy,
    mask,
    *,
    eps_narrow: float = 0.2,
    eps_wide: float = 0.4,
    entropy_quantile: float = 0.8,
    c_neg: float = 3.0,
    c_pos: float = 3.0,
):
    """-A*max(r, 1-e) if A<0 (-c_neg*A*logp where r > c_neg), else -A/min(r, 1+e) with gradient -A/r (-c_pos*A*logp where r < 1/c_pos): ASPO, flipped weight for positive tokens, soft dual clips

    e = eps_narrow on each sequence's low-entropy tokens (entropy <= its entropy_quantile) and
    eps_wide on the rest (Archer2.0: its `high_entropy_mask` marks the low-entropy 80%). The
    positive branch's value is -A/pc with pc = min(r, 1+e), its gradient -A/r inside the band (the
    flipped importance weight) and 0 past it; the dual clips keep a gradient of constant weight c.
    As released in Archer2.0 (compute_policy_loss_archer, called by both shipped training scripts).
    """
    e = _entropy_bands(entropy, mask, entropy_quantile, eps_narrow, eps_wide)
    nc = torch.clamp(r, min=1 - e)  # clamp, not torch.maximum: a ratio on the bound keeps its whole gradient
    neg = torch.where(nc > c_neg, -A * c_neg * logp, -A * nc)
    pc = torch.clamp(r, max=1 + e)
    pos = torch.where(1 / pc.detach() > c_pos, -A * c_pos * logp, -A * (pc / pc.detach()) / pc.detach())
    return torch.where(A < 0, neg, pos)
