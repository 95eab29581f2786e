"""Independent transcriptions of M2PO (Second-Moment Trust Policy Optimization, arXiv 2510.01161).

Three public definitions disagree; all three are transcribed:

(A) AReaL  -- inclusionAI/AReaL @ 4aef98d8d818af55b43621aaadba047ae10f4e77
    areal/trainer/ppo/actor.py grpo_loss_fn (l.408-), _apply_m2po_masking (l.769-810),
    _get_m2po_loss_mask (l.813-850); areal/utils/functional/functional.py ppo_actor_loss_fn (l.429-);
    areal/api/cli_args.py PPOActorConfig.m2_threshold (default None = off);
    examples/math/gsm8k_m2po.yaml: m2_threshold 0.04, use_decoupled_loss true, eps_clip 0.0,
    ppo_n_minibatches 1, rejection_sampling {metric: ratio, upper: 5.0}.
    ALL valid tokens are candidates; M2 uses (log pi_behave - log pi_prox)^2 (the proximal policy,
    fixed during the update, NOT the current policy); the mask removes tokens from the call's
    denominator; the remaining tokens get AReaL's PPO loss (clip eps_clip / eps_clip_higher, optional
    dual clip c_clip).
(B) Paper / project page -- Algorithm 1 "M2PO Masking" (Infini-AI-Lab/M2PO docs/static/m2po-images/
    alg.jpg, m2po.jpg): candidates are the trust-region tokens T = {(A>0, r>1)} U {(A<0, r<1)};
    while mean_{i in T} M2_i > tau: mask argmax, remove it from T.  Objective
    J = (1 / sum_i |o_i|) sum_{i,t} M_{i,t} r_{i,t} A_{i,t}  (no clip; every token in the denominator).
    r = pi_theta / pi_behav (current policy).
(C) Official code -- Infini-AI-Lab/M2PO @ af54a3e8feffb7a66a8258003aebefa37759cec0 (2025-10-08)
    verl/trainer/ppo/core_algos.py _solve_tau_from_sorted_delta2 (l.683-723),
    _get_trust_region_tokens_delta_sq (l.726-755), kpo_clip_harmful_tokens (l.758-809),
    compute_m2po_policy_loss (l.812-867); verl/workers/actor/dp_actor.py (l.394-408) passes
    M2_budget / miniclip_low / miniclip_high from config.get(..., None);
    train-scripts/m2po-qwen-math-7b-s*.sh: M2_budget=0.04, miniclip_* NOT set -> None (floors off).
    NOT a mask: a water-filling level tau^2 over the trust-region tokens' delta^2, turned into the PPO
    clip band [e^-tau, e^tau]; clipped tokens get PPO's zero gradient, every token stays in the
    token-mean denominator; no dual clip.

Conventions: verl-style (B, T) tensors, advantages (B, T) token-level (GRPO: constant per row),
response/loss mask (B, T).  All three run once per loss call = per MICRO-batch in their frameworks.
Written from the behaviour of the sources, not copied.
"""

from __future__ import annotations

import torch


# ------------------------------------------------------------------------------------------------
# (A) AReaL
# ------------------------------------------------------------------------------------------------
def areal_m2po_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """old_logp = behaviour (inference) log-probs, prox_logp = proximal (recomputed) log-probs.
    Sort the valid tokens' m2 = (old - prox)^2 descending; mask the first k, k = the first index
    whose suffix mean (mean of the remaining tokens) is < m2_threshold (strict); if none, mask all
    but one.  AReaL uses torch.sort (unstable): ties at the cut are broken arbitrarily there; this
    transcription uses a stable sort (index order)."""
    lm = loss_mask.bool()
    m2 = (old_logp - prox_logp) ** 2
    sel = m2.reshape(-1)[lm.reshape(-1)]
    n = sel.numel()
    if n == 0:
        return lm
    srt, idx = torch.sort(sel, descending=True, stable=True)
    suffix = srt.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=srt.dtype)
    below = torch.nonzero(suffix / counts < m2_threshold).flatten()
    k = int(below[0]) if below.numel() > 0 else n - 1
    keep_sorted = torch.ones(n, dtype=torch.bool)
    keep_sorted[:k] = False
    keep = torch.empty_like(keep_sorted)
    keep[idx] = keep_sorted
    out = torch.zeros(lm.numel(), dtype=torch.bool)
    out[lm.reshape(-1)] = keep
    return out.view_as(lm)


