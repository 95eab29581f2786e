"""Rules users find in verl and TRL (and papers' code), each checked in value and gradient against an
independent transcription of the source's own formula, written here the way the source writes it
(masked sums, index assignment, log space ...), not by calling clipbench's rule.

Sources: verl verl/trainer/ppo/core_algos.py (verl-project/verl); TRL trl/trainer/grpo_trainer.py
(huggingface/trl); CE-GPPO's README (Kwai-Klear/CE-GPPO); DCPO's core_algos.py (lime-RL/DCPO).
"""

from __future__ import annotations

import math

import pytest
import torch

from clipbench.objectives import policy_loss


def make_batch(seed=0, B=16, T=12, spread=0.4, logp_hi=0.0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2.5 + logp_hi
    logp = (old + torch.randn(B, T, generator=g) * spread).clamp(max=-1e-3)
    A = torch.randn(B, generator=g)
    A[::5] = 0.0
    lens = torch.randint(2, T + 1, (B,), generator=g)  # no all-padding row (verl's seq means count every row)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    return logp, old, A, mask


def ours(method, logp, old, A, mask, agg="token-mean", **kw):
    lp = logp.clone().requires_grad_(True)
    out = policy_loss(method, lp, old, A, mask, agg=agg, **kw)
    (g,) = torch.autograd.grad(out.loss, lp)
    return out, g


def theirs(fn, logp, *args):
    lp = logp.clone().requires_grad_(True)
    loss = fn(lp, *args)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


def token_mean(loss_mat, mask):  # verl agg_loss "token-mean" with one micro-batch
    return (loss_mat * mask).sum() / mask.sum()


def check(method, ref, logp, old, A, mask, agg="token-mean", rtol=1e-5, atol=1e-7, **kw):
    out, g = ours(method, logp, old, A, mask, agg=agg, **kw)
    want, want_g = theirs(ref, logp, old, A, mask)
    torch.testing.assert_close(out.loss, want, rtol=rtol, atol=atol)
    torch.testing.assert_close(g, want_g, rtol=rtol, atol=atol)
    return out, g


# --------------------------------------------------------------------------------------------
# verl
# --------------------------------------------------------------------------------------------
def verl_vanilla(log_prob, old_log_prob, A, mask, cliprange=0.2, clip_ratio_c=3.0):
    adv = A[:, None].expand_as(log_prob)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-adv * clip_ratio_c, clip_pg_losses1)
    return token_mean(torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1), mask)


def test_verl_vanilla_is_dual_clip_with_its_defaults():
    logp, old, A, mask = make_batch(1, spread=0.9)
    r = torch.exp(logp - old)
    assert ((r > 3) & (A[:, None] < 0) & (mask > 0)).any()  # the dual clip binds
    check("dual_clip", verl_vanilla, logp, old, A, mask)  # defaults: eps 0.2/0.2, c = 3.0


def test_verl_gpg_and_dro():
    logp, old, A, mask = make_batch(2)
    check("gpg", lambda lp, o, a, m: token_mean(-lp * a[:, None], m), logp, old, A, mask)

    def verl_dro(log_prob, old_log_prob, a, m, beta=0.3):
        log_ratio = log_prob - old_log_prob
        return token_mean(-(log_prob * a[:, None] - 0.5 * beta * log_ratio.square()), m)

    check("dro", verl_dro, logp, old, A, mask, dro_beta=0.3)


def verl_clip_cov(log_prob, old_log_prob, A, mask, u, clip_cov_ratio, lb, ub, cliprange=0.2):
    adv = A[:, None].expand_as(log_prob)
    masked_mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    clip_by_origin = (pg_losses2 > pg_losses1) & (mask > 0)
    cov_all = (adv - masked_mean(adv)) * (log_prob - masked_mean(log_prob.detach()))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (mask > 0))
    # verl: torch.randperm(len(top_k_idx))[:clip_num]; here the same uniforms decide the order
    perm = torch.argsort(u[top_k_idx[:, 0], top_k_idx[:, 1]], stable=True)
    top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    corr = torch.ones_like(adv)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    return token_mean(torch.maximum(pg_losses1, pg_losses2) * corr, mask)


def test_verl_clip_cov_per_call():
    logp, old, A, mask = make_batch(3, spread=0.3)
    A[A == 0] = 0.3  # (A == 0 tokens can be candidates too; their loss is 0 either way)
    u = torch.rand(logp.shape, generator=torch.Generator().manual_seed(9))
    kw = dict(clip_cov_ratio=0.05, clip_cov_lb=0.01, clip_cov_ub=10.0)
    out, g = check(
        "clip_cov",
        lambda lp, o, a, m: verl_clip_cov(lp, o, a, m, u, 0.05, 0.01, 10.0),
        logp,
        old,
        A,
        mask,
        uniforms=u,
        **kw,
    )
    _, g_grpo = ours("grpo", logp, old, A, mask)
    detached = (g == 0) & (g_grpo != 0) & (mask > 0)
    assert int(detached.sum()) == max(int(0.05 * mask.sum()), 1)  # exactly clip_num candidates were detached


