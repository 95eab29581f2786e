"""Independent transcription of TOPR (Tapered Off-Policy REINFORCE, arXiv 2503.14286) as ROLL ships it
(pg_variant=topr), plus the paper's sequence-level form for comparison.

ROLL source: alibaba/ROLL @ 8eb27cc2dc34c4d1310b169d9b86d339004d811a (2026-08-18)
  roll/pipeline/rlvr/actor_pg_worker.py ActorPGWorker.loss_func (l.26-168), _compute_topr_loss (l.253-331)
  roll/pipeline/agentic/agentic_actor_pg_worker.py _compute_topr_loss (l.260-349; same rule, scores from
      get_episode_scores, token ratio may be the 'segment' geometric ratio)
  roll/utils/functionals.py agg_loss (l.229-282)
  roll/configs/worker_config.py topr_positive_weight = topr_negative_weight = 1.0 (actor_train.*)
  roll/configs/base_config.py loss_agg_mode default "seq-mean-token-mean"
  examples/qwen2.5-7B-rlvr-offpolicy/rlvr_config.yaml (pg_variant topr, adv_estimator reinforce,
      batch-whitened advantages, advantage_clip 2.0)
Paper: Le Roux et al. 2025, eq. for grad J_TOPR: sum_{R>=0} mu R grad log pi(tau) +
  sum_{R<0} mu [pi(tau)/mu(tau)]_0^1 R grad log pi(tau)  (trajectory ratio, raw reward R, baseline c).

Conventions (ROLL's): log_probs, old_log_probs, advantages (B, T) (token-level, already zero at
padding; ROLL's log_probs are multiplied by the response mask), scores (B,) sequence reward,
response_mask (B, T).
Written from the behaviour of the sources, not copied.
"""

from __future__ import annotations

import torch


def roll_topr_token_loss(log_probs, old_log_probs, advantages, scores, positive_weight=1.0, negative_weight=1.0):
    """Per-token loss (B, T):
      score > 0  ('positive'):  -A_t * log p_t                         (plain PG, no ratio, no clip)
      score <= 0 ('negative'):  -sg(clamp(r_t, 0, 1)) * A_t * log p_t    r_t = exp(log p_t - log p_old_t)
    The split is on the sequence SCORE (reward), not on the advantage sign; the weight multiplies
    the ADVANTAGE (not the raw reward); the truncated ratio is PER TOKEN (not the trajectory ratio)."""
    ratio = torch.exp(log_probs - old_log_probs)
    pos = (scores > 0).float().unsqueeze(-1)
    neg = (scores <= 0).float().unsqueeze(-1)
    pos_loss = -advantages * log_probs * pos
    neg_loss = -torch.clamp(ratio, min=0.0, max=1.0).detach() * advantages * log_probs * neg
    return positive_weight * pos_loss + negative_weight * neg_loss


def roll_agg_loss(
    loss_mat,
    loss_mask,
    loss_agg_mode="seq-mean-token-mean",
    batch_num_tokens=None,
    global_valid_samples=None,
    weights=None,
):
    """ROLL agg_loss.  token-mean: sum(loss_mat * w_seq) / batch_num_tokens  -- NOTE: loss_mask is not
    applied in the numerator (ROLL relies on loss_mat being 0 off-mask); seq-mean-token-mean:
    sum_seq(masked token mean * w_seq * [seq non-empty]) / (global_valid_samples + 1e-8), token mean
    = sum/(n + 1e-8), 0 for n == 0; seq-mean-token-sum(-norm) analogous (norm: / T).
    batch_num_tokens / global_valid_samples default to this call's own counts."""
    m = loss_mask.to(loss_mat.dtype)
    if batch_num_tokens is None:
        batch_num_tokens = m.sum()
    if global_valid_samples is None:
        global_valid_samples = loss_mat.size(0)
    if weights is None:
        weights = torch.ones(loss_mat.shape[0], dtype=loss_mat.dtype)
    valid = (m > 0).any(dim=-1).to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return (loss_mat * weights.unsqueeze(-1)).sum() / batch_num_tokens
    if loss_agg_mode == "seq-mean-token-mean":
        n = m.sum(dim=-1)
        seq = torch.where(n > 0, (loss_mat * m).sum(dim=-1) / (n + 1e-8), torch.zeros_like(n))
        return (seq * weights * valid).sum() / (global_valid_samples + 1e-8)
    seq = (loss_mat * m).sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return (seq * weights * valid).sum() / (global_valid_samples + 1e-8)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return (seq * weights * valid).sum() / loss_mask.shape[-1]
    raise ValueError(loss_agg_mode)


def paper_topr_seq_loss(log_probs, old_log_probs, rewards, response_mask):
    """Paper form, one loss per sequence: -sg(w) * R * sum_t log p_t with w = 1 for R >= 0 and
    w = clamp(exp(sum_t (log p - log mu)), 0, 1) for R < 0.  (R = reward minus the baseline c.)
    Returned per sequence (B,); the paper averages over the dataset/batch."""
    m = response_mask.to(log_probs.dtype)
    seq_lp = (log_probs * m).sum(-1)
    w = torch.where(
        rewards < 0, torch.exp(((log_probs - old_log_probs) * m).sum(-1)).clamp(0, 1), torch.ones_like(rewards)
    ).detach()
    return -w * rewards * seq_lp


if __name__ == "__main__":
    g = torch.Generator().manual_seed(6)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=g) * 2
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    lp = ((old + torch.randn(B, T, generator=g) * 0.3) * mask).requires_grad_(True)
    scores = torch.tensor([1.0, 0.0, 1.0, -1.0])
    A = torch.tensor([0.8, -0.4, 0.3, -0.7])[:, None] * mask
    l = roll_agg_loss(roll_topr_token_loss(lp, old * mask, A, scores), mask)
    (gr,) = torch.autograd.grad(l, lp)
    r = torch.exp(lp.detach() - old * mask)
    n = mask.sum(-1, keepdim=True)
    want = torch.where(scores[:, None] > 0, -A, -r.clamp(0, 1) * A) / n / B * mask
    assert torch.allclose(gr, want, atol=1e-6)
    print("topr ok", round(l.item(), 6))