def areal_m2po_loss(
    logprobs,
    old_logp,
    prox_logp,
    advantages,
    loss_mask,
    m2_threshold=0.04,
    eps_clip=0.2,
    eps_clip_higher=None,
    c_clip=None,
):
    """grpo_loss_fn with m2_threshold and no rejection sampling, token-level ratio.
    Returns (per-call loss, m2po mask).  Per-call loss = sum over KEPT tokens / (#kept or 1); the engine
    then multiplies by (original #valid tokens of the micro-batch / original #valid of the mini-batch)
    * dp (loss_weight_fn uses the unmasked loss_mask), so micro-batch weights ignore the M2PO mask."""
    m = areal_m2po_mask(old_logp, prox_logp, loss_mask, m2_threshold)
    count = m.count_nonzero() or 1
    ratio = torch.where(m, torch.exp(logprobs - prox_logp), torch.zeros_like(logprobs))
    hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    l1, l2 = -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + hi)
    pg = torch.max(l1, l2)
    if c_clip is not None:
        pg = torch.min(pg, torch.sign(advantages) * c_clip * advantages)  # = dual clip on A<0 only
    return torch.where(m, pg, torch.zeros_like(pg)).sum() / count, m


# ------------------------------------------------------------------------------------------------
# (B) Paper, Algorithm 1 + objective
# ------------------------------------------------------------------------------------------------
def paper_m2po_mask(log_prob, behav_log_prob, advantages, response_mask, tau=0.04):
    """M = 1 on every valid token except the trust-region tokens removed by Algorithm 1 (largest M2
    first) until the mean M2 over the REMAINING trust-region tokens is <= tau (loop while mean > tau;
    an emptied T stops the loop).  Ties: stable order."""
    lr = (log_prob - behav_log_prob).detach()
    valid = response_mask.bool()
    tr = valid & (((advantages > 0) & (lr > 0)) | ((advantages < 0) & (lr < 0)))
    m2 = lr**2
    sel = m2[tr]
    M = valid.clone()
    n = sel.numel()
    if n == 0:
        return M
    srt, idx = torch.sort(sel, descending=True, stable=True)
    suffix = srt.flip(0).cumsum(0).flip(0)
    means = suffix / torch.arange(n, 0, -1, dtype=srt.dtype)  # mean after removing the first i
    ok = torch.nonzero(means <= tau).flatten()
    k = int(ok[0]) if ok.numel() > 0 else n  # n: every T token removed
    drop_sorted = torch.zeros(n, dtype=torch.bool)
    drop_sorted[:k] = True
    drop = torch.empty_like(drop_sorted)
    drop[idx] = drop_sorted
    flat = M.reshape(-1).clone()
    pos = torch.nonzero(tr.reshape(-1)).flatten()
    flat[pos[drop]] = False
    return flat.view_as(M)


def paper_m2po_loss(log_prob, behav_log_prob, advantages, response_mask, tau=0.04):
    """-J, J = sum(M * r * A) / sum(response_mask), r = exp(log_prob - behav_log_prob); no clip."""
    M = paper_m2po_mask(log_prob, behav_log_prob, advantages, response_mask, tau)
    r = torch.exp(log_prob - behav_log_prob)
    return -(M.to(r.dtype) * r * advantages).sum() / response_mask.sum(), M


# ------------------------------------------------------------------------------------------------
# (C) Official Infini-AI-Lab/M2PO code
# ------------------------------------------------------------------------------------------------
def _official_tr_delta_sq(old_log_prob, log_prob, advantages, response_mask):
    mask = response_mask.bool()
    adv0 = advantages[:, 0]  # sequence sign from the first position
    pos, neg = adv0 > 1e-12, adv0 < -1e-12
    delta = old_log_prob - log_prob
    ratio = torch.exp(-delta)
    dsq = delta.pow(2)
    p = dsq[pos][(ratio[pos] > 1.0 + 1e-12) & mask[pos]]
    q = dsq[neg][(ratio[neg] < 1.0 - 1e-12) & mask[neg]]
    return torch.cat([p, q])


