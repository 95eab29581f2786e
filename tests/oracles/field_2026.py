"""Transcriptions of the upstream code of the rules added for issue 38, written the way each source
writes it (per-sample lists, masks multiplied in, its own clamps), for tests/test_objectives_field.py.

slime      THUDM/slime @ 624b824 slime/utils/ppo_utils.py compute_opsm_mask, compute_policy_loss
TRL        huggingface/trl @ f2cd577 trl/trainer/grpo_trainer.py get_off_policy_mask
SkyRL      NovaSky-AI/SkyRL @ a956457 skyrl/backends/skyrl_train/utils/ppo_utils.py rollout_is_policy_loss
prime-rl   PrimeIntellect-ai/prime-rl @ 559b447 src/prime_rl/trainer/rl/loss.py ipo_loss_fn
verl       verl-project/verl PR #5252 @ 18bd5cd verl/trainer/ppo/core_algos.py compute_policy_loss_cfpo
ROLL       alibaba/ROLL @ 8eb27cc roll/pipeline/rlvr/actor_pg_worker.py _compute_kimi15_loss, _compute_cispo_loss
open-instruct  allenai/open-instruct @ e6c3044 open_instruct/grpo_utils.py compute_rho_correction
"""

from __future__ import annotations

import torch


def slime_opsm_pg_loss(log_probs, old_log_probs, advantages, loss_masks, opsm_delta, eps_clip, eps_clip_high):
    """slime's per-token PPO loss times its OPSM mask; inputs are per-sample lists of 1-d tensors
    (the response tokens only), the advantages per token."""
    opsm_mask_list = []
    for full_log_prob, full_old_log_prob, advantage, loss_mask in zip(
        log_probs, old_log_probs, advantages, loss_masks, strict=True
    ):
        seq_kl = ((full_old_log_prob - full_log_prob) * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)
        mask = ((advantage < 0) & (seq_kl > opsm_delta)).float()
        opsm_mask_list.append(1 - mask)
    opsm_mask = torch.cat(opsm_mask_list, dim=0)
    ppo_kl = torch.cat(old_log_probs, dim=0) - torch.cat(log_probs, dim=0)
    adv = torch.cat(advantages, dim=0)
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * adv
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * adv
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    return pg_losses * opsm_mask


def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)  # (B, 1)


def safe_exp_delta(delta, clip=20.0):
    return torch.exp(delta.clamp(-clip, clip))


def skyrl_rollout_is(log_probs, rollout_logprobs, advantages, eps_clip_low, eps_clip_high):
    """Per-token loss (SkyRL reduces it afterwards)."""
    ratio = safe_exp_delta(log_probs - rollout_logprobs, clip=20.0)
    in_range = (ratio > 1 - eps_clip_low) & (ratio < 1 + eps_clip_high)
    calibrated_ratio = torch.where(in_range, ratio, torch.zeros_like(ratio))
    return -(calibrated_ratio.detach() * advantages * log_probs)


def prime_ipo(trainer_logprobs, inference_logprobs, advantages, loss_mask, ipo_threshold, adv_tau, kl_tau):
    """One sample's loss (a sum over its tokens); 1-d tensors, loss_mask bool."""
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    abs_probs_diff = torch.abs(torch.exp(trainer_logprobs) - torch.exp(inference_logprobs))
    is_masked = abs_probs_diff > ipo_threshold
    keep_mask = loss_mask & ~is_masked
    advantages = adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + kl_tau * kl_loss
    return per_token_loss.sum()


def verl_cfpo(old_log_prob, log_prob, advantages, cliprange):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    return -(advantages * ratio - torch.abs(advantages) * torch.pow(ratio - 1, 2) / (2 * cliprange))


def roll_kimi15(log_probs, old_log_probs, advantages, tau):
    return -advantages * log_probs + tau * 0.5 * (log_probs - old_log_probs).pow(2)


def roll_cispo(ratio, log_probs, advantages, epsilon_low, epsilon_high, use_unified_mask):
    clip_lower, clip_upper = 1.0 - epsilon_low, 1.0 + epsilon_high
    clipped_ratio = torch.clamp(ratio, min=clip_lower, max=clip_upper)
    if use_unified_mask:
        mask_positive = (advantages > 0) & (ratio > clip_upper)
        mask_negative = (advantages < 0) & (ratio < clip_lower)
        token_mask = ~(mask_positive | mask_negative)
        return -clipped_ratio.detach() * advantages * log_probs * token_mask.float()
    return -clipped_ratio.detach() * advantages * log_probs


def open_instruct_tv_weights(old_logprob, vllm_logprobs, response_mask, advantages, lower, upper, clamp_lo, clamp_hi):
    """compute_rho_correction with use_rho_correction and rho_mask_tv_divergence on, token level."""
    logprob_diff = torch.where(
        response_mask, (old_logprob - vllm_logprobs).clamp(-10.0, 10.0), torch.zeros_like(old_logprob)
    )
    rho = torch.exp(logprob_diff)
    valid = response_mask.float()
    tv = torch.abs(rho - 1.0)
    tv_seq = ((tv * valid).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1.0)).expand_as(tv)
    dropped_low = (tv_seq < lower) & response_mask if lower > 0.0 else torch.zeros_like(response_mask)
    dropped_high = (tv_seq > upper) & response_mask if upper > 0.0 else torch.zeros_like(response_mask)
    increase = torch.sign(logprob_diff) * advantages > 0
    in_range = response_mask & ~(dropped_low & increase) & ~(dropped_high & increase)
    rho_clamped = rho
    if clamp_lo > 0.0:
        rho_clamped = torch.clamp(rho_clamped, min=clamp_lo)
    if clamp_hi > 0.0:
        rho_clamped = torch.clamp(rho_clamped, max=clamp_hi)
    return torch.where(in_range, rho_clamped, torch.zeros_like(rho_clamped))


if __name__ == "__main__":  # smoke check: the worked example of open-instruct's own test
    old = torch.log(torch.tensor([[0.25, 1.0, 4.0], [4.0, 4.0, 4.0]]))
    w = open_instruct_tv_weights(
        old, torch.zeros_like(old), torch.ones_like(old, dtype=torch.bool), torch.ones_like(old), 0.0, 2.0, 0.0, 0.0
    )
    assert torch.equal(w, torch.tensor([[0.25, 1.0, 4.0], [0.0, 0.0, 0.0]])), w
    print("ok")
