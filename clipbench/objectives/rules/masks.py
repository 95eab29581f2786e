"""Rules that drop tokens or sequences by how far the policy moved: DeepSeek-V3.2's off-policy
sequence mask (OPSM), GLM-5's rollout-anchored masked importance weight, prime-rl's IPO
probability-difference mask, each measuring the move from the behaviour or rollout policy instead
of clipping a ratio.

A dropped token has loss 0 and gradient exactly 0 (``torch.where``), and stays in the
aggregation's denominators, as in every source.
"""

from __future__ import annotations

import torch

from clipbench.objectives.primitives import ppo_clip
from clipbench.objectives.registry import interval, rule
from clipbench.objectives.rules.common import EPS_CHECKS, clip_bounds
from clipbench.objectives.signature import nonneg

SLIME = "THUDM/slime @ 624b824 slime/utils/ppo_utils.py compute_opsm_mask (--use-opsm, --opsm-delta 1e-4)"
TRL_OPSM = "huggingface/trl @ f2cd577 trl/trainer/grpo_trainer.py get_off_policy_mask (off_policy_mask_threshold)"
SKYRL = "NovaSky-AI/SkyRL @ a956457 skyrl/backends/skyrl_train/utils/ppo_utils.py rollout_is_policy_loss"
PRIME = (
    "PrimeIntellect-ai/prime-rl @ 559b447 src/prime_rl/trainer/rl/loss.py ipo_loss_fn "
    "(packages/prime-rl-configs/.../configs/trainer.py IPOLossConfig)"
)


@rule(
    "opsm",
    source=f"DeepSeek-V3.2 (arXiv 2512.02556) Eq. 9; {SLIME}; {TRL_OPSM}",
    checks={**EPS_CHECKS, "delta": nonneg},
    bounds=lambda p: {**clip_bounds(p), "opsm_delta": p["delta"], "opsm_against": "old_logp"},
)
def opsm(r, A, log_ratio, mask, *, eps_low: float = 0.2, eps_high: float = 0.2, delta: float = 1e-4):
    """grpo, times M = 0 on every token of a sequence with A < 0 and mean_t log(old/pi) = -mean_t(logp - old_logp) > delta: DeepSeek-V3.2's off-policy sequence masking (OPSM)

    The mean is over the sequence's valid tokens (at least 1), on the detached log-ratio; a sequence
    on the threshold is kept (slime masks kl > delta, TRL keeps kl <= delta). The log-ratio is
    against old_logp, as slime (whose old log-probs are the rollout's with --use-rollout-logprobs);
    DeepSeek-V3.2 and TRL take the sampler's log-probs, i.e. sampler.old_logp: sampler here.
    delta 1e-4 is slime's --opsm-delta default (TRL has none and suggests 0.5).
    """
    kl = -(log_ratio.detach() * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    drop = (A < 0) & (kl > delta)  # (B, 1)
    return torch.where(drop, 0.0, ppo_clip(r, A, 1 - eps_low, 1 + eps_high))


@rule(
    "rollout_is",
    source=f"GLM-5 (arXiv 2602.15763) section 4.1.2; {SKYRL} (eps_clip_low/high 0.2)",
    checks=EPS_CHECKS,
    bounds=lambda p: {
        "weight_band": interval(1 - p["eps_low"], 1 + p["eps_high"], "()"),
        "ratio_against": "rollout policy (the sampler's log-probs)",
    },
)
def rollout_is(logp, A, rollout_logp, *, eps_low: float = 0.2, eps_high: float = 0.2):
    """-sg(rho * 1[1-eps_low < rho < 1+eps_high]) * A * logp, rho = exp(logp - rollout_logp): GLM-5's masked importance weight against the rollout policy (a masked CISPO)

    rho is taken against the sampler's log-probs (the rollout policy), never old_logp; its exponent
    is clamped to +-20 (SkyRL's safe_exp_delta). Tokens outside the open band get weight 0: loss
    and gradient 0 (cispo would cap them instead). With sampler.old_logp: sampler, rho is r. It
    reads the input rollout_logp (keyword sampler_logp): the built-in loop passes the sampler's
    log-probs (asking the hf sampler for them); TRL and verl cannot, and refuse the rule in one line.
    """
    rho = torch.exp((logp.detach() - rollout_logp).clamp(-20.0, 20.0))  # (B, T)
    inside = (rho > 1 - eps_low) & (rho < 1 + eps_high)
    return -torch.where(inside, rho, 0.0) * A * logp


@rule(
    "ipo",
    source=f"prime-rl IPO loss; {PRIME} (ipo_threshold 0.1, adv_tau 1, kl_tau 1e-3)",
    checks={"tau": nonneg, "adv_tau": nonneg, "kl_tau": nonneg},
    bounds=lambda p: {"prob_diff_max": p["tau"], "kl_tau": p["kl_tau"], "adv_tau": p["adv_tau"]},
)
def ipo(r, A, logp, old_logp, log_ratio, *, tau: float = 0.1, adv_tau: float = 1.0, kl_tau: float = 1e-3):
    """-adv_tau*A*r where |p - q| <= tau (else 0), plus kl_tau*(logp - old_logp)^2 on every token: prime-rl's IPO, a symmetric probability-difference mask with a squared log-ratio penalty

    p = exp(logp), q = exp(old_logp): the mask is on the probability moved, either way, for both
    signs of A (DPPO's dppo_tv is one-sided per sign); the penalty is not masked and does not read
    A, so a zero-advantage token keeps its gradient. tau is prime-rl's ipo_threshold. prime-rl has
    one behaviour policy, the inference engine's: sampler.old_logp: sampler reproduces it.
    """
    p, q = logp.detach().exp(), old_logp.exp()
    keep = (p - q).abs() <= tau
    return torch.where(keep, -adv_tau * A * r, 0.0) + kl_tau * log_ratio.square()
