"""Sequence-level advantages from group rewards (docs/objectives.md, "Advantages").

rewards: (P, G) one row per prompt, G samples each  ->  advantages: (P, G)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from clipbench.registry import Registry

# `train.advantage`: (r (P, G) float64, eps) -> advantages (P, G) before the all-equal groups' zeroing.
Advantage = Callable[[torch.Tensor, float], torch.Tensor]


def group(r: torch.Tensor, eps: float) -> torch.Tensor:
    """(R - mean) / (std + eps), Bessel-corrected std (GRPO)."""
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=True) if r.shape[1] > 1 else torch.zeros_like(mean)
    return (r - mean) / (std + eps)


def group_mean(r: torch.Tensor, eps: float) -> torch.Tensor:
    """R - mean (ABC-GRPO eq. 3, Dr. GRPO)."""
    return r - r.mean(dim=1, keepdim=True)


def rloo(r: torch.Tensor, eps: float) -> torch.Tensor:
    """R - mean of the other G-1 rewards: R_i - (sum - R_i) / (G - 1)  ==  G/(G-1) * (R_i - mean)."""
    G = r.shape[1]
    return (r - (r.sum(dim=1, keepdim=True) - r) / (G - 1)) if G > 1 else torch.zeros_like(r)


ADVANTAGES: Registry[Advantage] = Registry("advantage", error=ValueError)  # the config reads its names
ADVANTAGES.register("group", group)
ADVANTAGES.register("group_mean", group_mean)
ADVANTAGES.register("rloo", rloo)


def compute_advantages(rewards: torch.Tensor, kind: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """`kind` (ADVANTAGES: group, group_mean, rloo) of each group's rewards.
    A group whose rewards are all equal gets A = 0 for every member (exactly, for every kind)."""
    fn = ADVANTAGES.lookup(kind)
    r = rewards.double()  # (P, G)
    adv = fn(r, eps)
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)  # (P, 1) all-equal groups
    adv = torch.where(equal, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """(P,) bool: groups whose rewards are all equal (no learning signal)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def overlong_shaping(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    *,
    max_new_tokens: int,
    buffer: int,
    penalty: float,
) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to max-buffer tokens, then a linear penalty reaching
    -penalty at max_new_tokens; a truncated completion (no EOS) gets -penalty."""
    start = max_new_tokens - buffer
    over = (lengths.to(rewards.dtype) - start).clamp(min=0) / max(buffer, 1)
    pen = -penalty * over.clamp(max=1.0)
    pen = torch.where(truncated, torch.full_like(pen, -penalty), pen)
    return rewards + pen
