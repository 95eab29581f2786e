# lower_only.py
import torch

from clipbench.objectives import rule


@rule("lower_only", source="my idea")
def lower_only(r, A, *, eps_low: float = 0.2):
    """-min(r*A, max(r, 1-eps_low)*A): PPO clip with only the lower bound."""
    return -torch.minimum(r * A, torch.clamp(r, min=1 - eps_low) * A)