def _official_solve_tau(sorted_d2, target):
    # sorted ascending; first k with sum_{i<=k} v_i + (n-k-1)(v_k - 1e-12) >= target - 1e-12;
    # tau^2 = v_{k-1} - 1e-12 (k > 0) else tau = 0.  (Callers guarantee target < total.)
    n = sorted_d2.numel()
    cs = torch.cumsum(sorted_d2, dim=0)
    for k in range(n):
        left = float(cs[k].item())
        rest = n - k - 1
        vk = sorted_d2[k].item() - 1e-12
        if vk * rest + left >= target - 1e-12:
            if k == 0:
                return 0.0, cs[-1].item() / n
            after = (sorted_d2[k - 1].item() * (rest + 1) + float(cs[k - 1].item())) / n
            return float(sorted_d2[k - 1].item() - 1e-12) ** 0.5, after
    raise AssertionError("unreachable")


def official_m2po_bounds(old_log_prob, log_prob, advantages, response_mask, M2_budget=0.04):
    """Returns (ratio_low, ratio_high, M2_before, M2_after) as kpo_clip_harmful_tokens does."""
    d2 = _official_tr_delta_sq(old_log_prob, log_prob.detach(), advantages, response_mask)
    n = d2.numel()
    if n == 0:
        return 0.0, 100000, 0.0, 0.0
    target = M2_budget * float(n)
    m2_now = float(d2.sum().item() / n)
    if m2_now <= M2_budget + 1e-12:
        return 0.0, 100000, m2_now, m2_now
    tau, after = _official_solve_tau(torch.sort(d2)[0], target)
    lo = float(torch.exp(torch.tensor(-tau)).item())  # float32 round trip, as the source
    hi = float(torch.exp(torch.tensor(+tau)).item())
    return lo, hi, m2_now, after


def official_m2po_loss(
    old_log_prob, log_prob, advantages, response_mask, M2_budget=0.04, miniclip_low=None, miniclip_high=None
):
    """compute_m2po_policy_loss with loss_agg_mode token-mean (verl v0.4 masked_mean, per micro-batch).
    eps_low = 1 - ratio_low, eps_high = ratio_high - 1, floored at miniclip_* when given (the shipped
    scripts leave them None).  loss = token-mean of max(-A r, -A clamp(r, 1-eps_low, 1+eps_high))."""
    lo, hi, m2, m2_after = official_m2po_bounds(old_log_prob, log_prob, advantages, response_mask, M2_budget)
    eps_low, eps_high = 1 - lo, hi - 1
    if miniclip_low is not None and eps_low < miniclip_low:
        eps_low = miniclip_low
    if miniclip_high is not None and eps_high < miniclip_high:
        eps_high = miniclip_high
    ratio = torch.exp(log_prob - old_log_prob)
    pg = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
    m = response_mask.to(pg.dtype)
    loss = (pg * m).sum() / (m.sum() + 1e-8)
    return loss, {"m2po/clip_low": eps_low, "m2po/clip_high": eps_high, "m2po/M2": m2, "m2po/M2_after": m2_after}


if __name__ == "__main__":
    g = torch.Generator().manual_seed(5)
    B, T = 6, 8
    behav = -torch.rand(B, T, generator=g) * 2
    cur = behav + torch.randn(B, T, generator=g) * 0.3
    A = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.ones(B, T)
    mask[0, 5:] = 0
    # (A) AReaL: remaining mean of m2 < threshold, minimal number masked
    prox = cur.detach()
    mA = areal_m2po_mask(behav, prox, mask, 0.04)
    m2 = (behav - prox) ** 2
    assert m2[mA].mean() < 0.04 and (~mA & mask.bool()).sum() > 0
    lp = cur.clone().requires_grad_(True)
    la, _ = areal_m2po_loss(lp, behav, prox, A, mask)
    la.backward()
    # (B) paper
    lp = cur.clone().requires_grad_(True)
    lb, MB = paper_m2po_loss(lp, behav, A, mask)
    lr = cur - behav
    tr = mask.bool() & (((A > 0) & (lr > 0)) | ((A < 0) & (lr < 0)))
    kept_tr = tr & MB
    assert (lr[kept_tr] ** 2).mean() <= 0.04 and torch.equal(MB | tr, mask.bool())
    lb.backward()
    # (C) official: the capped mean of the trust-region delta^2 at tau^2 is <= budget
    lp = cur.clone().requires_grad_(True)
    lc, st = official_m2po_loss(behav, lp, A, mask)
    lc.backward()
    assert st["m2po/M2_after"] <= 0.04 + 1e-9 and st["m2po/M2"] > 0.04
    print(
        "m2po ok",
        {k: round(v, 5) for k, v in st.items()},
        "areal masked",
        int((~mA & mask.bool()).sum()),
        "paper masked",
        int((~MB & mask.bool()).sum()),
    )
