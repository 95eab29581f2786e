"""Independent transcription of SkyRL's off-policy correction: TIS, geometric / product sequence
mask, outlier-token sequence veto, token (IcePop) mask -- in SkyRL's order of application.

Source: NovaSky-AI/SkyRL @ a9564572eb8e91076be43c1bd5e4615e3de17265 (2026-08-21)
  skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py
      compute_tis_ratio (l.24-72), compute_outlier_token_mask (l.75-134), compute_token_mask (l.137-188),
      compute_sequence_mask (l.191-254), compute_off_policy_correction (l.257-348),
      apply_off_policy_correction (l.351-385)
  skyrl/backends/skyrl_train/utils/torch_utils.py  safe_exp_delta (clamp +-20 in fp32), masked_mean
  skyrl/backends/skyrl_train/utils/ppo_utils.py    ppo_policy_loss (l.555-587), reduce_loss (l.1145)
  skyrl/train/config/config.py OffPolicyCorrectionConfig (defaults below; all corrections off by default)
  docs/content/docs/algorithms/off_policy_correction.mdx (recommended: geometric 0.99/1.01 first)

Conventions are SkyRL's: (B, T); old_log_probs = trainer log-probs of the rollout policy,
rollout_logprobs = inference-engine log-probs; loss_mask (B, T) 0/1; advantages already
PRE-SCALED by the loss reduction (see skyrl_prompt_mean.py), so the loss is a plain masked SUM.
Written from the behaviour of the source, not copied.
"""

from __future__ import annotations

import torch

DEFAULTS = dict(
    tis_ratio_type=None,  # None | "token" | "sequence"
    token_tis_ratio_clip_high=2.0,
    sequence_tis_ratio_clip_high=5.0,
    sequence_mask_metric=None,  # None | "geometric" | "product"
    geo_mask_high=1.01,
    geo_mask_low=0.99,
    product_mask_high=2.0,
    product_mask_low=0.5,
    outlier_token_is_threshold_low=None,  # doc suggests 1e-4
    outlier_token_is_threshold_high=None,  # doc suggests 100
    token_mask_is_threshold_low=None,  # doc suggests 0.5 (both must be set)
    token_mask_is_threshold_high=None,  # doc suggests 2.0
)


def safe_exp_delta(delta, clip=20.0, out_dtype=None):
    return torch.clamp(delta.to(torch.float32), -clip, clip).exp().to(out_dtype or delta.dtype)


def _masked_mean(x, m, dim=None):
    return (
        (x * m).sum(dim=dim) / m.sum(dim=dim).clamp(min=1.0)
        if dim is not None
        else (x * m).sum() / m.sum().clamp(min=1.0)
    )