def verl_kl_cov(log_prob, old_log_prob, A, mask, kl_cov_ratio, ppo_kl_coef):
    adv = A[:, None].expand_as(log_prob)
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -adv * ratio
    pg_losses_kl = -adv * ratio + ppo_kl_coef * abs_kl
    all_valid = mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    valid_adv = adv[all_valid].detach().reshape(-1)
    valid_logp = log_prob[all_valid].detach().reshape(-1)
    cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
    k = max(1, int(len(cov) * kl_cov_ratio))
    idx = all_valid_idx[torch.topk(cov, k, largest=True).indices]
    T = adv.shape[1]
    pg_losses = pg_losses.clone()
    pg_losses[idx // T, idx % T] = pg_losses_kl[idx // T, idx % T]
    return token_mean(pg_losses, mask)


def test_verl_kl_cov_per_call():
    logp, old, A, mask = make_batch(4)
    check(
        "kl_cov",
        lambda lp, o, a, m: verl_kl_cov(lp, o, a, m, 0.1, 0.5),
        logp,
        old,
        A,
        mask,
        kl_cov_ratio=0.1,
        ppo_kl_coef=0.5,
    )


def verl_geo_mean(log_prob, old_log_prob, A, mask, cliprange_low, cliprange_high):
    adv = A[:, None].expand_as(log_prob)
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(adv)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (adv * mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    return torch.mean(-advantage * ratio)


def test_verl_geo_mean_gmpo():
    logp, old, A, mask = make_batch(5, spread=0.5)
    # verl averages the per-sequence losses: agg=seq-mean-token-mean (no all-padding row here)
    out, g = check(
        "geo_mean",
        lambda lp, o, a, m: verl_geo_mean(lp, o, a, m, 0.3, 0.25),
        logp,
        old,
        A,
        mask,
        agg="seq-mean-token-mean",
        eps_low=0.3,
        eps_high=0.25,
    )
    assert sum(out.stats[f"{c}/zero_grad"] for c in ("q1", "q3")) > 0  # clipped tokens have no gradient


def verl_dppo(log_prob, old_log_prob, A, mask, low, high, clip_ratio_c, kind):
    adv = A[:, None].expand_as(log_prob)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if kind == "tv":
        valid_positive_mask = (prob - old_prob) <= high
        valid_negative_mask = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        valid_positive_mask = (binary_kl <= high) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= low) | (prob >= old_prob)
    valid_mask = torch.where(adv > 0, valid_positive_mask, valid_negative_mask).detach().float()
    return token_mean(-adv * truncated_ratio * log_prob * valid_mask, mask)


@pytest.mark.parametrize("kind, low, high", [("tv", 0.1, 0.15), ("kl", 0.03, 0.05)])
def test_verl_dppo(kind, low, high):
    logp, old, A, mask = make_batch(6, spread=0.6, logp_hi=0.0)  # probabilities up to 1: real TV/KL moves
    out, g = check(
        f"dppo_{kind}",
        lambda lp, o, a, m: verl_dppo(lp, o, a, m, low, high, 2.0, kind),
        logp,
        old,
        A,
        mask,
        div_low=low,
        div_high=high,
        is_cap=2.0,
    )
    masked = ((g == 0) & (mask > 0) & (A[:, None] != 0)).sum()
    assert 0 < masked < (mask > 0).sum()  # some tokens outside the region, most inside


# --------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------
def test_trl_cispo_absolute_cap():
    logp, old, A, mask = make_batch(7, spread=1.0)

    def trl_cispo(per_token_logps, old_per_token_logps, a, m, epsilon_high=2.0):
        coef_1 = torch.exp(per_token_logps - old_per_token_logps)
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * a.unsqueeze(1) * per_token_logps
        return (per_token_loss * m).sum() / m.sum()  # num_items_in_batch on one process

    assert (torch.exp(logp - old)[mask > 0] > 2.0).any()
    check("cispo_cap", trl_cispo, logp, old, A, mask, cap=2.0)
    check("cispo", trl_cispo, logp, old, A, mask, eps_low=1.0, eps_high=1.0)  # cispo: the same as a two-sided clip


def trl_luspo(per_token_logps, old_per_token_logps, a, m, epsilon_low, epsilon_high):
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * a.unsqueeze(1), coef_2 * a.unsqueeze(1))
    return (per_token_loss * m.sum(1, keepdim=True)).mean()


