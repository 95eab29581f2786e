"""Independent transcription of BAPO's released policy loss (arXiv 2510.18927).

Source: WooooDyy/BAPO @ 7287044444d5d578529ea464b45f090a36e8da3a (HEAD, 2026-01-29); the loss file was
last changed by 3b8389c5a81e715a6fbaa2bb0fa688fe54ace9cf ("explicit importance-ratio bounds and global
consistency for bound-search across DP ranks", 2026-01-29).
  recipe/bapo/policy_loss.py _compute_effective_advantage (l.21-62), compute_policy_loss_bapo (l.75-185)
  recipe/bapo/config.py BAPOPolicyLossConfig: adv_ratio_target 1.0, ratio_lower_start/max None,
      ratio_lower_step 0.05, ratio_upper_start/max None, ratio_upper_step 0.05, eps 1e-8
      (start None -> 1 -/+ actor clip_ratio_low/high (0.2); max None -> start, i.e. no search)
  recipe/bapo/config/bapo_trainer.yaml: target 1, lower 0.6 -> 0.8 step 0.05, upper 1.2 -> 2.0 step 0.05
  recipe/bapo/run_bapo_example.sh: target 0.5, lower 0.8 -> 0.95 step 0.05, upper 1.2 -> 2.0 step 0.1
  README: "rho_0 = 0.5 (target contribution of positive signals to the total loss), lower range
      [0.6, 0.9], upper range [1.2, 3.0]" (these README values match neither config file)
  vendored verl: agg_loss token-mean = masked_mean per MICRO-batch (/(n+1e-8)); dp_actor calls the
      loss per micro-batch; clip_ratio_c default 3.0 (dual clip on A<0).
The first commit (820d9c0, 2025-10-22) referenced undefined names (clip_low_cur, clip_low_max) before
the search and treated bounds as epsilons inside the contribution measure; 3b8389c fixed both.

Conventions (verl's): old_log_prob, log_prob, advantages, response_mask (B, T).
Written from the behaviour of the source, not copied.
"""

from __future__ import annotations

import torch


def bapo_pos_neg_ratio(ratio, advantages, response_mask, clip_low, clip_high, eps=1e-8):
    """'Contribution' as the code measures it (NOT the paper's stated notion, see NOTES):
    eff_t = (min(r, clip_high) if A >= 0 else max(r, clip_low)) * A * mask
    pos = sum(max(eff, 0)); neg = sum(max(-eff, 0))  (this call's tokens, all-reduced over DP ranks)
    ratio = inf if neg <= 0 else pos / (neg + eps).
    Raising clip_low can only INCREASE neg (clipped negative tokens are counted at clip_low >= r)."""
    eff = (
        torch.where(
            advantages >= 0,
            torch.minimum(ratio, ratio.new_tensor(float(clip_high))),
            torch.maximum(ratio, ratio.new_tensor(float(clip_low))),
        )
        * advantages
        * response_mask
    )
    pos = eff.clamp(min=0).sum()
    neg = (-eff.clamp(max=0)).sum()
    if torch.all(neg <= 0):
        return ratio.new_tensor(float("inf"))
    return pos / (neg + ratio.new_tensor(eps))


def bapo_search(
    ratio,
    advantages,
    response_mask,
    lower_start=0.6,
    lower_max=0.8,
    lower_step=0.05,
    upper_start=1.2,
    upper_max=2.0,
    upper_step=0.05,
    target=1.0,
    eps=1e-8,
):
    """The released search (python floats, as the source): first raise the lower bound by lower_step
    (capped at lower_max) while ratio < target; then, if still < target, raise the upper bound by
    upper_step (capped at upper_max).  Returns (clip_low, clip_high, pos_neg_ratio, trace)."""
    lo, hi = lower_start, upper_start
    lower_step, upper_step, target = max(lower_step, 0.0), max(upper_step, 0.0), max(target, 0.0)
    pr = bapo_pos_neg_ratio(ratio, advantages, response_mask, lo, hi, eps)
    trace = [(lo, hi, pr.item())]
    while pr.item() < target and lo < lower_max and lower_step > 0:
        lo = min(lo + lower_step, lower_max)
        pr = bapo_pos_neg_ratio(ratio, advantages, response_mask, lo, hi, eps)
        trace.append((lo, hi, pr.item()))
        if pr.item() >= target:
            break
    while pr.item() < target and hi < upper_max and upper_step > 0:
        hi = min(hi + upper_step, upper_max)
        pr = bapo_pos_neg_ratio(ratio, advantages, response_mask, lo, hi, eps)
        trace.append((lo, hi, pr.item()))
        if pr.item() >= target:
            break
    return lo, hi, pr.item(), trace


def bapo_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, clip_ratio_c=3.0, rollout_is_weights=None, **search
):
    """compute_policy_loss_bapo: r = exp(clamp(logp - old, +-20)); bounds from bapo_search on this call's
    (detached) ratios; then verl's vanilla loss with ABSOLUTE bounds [clip_low, clip_high] and dual clip:
    l = max(-A r, -A clamp(r, lo, hi)); for A < 0: min(l, -A c).  token-mean over the call
    (sum / (n + 1e-8)).  Returns (loss, clip_low, clip_high, pos_neg_ratio)."""
    m = response_mask.to(log_prob.dtype)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    lo, hi, pr, _ = bapo_search(ratio.detach(), advantages, m, **search)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, lo, hi)
    c1 = torch.maximum(l1, l2)
    c2 = torch.min(-advantages * clip_ratio_c, c1)
    pg = torch.where(advantages < 0, c2, c1)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    return (pg * m).sum() / (m.sum() + 1e-8), lo, hi, pr


if __name__ == "__main__":
    g = torch.Generator().manual_seed(8)
    B, T = 8, 6
    old = -torch.rand(B, T, generator=g) * 2
    lp0 = old + torch.randn(B, T, generator=g) * 0.4
    A = torch.tensor([0.5, -1.5, 0.5, -1.5, 0.5, -1.5, 0.2, -0.2])[:, None].expand(B, T)
    mask = torch.ones(B, T)
    r = torch.exp(lp0 - old)
    # raising the lower bound never increases pos/neg (the code's measure)
    vals = [bapo_pos_neg_ratio(r, A, mask, lo, 1.2).item() for lo in (0.6, 0.7, 0.8, 0.9)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    lo, hi, pr, tr = bapo_search(r, A, mask)
    lp = lp0.clone().requires_grad_(True)
    loss, lo2, hi2, pr2 = bapo_policy_loss(old, lp, A, mask)
    loss.backward()
    assert (lo, hi) == (lo2, hi2)
    print("bapo ok", [tuple(round(x, 4) for x in t) for t in tr])
