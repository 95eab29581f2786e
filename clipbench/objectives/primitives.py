"""The formulas several rules share, and the ratio's exponential (no rule is registered here).

Conventions as in the rules (objectives/rules/): ``x`` a ratio (the token ratio r or GSPO's
sequence ratio s), ``A`` (B, 1) advantages, ``d`` how far x lies past the PPO clip's active bound.
The diagnostics (diagnostics.py) read the same ``past_bound`` and ``on_side``, so a rule and the
counts derived from it can never disagree on where a bound is.
"""

from __future__ import annotations

import torch

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp (value only, straight-through gradient):
# r <= e^20 ~ 4.9e8 stays finite in float32 even for log-ratios of +-50 (see loss.py).
LOG_RATIO_CLAMP = 20.0


def ppo_clip(x: torch.Tensor, A: torch.Tensor, lo, hi) -> torch.Tensor:
    """-min(x*A, clip(x, lo, hi)*A): the PPO clipped surrogate on a ratio x (token r or sequence s)."""
    return -torch.minimum(x * A, torch.clamp(x, lo, hi) * A)


def past_bound(x: torch.Tensor, A: torch.Tensor, lo, hi) -> torch.Tensor:
    """d: how far x lies past the PPO clip's active bound, in ratio units: x - hi for A>0, lo - x for
    A<0, 0 for A == 0 (no bound is active). PPO's clip zeroes the gradient exactly where d > 0.
    (Finite everywhere, so that a formula of d stays finite in torch.where's unselected branch.)"""
    return torch.where(A > 0, x - hi, torch.where(A < 0, lo - x, 0.0))


def on_side(A: torch.Tensor, sides: str) -> torch.Tensor:
    """(B, 1) bool: rows whose active bound takes part (upper: A>0, lower: A<0, both)."""
    return {"both": A != 0, "upper": A > 0, "lower": A < 0}[sides]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x (broadcast to the mask's (B, T)) over the valid tokens of this call, 0-d."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def first_k(key: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the k eligible positions of smallest key (ties: the earlier position); k is a
    0-d tensor (no host sync)."""
    flat = torch.where(eligible, key, float("inf")).flatten()
    rank = torch.empty_like(flat, dtype=torch.long)
    rank[flat.argsort(stable=True)] = torch.arange(flat.numel(), device=flat.device)
    return eligible & (rank.view_as(key) < k)


def share_of_tokens(ratio: float, mask: torch.Tensor) -> torch.Tensor:
    """max(int(ratio * valid tokens), 1) as a 0-d tensor (float64: the same rounding as Python)."""
    return torch.floor(ratio * mask.sum().to(torch.float64)).clamp(min=1)


def straight_through_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(clamp(x, -20, 20)) in value, with d/dx = the value everywhere (straight-through clamp)."""
    clamped = x.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + (x - x.detach())
    return torch.exp(clamped)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """(B, T) k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, with ref - logp value-clamped to +-20."""
    d = ref_logp.detach().to(torch.float32) - logp
    d = d.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + (d - d.detach())  # straight-through clamp
    return torch.exp(d) - d - 1.0


def masked_extreme(x: torch.Tensor, where: torch.Tensor, kind: str) -> torch.Tensor:
    """The largest (kind 'max') or smallest ('min') of x where `where` holds, in float64; -inf / +inf
    where it holds nowhere (so that extremes of several parts combine by max / min)."""
    fill = float("-inf") if kind == "max" else float("inf")
    x = torch.where(where, x.to(torch.float64), fill)
    if x.numel() == 0:
        return x.new_tensor(fill)
    return x.amax() if kind == "max" else x.amin()
