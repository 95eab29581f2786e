"""Independent transcription of ASPO (arXiv 2510.06062) as released in Archer2.0.

Source: wizard-III/Archer2.0 @ b08d963d5d65909ef1f24dba2f382006d0be33e1 (2025-10-10)
  verl/trainer/ppo/core_algos.py compute_policy_loss_archer (l.537-583), agg_loss (l.501-534)
  verl/workers/actor/dp_actor.py DataParallelPPOActor.update_policy (l.396-477): per micro-batch,
      entropy from the current forward (detached), token_entropy_quantile = config.get(.., 0.8),
      call with eps 0.2 / 0.4 and clip_ratio_c 3.0 hard-coded; use_dynamic_clip passed but unused;
      no loss_agg_mode passed -> always "token-mean" (per micro-batch masked mean);
      loss scaled by 1/gradient_accumulation (or len(mb)/ppo_mini_batch_size with dynamic bsz).
  verl/utils/torch_functional.py masked_mean = sum(x*m) / (sum(m) + 1e-8)
  scripts/train/run_archer2.0_qwen2.5_1.5b_{math,code}.sh: use_archer_policy_loss=True,
      token_entropy_quantile=0.8, ppo_epochs=3, mini-batch 16 prompts x 16, micro-batch 1.

Conventions (verl's): old_log_prob, log_prob, advantages, entropy (B, T); response_mask (B, T)
(bool here; see NOTES on the source's dtype).
Written from the behaviour of the source, not copied.
"""

from __future__ import annotations

import torch


def archer_low_entropy_mask(entropy, response_mask, q=0.8):
    """dp_actor: per ROW, q80 = nanquantile(entropy over the row's valid tokens, 0.8) (linear
    interpolation); the source's variable `high_entropy_mask` is True where entropy <= q80 (i.e. the
    LOW-entropy ~80%, ties at q80 included) and on valid tokens only.  Tokens with entropy > q80
    (~top 20% per sequence) and padding are False.  An all-padding row has q80 = nan -> all False."""
    rm = response_mask.bool()
    masked = torch.where(rm, entropy.detach(), torch.full_like(entropy, float("nan")))
    q80 = torch.nanquantile(masked, q=q, dim=-1, keepdim=True)
    return (masked <= q80) & rm


def archer_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    entropy=None,
    low_entropy_mask=None,
    eps_narrow=0.2,
    eps_wide=0.4,
    neg_c=3.0,
    pos_c=3.0,
):
    """compute_policy_loss_archer with the dp_actor call (eps 0.2 on the low-entropy mask, 0.4 elsewhere).

    r = exp(clamp(logp - old, +-20));  e = 0.2 where low_entropy_mask else 0.4 (per token)
    A < 0:  nc = max(r, 1 - e);  l = -A * nc                      (PPO's A<0 branch; 0 grad for r < 1-e)
            if nc > 3 (i.e. r > 3):  l = -A * sg(3) * logp            (soft dual clip: gradient kept, weight 3)
    A >= 0: pc = min(r, 1 + e);  l = -A * (pc / sg(pc)) / sg(pc)     (value -A/pc; grad -A/r inside the
                                                                      band, 0 for r > 1+e: FLIPPED weight)
            if 1/pc > 3 (i.e. r < 1/3):  l = -A * sg(3) * logp        (soft dual clip on the flipped weight)
    (A == 0 rows take the A >= 0 branch, loss 0.)  Aggregation: token-mean over response_mask.
    Returns (loss, clipfrac_upper, clipfrac_lower, neg_dualfrac, pos_dualfrac)."""
    rm = response_mask.bool()
    if low_entropy_mask is None:
        low_entropy_mask = archer_low_entropy_mask(entropy, rm)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    neg_clip = torch.where(
        low_entropy_mask, torch.clamp(ratio, min=1 - eps_narrow), torch.clamp(ratio, min=1 - eps_wide)
    )
    pos_clip = torch.where(
        low_entropy_mask, torch.clamp(ratio, max=1 + eps_narrow), torch.clamp(ratio, max=1 + eps_wide)
    )
    clip_ratio = torch.where(advantages < 0, neg_clip, pos_clip)
    m = rm.to(log_prob.dtype)

    def mmean(x, mk):
        mk = mk.to(x.dtype)
        return (x * mk).sum() / (mk.sum() + 1e-8)

    clipfrac_upper = mmean(torch.gt(ratio, clip_ratio).float(), m)
    clipfrac_lower = mmean(torch.lt(ratio, clip_ratio).float(), m)
    neg_l = -advantages * neg_clip
    pos_l = -advantages * (pos_clip / pos_clip.detach()) / pos_clip.detach()
    neg_dual = torch.clamp(neg_clip, max=neg_c)
    neg_dual_mask = torch.gt(neg_clip, neg_dual)
    neg_l = torch.where(neg_dual_mask, -advantages * neg_dual.detach() * log_prob, neg_l)
    pos_dual = torch.clamp(1 / pos_clip, max=pos_c)
    pos_dual_mask = torch.gt(1 / pos_clip, pos_dual)
    pos_l = torch.where(pos_dual_mask, -advantages * pos_dual.detach() * log_prob, pos_l)
    pg = torch.where(advantages < 0, neg_l, pos_l)
    loss = mmean(pg, m)
    return (
        loss,
        clipfrac_upper,
        clipfrac_lower,
        mmean(neg_dual_mask.float(), rm & (advantages < 0)),
        mmean(pos_dual_mask.float(), rm & (advantages > 0)),
    )


if __name__ == "__main__":
    g = torch.Generator().manual_seed(7)
    B, T = 3, 10
    old = -torch.rand(B, T, generator=g) * 2
    lp0 = old + torch.randn(B, T, generator=g) * 0.6
    ent = torch.rand(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 6:] = False
    low = archer_low_entropy_mask(ent, mask)
    assert int((mask & ~low)[0].sum()) == 2 and int((mask & ~low)[2].sum()) == 1  # n=10 -> 2, n=6 -> 1
    A = torch.tensor([1.0, -1.0, 0.5])[:, None].expand(B, T)
    lp = lp0.clone().requires_grad_(True)
    loss = archer_policy_loss(old, lp, A, mask, low_entropy_mask=low)[0]
    (g1,) = torch.autograd.grad(loss, lp)
    r = torch.exp(lp0 - old)
    e = torch.where(low, 0.2, 0.4)
    n = mask.sum()
    gpos = torch.where(r < 1 / 3, -A * 3, torch.where(r <= 1 + e, -A / r, torch.zeros_like(r)))
    gneg = torch.where(r > 3, -A * 3, torch.where(r >= 1 - e, -A * r, torch.zeros_like(r)))
    want = torch.where(A < 0, gneg, gpos) * mask / n
    assert torch.allclose(g1, want, atol=1e-6)
    print("aspo_archer ok", round(loss.item(), 6))
