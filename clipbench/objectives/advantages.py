"""Sequence-level advantages from group rewards (docs/objectives.md, "Advantages").

rewards: (P, G) one row per prompt, G samples each  ->  advantages: (P, G)
"""

from __future__ import annotations

import torch

ADVANTAGES = ("group", "group_mean", "rloo")  # `train.advantage` (the config reads this list)


def compute_advantages(rewards: torch.Tensor, kind: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """`group`: (R - mean) / (std + eps), Bessel-corrected std (GRPO).
    `group_mean`: R - mean (ABC-GRPO eq. 3, Dr. GRPO).
    `rloo`: R - mean of the other G-1 rewards.
    A group whose rewards are all equal gets A = 0 for every member (exactly, for every kind)."""
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage '{kind}'; valid: {', '.join(ADVANTAGES)}")
    r = rewards.double()  # (P, G)
    G = r.shape[1]
    mean = r.mean(dim=1, keepdim=True)
    if kind == "group":
        std = r.std(dim=1, keepdim=True, unbiased=True) if G > 1 else torch.zeros_like(mean)
        adv = (r - mean) / (std + eps)
    elif kind == "group_mean":
        adv = r - mean
    else:  # rloo: R_i - (sum - R_i) / (G - 1)  ==  G/(G-1) * (R_i - mean)
        adv = (r - (r.sum(dim=1, keepdim=True) - r) / (G - 1)) if G > 1 else torch.zeros_like(r)
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
