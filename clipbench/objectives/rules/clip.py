"""Token-level hard clips: PPO/GRPO's clip, DAPO's clip-higher, the dual clip, ABC-GRPO's four
bounds, DCPO's per-token bounds. A clipped token gets zero gradient.
"""

from __future__ import annotations

import torch

from clipbench.objectives.primitives import ppo_clip
from clipbench.objectives.registry import interval, rule
from clipbench.objectives.rules.common import EPS_CHECKS, GRPO_SRC, clip_bounds
from clipbench.objectives.signature import greater_than_one, nonneg


@rule("grpo", source=GRPO_SRC, checks=EPS_CHECKS, bounds=clip_bounds)
def grpo(r, A, *, eps_low: float = 0.2, eps_high: float = 0.2):
    """-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A): PPO/GRPO clipped surrogate

    Zero gradient on (A>0, r > 1+eps_high) and (A<0, r < 1-eps_low); unbounded in Q4 as r grows.
    """
    return ppo_clip(r, A, 1 - eps_low, 1 + eps_high)


@rule("dapo", source="DAPO (arXiv 2503.14476)", checks=EPS_CHECKS, bounds=clip_bounds)
def dapo(r, A, *, eps_low: float = 0.2, eps_high: float = 0.28):
    """-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A): GRPO clip with decoupled (clip-higher) bounds

    The grpo rule with a higher upper bound (clip-higher); its gradient is grpo's with these bounds.
    """
    return ppo_clip(r, A, 1 - eps_low, 1 + eps_high)


def _dual_clip_warning(p) -> str | None:
    if p["c"] <= 1 + p["eps_high"]:
        return (
            f"c={p['c']:g} <= 1 + eps_high = {1 + p['eps_high']:g}: the cap binds inside the trust band; "
            "this is not TRL's `delta` (which needs delta > 1 + eps_high)"
        )
    return None


@rule(
    "dual_clip",
    source="Dual-clip PPO (arXiv 1912.09729); INTELLECT-2 delta (arXiv 2505.07291); "
    "verl core_algos.py `vanilla` (clip_ratio_c=3)",
    checks={**EPS_CHECKS, "c": greater_than_one},
    bounds=lambda p: {**clip_bounds(p), "dual_clip_c": p["c"]},
    warn=_dual_clip_warning,
)
def dual_clip(r, A, *, eps_low: float = 0.2, eps_high: float = 0.2, c: float = 3.0):
    """grpo, and min(grpo, -c*A) for A<0: GRPO clip plus a cap c on the loss of A<0 tokens

    The gradient is also zero for (A<0, r > c). Equals TRL's `delta=c` when c > 1 + eps_high
    (tested); with c <= 1 + eps_high the cap binds inside the trust band, which is not what TRL's
    `delta` computes, and a one-line warning says so. verl's `vanilla` loss (PPO clip + dual clip
    with clip_ratio_c = 3.0) is this rule with the defaults.
    """
    loss = ppo_clip(r, A, 1 - eps_low, 1 + eps_high)
    return torch.where(A < 0, torch.minimum(loss, -c * A), loss)


@rule(
    "abc",
    source="ABC-GRPO (arXiv 2601.03895), eq. 5-8, Algorithm 1",
    checks={f"eps{i}": nonneg for i in (1, 2, 3, 4)},
    band=lambda p: (1 - p["eps2"], 1 + p["eps1"], 1 - p["eps4"], 1 + p["eps3"]),
    bounds=lambda p: {
        "clip_pos": interval(1 - p["eps2"], 1 + p["eps1"]),
        "clip_neg": interval(1 - p["eps4"], 1 + p["eps3"]),
    },
)
def abc(r, A, *, eps1: float = 0.2, eps2: float = 0.2, eps3: float = 0.2, eps4: float = 0.2):
    """-clip(r, lo, hi)*A, (lo, hi) = (1-eps2, 1+eps1) if A>0 else (1-eps4, 1+eps3): asymmetric bounded clip, no min

    Zero gradient outside the band in all four quadrants: grpo is recovered in Q1/Q3, and Q4
    becomes bounded.
    """
    lo = torch.where(A < 0, 1 - eps4, 1 - eps2)  # (B, 1); A == 0 rows take the A>0 band (l = 0 anyway)
    hi = torch.where(A < 0, 1 + eps3, 1 + eps1)
    return -torch.clamp(r, lo, hi) * A


@rule(
    "dcpo",
    source="DCPO (arXiv 2509.02333); lime-RL/DCPO verl/trainer/ppo/core_algos.py get_clip_low_high, "
    "compute_policy_loss_dcpo (clip_type=dynamic)",
    checks={**EPS_CHECKS, "c": greater_than_one},
    bounds=lambda p: {"clip_low_min": 0.5, "clip_high_cap": max(p["c"], 10.0), "dual_clip_c": p["c"]},
)
def dcpo(r, A, old_logp, *, eps_low: float = 0.2, eps_high: float = 0.28, c: float = 10.0):
    """dual_clip with per-token bounds lo = (1+sqrt(max(1-4*eps_low/q, 0)))/2, hi = min((1+sqrt(1+4*eps_high/q))/2, max(c, 10)), q = exp(old_logp): DCPO's dynamic-adaptive clip

    Rare tokens (small q) get a wider band: the bounds solve |r - 1|*r*q <= eps. (q == 0, an
    underflow, takes the limit q -> 0: lo = 1/2, hi = max(c, 10).)
    """
    q = old_logp.exp()
    lo = (1 + torch.sqrt(torch.clamp(1 - 4 * eps_low / q, min=0))) / 2
    hi = torch.clamp((1 + torch.sqrt(1 + 4 * eps_high / q)) / 2, max=max(c, 10.0))
    loss = ppo_clip(r, A, lo, hi)
    return torch.where(A < 0, torch.minimum(loss, -c * A), loss)