def test_trl_luspo():
    logp, old, A, mask = make_batch(8, spread=0.05)
    ref = lambda lp, o, a, m: trl_luspo(lp, o, a, m, 2e-3, 2.5e-3)  # noqa: E731
    out, g = check("luspo", ref, logp, old, A, mask, agg="seq-mean-token-mean", rtol=1e-5, atol=1e-6)
    assert sum(out.stats[f"{c}/zero_grad"] for c in ("q1", "q3")) > 0  # some sequences clipped
    # the same as gspo with the same band under seq-mean-token-sum
    check(
        "gspo", ref, logp, old, A, mask, agg="seq-mean-token-sum", rtol=1e-5, atol=1e-6, eps_low=2e-3, eps_high=2.5e-3
    )


def test_trl_vespo():
    logp, old, A, mask = make_batch(9, spread=0.3)

    def trl_vespo(per_token_logps, old_per_token_logps, a, m, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
        adv = a.unsqueeze(1)
        with torch.no_grad():  # phi(W) = W^k exp(lambda (1 - W)), computed directly (TRL: in log space)
            log_ratio = torch.clamp(per_token_logps - old_per_token_logps, -20.0, 20.0)
            log_w = torch.clamp((log_ratio * m).sum(-1, keepdim=True), math.log(1e-8), 20.0)
            w = torch.exp(log_w)
            k = torch.where(adv >= 0, k_pos, k_neg)
            lam = torch.where(adv >= 0, lambda_pos, lambda_neg)
            phi = w**k * torch.exp(lam * (1 - w))
        per_token_loss = -phi * adv * per_token_logps
        return (per_token_loss * m).sum() / m.sum()

    out, g = check("vespo", trl_vespo, logp, old, A, mask, rtol=1e-4, atol=1e-6)
    assert out.stats["seq_ratio/max"] > 1.02 and out.stats["seq_ratio/min"] < 0.98  # W far from 1 both ways


# --------------------------------------------------------------------------------------------
# Papers' code
# --------------------------------------------------------------------------------------------
def ce_gppo_readme(log_prob, old_log_prob, A, mask, cliprange_low, cliprange_high, clip_ratio_c, beta1, beta2):
    adv = A[:, None].expand_as(log_prob)
    ratio = torch.exp(log_prob - old_log_prob)
    ratio_detached = ratio.detach()
    low_mask = (ratio < (1 - cliprange_low)) & (adv < 0)
    high_mask = (ratio > (1 + cliprange_high)) & (adv > 0)
    other_mask = ~(low_mask | high_mask)
    clip_pg_losses1 = torch.zeros_like(adv)
    clip_pg_losses1[low_mask] = (
        -beta1 * (1 - cliprange_low) / ratio_detached[low_mask] * ratio[low_mask] * adv[low_mask]
    )
    clip_pg_losses1[high_mask] = (
        -beta2 * (1 + cliprange_high) / ratio_detached[high_mask] * ratio[high_mask] * adv[high_mask]
    )
    clip_pg_losses1[other_mask] = -ratio[other_mask] * adv[other_mask]
    clip_pg_losses2 = torch.min(-adv * clip_ratio_c, clip_pg_losses1)
    return token_mean(torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1), mask)


def test_ce_gppo_readme():
    logp, old, A, mask = make_batch(10, spread=0.8)
    check(
        "ce_gppo",
        lambda lp, o, a, m: ce_gppo_readme(lp, o, a, m, 0.2, 0.25, 2.5, 0.5, 0.9),
        logp,
        old,
        A,
        mask,
        eps_low=0.2,
        eps_high=0.25,
        c=2.5,
        beta_low=0.5,
        beta_high=0.9,
    )


def dcpo_repo(log_prob, old_log_prob, A, mask, low_clip, high_clip, clip_ratio_c):
    adv = A[:, None].expand_as(log_prob)
    ref_prob = torch.exp(old_log_prob)  # get_clip_low_high(old_log_prob, ...)
    low_c_ref = 1 - torch.where(ref_prob != 0, 4 * low_clip / ref_prob, 0)
    low_c_ref = low_c_ref * (low_c_ref >= 0)
    high_c_ref = torch.where(ref_prob != 0, 1 + 4 * high_clip / ref_prob, float("inf"))
    low = (1 + torch.sqrt(low_c_ref)) / 2
    high = torch.clamp((1 + torch.sqrt(high_c_ref)) / 2, 0, max(clip_ratio_c, 10))
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, low, high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-adv * clip_ratio_c, clip_pg_losses1)
    return token_mean(torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1), mask)


def test_dcpo_repo():
    logp, old, A, mask = make_batch(11, spread=1.2, logp_hi=0.0)
    out, g = check("dcpo", lambda lp, o, a, m: dcpo_repo(lp, o, a, m, 0.2, 0.28, 10.0), logp, old, A, mask)
    assert sum(out.stats[f"{c}/zero_grad"] for c in ("q1", "q3")) > 0  # some tokens past their dynamic bound