def skyrl_off_policy_correction(old_log_probs, rollout_logprobs, loss_mask, **cfg):
    """Returns (tis_ratio or None, metrics, new_loss_mask).

    rho_t = exp(clamp(old - rollout, +-20)).  Order (each step sees the mask left by the previous one):
      1 outlier veto: sequence kept iff every valid token has  low <= rho_t <= high  (strict < / >
        drop; a missing bound never drops).  Enabled if either bound is set.
      2 token mask (IcePop): token kept iff low <= rho_t <= high (both bounds required).
      3 TIS: token: min(rho_t, 2.0); sequence: min(exp(clamp(sum_t mask*log rho_t, +-20)), 5.0) (B, 1),
        the sum over the mask LEFT BY steps 1-2; detached.
      4 sequence mask: geometric: g = exp(clamp(sum_t mask*lr / max(n, 1), +-20)), kept iff
        geo_mask_low <= g <= geo_mask_high (0.99 / 1.01); product: exp(sum) in [0.5, 2.0];
        computed over the mask left by steps 1-2 (an all-masked row has g = 1 -> kept).
    Masks only zero the numerator: the denominator was fixed before (advantages pre-scaled with
    the original loss_mask), so masked tokens still count in token_mean / sequence_mean / prompt_mean.
    """
    c = dict(DEFAULTS, **cfg)
    apply_tis = c["tis_ratio_type"] is not None
    apply_seq = c["sequence_mask_metric"] is not None
    apply_outlier = c["outlier_token_is_threshold_low"] is not None or c["outlier_token_is_threshold_high"] is not None
    apply_tok = c["token_mask_is_threshold_low"] is not None and c["token_mask_is_threshold_high"] is not None
    if not (apply_tis or apply_seq or apply_outlier or apply_tok):
        return None, {}, loss_mask
    dt = old_log_probs.dtype
    lr = old_log_probs - rollout_logprobs
    rho = safe_exp_delta(lr, 20.0, dt)
    m = {
        "is_ratio_mean": _masked_mean(rho, loss_mask).mean().item(),
        "is_ratio_std": (rho * loss_mask).std().item(),  # over ALL B*T entries (zeros at padding)
        "is_ratio_max": (rho * loss_mask).max().item(),
        "is_ratio_min": (rho * loss_mask).min().item(),
    }  # 0 whenever any padding exists
    if apply_outlier:
        lo, hi = c["outlier_token_is_threshold_low"], c["outlier_token_is_threshold_high"]
        over = (rho > hi) & (loss_mask > 0) if hi is not None else torch.zeros_like(loss_mask, dtype=torch.bool)
        under = (rho < lo) & (loss_mask > 0) if lo is not None else torch.zeros_like(loss_mask, dtype=torch.bool)
        ok = ((~over & ~under) | (loss_mask == 0)).all(dim=-1, keepdim=True)
        n = float(ok.shape[0])
        m["outlier_seq_masked_ratio"] = ((~ok.squeeze(-1)).sum() / n).item()
        m["outlier_seq_over_high_ratio"] = (over.any(-1).sum() / n).item()
        m["outlier_seq_under_low_ratio"] = (under.any(-1).sum() / n).item()
        loss_mask = loss_mask * ok.float()
    if apply_tok:
        lo, hi = c["token_mask_is_threshold_low"], c["token_mask_is_threshold_high"]
        inb = (rho >= lo) & (rho <= hi)
        tm = (inb | (loss_mask == 0)).float()
        m["token_mask_ratio"] = (((~inb) & (loss_mask > 0)).sum() / (loss_mask > 0).sum().clamp(min=1)).item()
        loss_mask = loss_mask * tm
    tis = None
    if apply_tis:
        if c["tis_ratio_type"] == "token":
            cap = c["token_tis_ratio_clip_high"]
            m["tis_token_clip_high_ratio"] = (
                ((rho > cap) & (loss_mask > 0)).sum() / (loss_mask > 0).sum().clamp(min=1)
            ).item()
            tis = torch.clamp(rho, max=cap).detach()
        else:
            s = safe_exp_delta((lr * loss_mask).sum(dim=-1, keepdim=True), 20.0, dt)
            cap = c["sequence_tis_ratio_clip_high"]
            m["tis_seq_clip_high_ratio"] = ((s > cap).sum() / s.shape[0]).item()
            tis = torch.clamp(s, max=cap).detach()
    if apply_seq:
        if c["sequence_mask_metric"] == "geometric":
            n_tok = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
            gm = safe_exp_delta((lr * loss_mask).sum(dim=-1, keepdim=True) / n_tok, 20.0, dt)
            over, under = gm > c["geo_mask_high"], gm < c["geo_mask_low"]
            key = "geo_sequence_mask"
        else:
            sp = safe_exp_delta((lr * loss_mask).sum(dim=-1, keepdim=True), 20.0, dt)
            over, under = sp > c["product_mask_high"], sp < c["product_mask_low"]
            key = "product_sequence_mask"
        keep = ~over & ~under
        n = float(keep.shape[0])
        m[f"{key}_masked_ratio"] = ((~keep).sum() / n).item()
        m[f"{key}_over_high_ratio"] = (over.sum() / n).item()
        m[f"{key}_under_low_ratio"] = (under.sum() / n).item()
        loss_mask = loss_mask * keep.float()
    return tis, m, loss_mask


def skyrl_ppo_loss(
    log_probs,
    old_log_probs,
    advantages,
    loss_mask,
    rollout_logprobs=None,
    eps_clip_low=0.2,
    eps_clip_high=0.2,
    clip_ratio_c=None,
    **opc,
):
    """ppo_policy_loss ('regular', or 'dual_clip' when clip_ratio_c is given) + off-policy correction
    + reduce_loss = sum(loss * loss_mask).  `advantages` must already be pre-scaled."""
    ratio = safe_exp_delta(log_probs - old_log_probs, 20.0, log_probs.dtype)
    s1, s2 = ratio * advantages, ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high) * advantages
    loss = -torch.min(s1, s2)
    if clip_ratio_c is not None:
        loss = torch.where(advantages < 0, torch.min(-advantages * clip_ratio_c, loss), loss)
    metrics = {}
    if rollout_logprobs is not None:
        tis, metrics, loss_mask = skyrl_off_policy_correction(old_log_probs, rollout_logprobs, loss_mask, **opc)
        if tis is not None:
            loss = loss * tis
    return (loss * loss_mask).sum(), metrics


if __name__ == "__main__":
    g = torch.Generator().manual_seed(2)
    B, T = 5, 6
    old = -torch.rand(B, T, generator=g) * 2
    roll = old + torch.randn(B, T, generator=g) * 0.05
    roll[0, 1] = old[0, 1] + 12.0  # outlier token: rho ~ 6e-6 < 1e-4 -> veto row 0
    mask = torch.ones(B, T)
    mask[4, 3:] = 0
    tis, m, nm = skyrl_off_policy_correction(
        old,
        roll,
        mask,
        sequence_mask_metric="geometric",
        outlier_token_is_threshold_low=1e-4,
        outlier_token_is_threshold_high=100.0,
    )
    assert tis is None and nm[0].sum() == 0
    geo = torch.exp(((old - roll) * mask).sum(-1) / mask.sum(-1))
    for b in range(1, B):
        assert bool(nm[b].sum() > 0) == bool((geo[b] >= 0.99) & (geo[b] <= 1.01))
    lp = old.clone().requires_grad_(True)
    A = torch.randn(B, 1, generator=g) / mask.sum()  # token_mean pre-scaling
    loss, _ = skyrl_ppo_loss(
        lp,
        old,
        A,
        mask,
        roll,
        tis_ratio_type="token",
        token_mask_is_threshold_low=0.5,
        token_mask_is_threshold_high=2.0,
    )
    loss.backward()
    print("skyrl_off_policy ok", {k: round(v, 4) for k, v in m.items()})
