"""Independent transcription of TRL's vLLM importance-sampling correction (TIS / MIS, token / sequence).

Source: huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24)
  trl/trainer/grpo_trainer.py  GRPOTrainer._generate_and_score_completions (ratio: ~l.2579-2625,
      metrics: ~l.2779-2812), GRPOTrainer._compute_loss (application: ~l.3117, aggregation ~l.3124-3150)
  trl/trainer/grpo_config.py   vllm_importance_sampling_correction=True,
      vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0,
      vllm_importance_sampling_clip_min=None (added by #4732, 2026-06-11);
      vllm_importance_sampling_cap is a deprecated alias of clip_max.
History: before #4530 (commit eb7638998, 2025-11-30) TRL had only token TIS with cap 2.0;
#4530 introduced the four modes with default sequence_mask and cap 3.0.

Conventions are TRL's: (B, T) right-padded completion tensors; old_per_token_logps = trainer
log-probs of the rollout policy (recomputed), sampling_per_token_logps = vLLM log-probs;
completion_mask (B, T) 0/1 (times tool_mask when tools mask tokens).
Written from the behaviour of the source, not copied.
"""

from __future__ import annotations

import math

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_vllm_is_ratio(
    old_per_token_logps,
    sampling_per_token_logps,
    completion_mask,
    mode="sequence_mask",
    clip_min=None,
    clip_max=3.0,
    tool_mask=None,
    with_raw_metrics=False,
):
    """Returns (ratio, metrics).  ratio is (B, T) for token_* modes, (B, 1) for sequence_* modes.

    d_t = (old - sampling) * mask            (padding contributes 0, so token ratio is 1 there)
    token:    rho_t = exp(d_t)               sequence: rho = exp(sum_t d_t)     (no overflow guard)
    *_truncate: rho <- clamp(rho, clip_min, clip_max)   (either bound may be None)
    *_mask:     rho <- 0 where rho < clip_min or rho > clip_max  (missing bound = -inf / +inf);
                completion_mask is NOT modified: zeroed tokens still count in every denominator.
    The ratio is computed under no_grad and multiplied onto the per-token loss (after clipping,
    before aggregation) for every loss_type except 'vespo' (which folds it into its sequence weight).
    Logged (main): sampling/sampling_logp_difference/{mean,max} of |old - sampling| over mask,
    sampling/importance_sampling_ratio/{min,mean,max} of the PROCESSED ratio (token modes: over
    mask positions; sequence modes: over all rows).  with_raw_metrics adds the trl#5231 /
    PR #5243 proposal (raw ratio before truncation/mask + fraction modified) -- NOT in TRL main.
    """
    assert mode in MODES
    if mode.endswith("truncate"):
        assert clip_min is not None or clip_max is not None
    mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    with torch.no_grad():
        diff = (old_per_token_logps - sampling_per_token_logps) * mask
        seq = mode.startswith("sequence")
        ld = diff.sum(dim=-1, keepdim=True) if seq else diff
        raw = torch.exp(ld)
        if mode.endswith("truncate"):
            ratio = torch.clamp(raw, min=clip_min, max=clip_max)
        else:
            lo = clip_min if clip_min is not None else -math.inf
            hi = clip_max if clip_max is not None else math.inf
            ratio = raw.masked_fill((raw < lo) | (raw > hi), 0.0)

        mb = mask.bool()
        delta = torch.abs(old_per_token_logps - sampling_per_token_logps)[mb]
        flat = ratio.flatten() if seq else ratio[mb]
        z = torch.tensor(0.0)
        metrics = {
            "sampling/sampling_logp_difference/mean": (delta.mean() if delta.numel() else z).item(),
            "sampling/sampling_logp_difference/max": (delta.max() if delta.numel() else z).item(),
            "sampling/importance_sampling_ratio/min": (flat.min() if flat.numel() else z).item(),
            "sampling/importance_sampling_ratio/mean": (flat.mean() if flat.numel() else z).item(),
            "sampling/importance_sampling_ratio/max": (flat.max() if flat.numel() else z).item(),
        }
        if with_raw_metrics:  # proposal of trl#5231 / PR #5243, not in TRL main
            rflat = raw.flatten() if seq else raw[mb]
            metrics["sampling/raw_importance_sampling_ratio/min"] = rflat.min().item()
            metrics["sampling/raw_importance_sampling_ratio/mean"] = rflat.mean().item()
            metrics["sampling/raw_importance_sampling_ratio/max"] = rflat.max().item()
            metrics["sampling/frac_modified_importance_sampling_ratio"] = (rflat != flat).float().mean().item()
    return ratio, metrics


def trl_dapo_loss(
    per_token_logps,
    old_per_token_logps,
    advantages,
    completion_mask,
    is_ratio,
    num_items_in_batch,
    eps_low=0.2,
    eps_high=0.28,
    num_processes=1,
):
    """TRL loss_type='dapo' with the vLLM IS ratio applied: sum(l * r * mask) / (num_items_in_batch / nproc).
    num_items_in_batch = the global count of completion-mask tokens of the whole generation batch
    (unchanged by *_mask modes).  advantages: (B, 1)."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    l = -torch.min(coef_1 * advantages, coef_2 * advantages)
    l = l * is_ratio
    return (l * completion_mask).sum() / (torch.as_tensor(num_items_in_batch).clamp(min=1.0) / num_processes)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(1)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=g) * 2
    samp = old + torch.randn(B, T, generator=g) * 0.2
    mask = torch.ones(B, T)
    mask[2, 3:] = 0
    r, m = trl_vllm_is_ratio(old, samp, mask, "token_truncate", None, 2.0)
    assert torch.allclose(r, torch.exp((old - samp) * mask).clamp(max=2.0))
    r, m = trl_vllm_is_ratio(old, samp, mask, "token_mask", 0.9, 1.1, with_raw_metrics=True)
    raw = torch.exp((old - samp) * mask)
    assert torch.allclose(r, torch.where((raw >= 0.9) & (raw <= 1.1), raw, 0.0))
    rs, _ = trl_vllm_is_ratio(old, samp, mask, "sequence_mask")
    assert rs.shape == (B, 1)
    lp = old.clone().requires_grad_(True)
    A = torch.randn(B, 1, generator=g)
    loss = trl_dapo_loss(lp, old, A, mask, rs, mask.sum())
    loss.backward()
    print("trl_vllm_is ok", {k: round(v, 4) for k, v in m.items()})
