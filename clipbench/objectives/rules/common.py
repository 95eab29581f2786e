"""What the rule modules share: parameter checks, effective bounds, source strings."""

from __future__ import annotations

from clipbench.objectives.signature import nonneg

EPS_CHECKS = {"eps_low": nonneg, "eps_high": nonneg}
GRPO_SRC = "GRPO, DeepSeekMath (arXiv 2402.03300); PPO (arXiv 1707.06347)"
VERL = "verl verl/trainer/ppo/core_algos.py"
TRL = "TRL trl/trainer/grpo_trainer.py _compute_loss"


def clip_bounds(p) -> dict:
    """The effective bounds of a clip with eps_low / eps_high (logged as rule.clip_low, rule.clip_high)."""
    return {"clip_low": 1.0 - p["eps_low"], "clip_high": 1.0 + p["eps_high"]}
