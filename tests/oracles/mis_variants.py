"""Independent transcriptions of masked / truncated IS corrections (IcePop, MIS, veto) in slime,
OpenRLHF, NeMo-RL, open-instruct and AReaL.  rho_t = pi_old(y_t) / pi_sampler(y_t) throughout
(AReaL: pi_proximal / pi_behave).  All return per-token multipliers (detached) and, where the
framework changes it, the new loss mask; the NOTES say which denominators each one keeps.

Sources (all read at the commit given; line numbers approximate):
  THUDM/slime @ 624b824a898ab0ec1fcb4d373004c7f3852bf515
    examples/train_infer_mismatch_helper/mis.py  calculate_veto_mask (l.82), truncate/clip/mask
        (l.103-147), compute_mis_weights (l.150-307); mis.yaml (example config)
    slime/backends/megatron_utils/loss.py vanilla_tis_function (l.884), icepop_function (l.908);
        slime/utils/arguments.py --tis-clip 2.0, --tis-clip-low 0
  OpenRLHF/OpenRLHF @ 3c3be6234e0cb353e76bb8019947db9dfe99fca7  openrlhf/models/loss.py PolicyLoss.forward
        (l.155-231); openrlhf/cli/train_ppo_ray.py --algo.advantage.is_correction_threshold [0.5, 5.0],
        --algo.advantage.is_correction_type tis|icepop|seq-mask-tis (default tis)
  NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909  nemo_rl/algorithms/loss/loss_functions.py
        ClippedPGLossConfig (l.111-160), ClippedPGLossFn.__call__ (IS block ~l.570-680)
  allenai/open-instruct @ e6c3044aa6201c8bfa4573c1b03142af599e730d  open_instruct/grpo_utils.py
        GRPOExperimentConfig rho_* fields, _rho_drop_masks (l.372), compute_rho_correction (l.410)
  inclusionAI/AReaL @ 4aef98d8d818af55b43621aaadba047ae10f4e77  areal/utils/functional/functional.py
        _check_bounds (l.167), apply_rejection_sampling (l.185, 2D padded path), ppo_actor_loss_fn (l.429);
        areal/api/cli_args.py RejectionSamplingConfig (l.1224); areal/utils/data.py KLEstimator._compute_approx_kl
Written from the behaviour of the sources, not copied.
"""

from __future__ import annotations

import torch

# ------------------------------------------------------------------------------------------------
# slime (per-sequence 1-D tensors, as slime passes them)
# ------------------------------------------------------------------------------------------------
SLIME_MIS_YAML = dict(
    use_tis=True,
    use_rs=True,
    tis_level="token",
    rs_level="token",
    tis_mode="truncate",
    tis_lower_bound=0.5,
    tis_upper_bound=2.0,
    rs_lower_bound=None,
    rs_upper_bound=None,
    rs_veto_threshold=1e-4,
    tis_batch_normalize=True,
)


def slime_compute_mis_weights(train_log_probs, rollout_log_probs, loss_masks, **args):
    """Lists of 1-D tensors (one per sequence).  Returns (weights list, modified masks list).

    log ratio per level: token: d_t; sequence: sum_t m*d (broadcast); geometric: sum/max(n,1) (broadcast).
    w = exp(clamp(., +-20)).  tis_mode truncate: clamp(w, 0, upper)*m; clip: clamp(w, lower, upper)*m;
    mask: w*m and mask <- m * [lower <= w <= upper].  tis_lower default 1/upper.
    RS (use_rs): mask <- mask * [rs_lower <= w_rs <= rs_upper] with rs bounds defaulting to the TIS
    bounds, w_rs at rs_level; veto: the whole sequence's mask <- 0 if ANY valid token has
    raw d_t < log(veto) (low side only; default 1e-4 in mis.yaml).
    batch_normalize: w / (token mean of w over all sequences' ORIGINAL masks) (token level) or
    / (mean over sequences of their token means) (sequence level), if that mean > 1e-8.
    slime keeps the ORIGINAL per-rollout denominators (rollout_mask_sums): masked tokens still count.
    """
    a = dict(SLIME_MIS_YAML, **args)
    tis_lo = a["tis_lower_bound"] if a["tis_lower_bound"] is not None else 1.0 / a["tis_upper_bound"]
    rs_lo = a["rs_lower_bound"] if a["rs_lower_bound"] is not None else tis_lo
    rs_hi = a["rs_upper_bound"] if a["rs_upper_bound"] is not None else a["tis_upper_bound"]
    if not a["use_tis"]:
        return None, loss_masks

    def level_lr(d, m, level):
        if level == "token":
            return d
        if level == "sequence":
            return (d * m).sum().expand_as(d)
        return ((d * m).sum() / torch.clamp_min(m.sum(), 1)).expand_as(d)

    ws, ms = [], []
    for tr, ro, m in zip(train_log_probs, rollout_log_probs, loss_masks):
        m = m.float()
        d = tr - ro
        new_m = m.clone()
        lt = level_lr(d, m, a["tis_level"])
        w = torch.exp(torch.clamp(lt, -20.0, 20.0))
        if a["tis_mode"] == "truncate":
            w = w.clamp(0, a["tis_upper_bound"]) * m
        elif a["tis_mode"] == "clip":
            w = w.clamp(tis_lo, a["tis_upper_bound"]) * m
        elif a["tis_mode"] == "mask":
            new_m = m * ((w >= tis_lo) & (w <= a["tis_upper_bound"])).float()
            w = w * m
        if a["use_rs"]:
            lrs = lt if a["rs_level"] == a["tis_level"] else level_lr(d, m, a["rs_level"])
            wr = torch.exp(torch.clamp(lrs, -20.0, 20.0))
            new_m = new_m * ((wr >= rs_lo) & (wr <= rs_hi)).float()
            if a["rs_veto_threshold"] is not None:
                cat = (d < torch.log(torch.tensor(a["rs_veto_threshold"]))) & m.bool()
                new_m = new_m * (~cat.any()).float()
        ws.append(w.detach())
        ms.append(new_m.detach())
    if a["tis_batch_normalize"]:
        if a["tis_level"] == "token":
            mean = sum((w * m).sum() for w, m in zip(ws, loss_masks)) / torch.clamp_min(
                sum(m.sum() for m in loss_masks), 1
            )
        elif a["tis_level"] == "sequence":
            mean = sum((w * m).sum() / torch.clamp_min(m.sum(), 1) for w, m in zip(ws, loss_masks)) / len(ws)
        else:
            raise ValueError("slime raises for tis_level='geometric' with batch normalization")
        if mean > 1e-8:
            ws = [w / mean for w in ws]
    return ws, ms


def slime_icepop_weight(old_log_probs, rollout_log_probs, tis_clip=2.0, tis_clip_low=0.0):
    """slime core icepop_function: w = rho if tis_clip_low <= rho <= tis_clip else 0 (flat tokens)."""
    rho = torch.exp(old_log_probs - rollout_log_probs)
    return torch.where((rho >= tis_clip_low) & (rho <= tis_clip), rho, torch.zeros_like(rho))


def slime_vanilla_tis_weight(old_log_probs, rollout_log_probs, tis_clip=2.0, tis_clip_low=0.0):
    return torch.clamp(torch.exp(old_log_probs - rollout_log_probs), min=tis_clip_low, max=tis_clip)


# ------------------------------------------------------------------------------------------------
# OpenRLHF (applies only for policy_loss_type == "ppo"; multiplies the clipped per-token loss)
# ------------------------------------------------------------------------------------------------
def openrlhf_is_weight(old_log_probs, rollout_log_probs, action_mask, kind="tis", thresholds=(0.5, 5.0)):
    lo, hi = thresholds
    lr = old_log_probs - rollout_log_probs
    rho = torch.exp(lr).detach()
    if kind == "icepop":
        return rho * ((rho >= lo) & (rho <= hi))
    if kind == "seq-mask-tis":  # geometric-mean filter, RAW (untruncated) token weights
        am = action_mask.to(lr.dtype)
        geo = torch.exp((lr * am).sum(-1) / am.sum(-1))  # openrlhf masked_mean (no clamp)
        return ((geo >= lo) & (geo <= hi)).unsqueeze(-1) * rho
    return torch.exp(lr).clamp(min=lo, max=hi).detach()  # "tis": two-sided clamp


# ------------------------------------------------------------------------------------------------
# NeMo-RL (ClippedPGLossFn; weights multiply the clipped loss; masks unchanged)
# ------------------------------------------------------------------------------------------------
def nemo_rl_is_weight(
    prev_logprobs, generation_logprobs, mask, kind=None, ratio_max=None, ratio_min=None, sequence_level=False
):
    """mask = token_mask * sample_mask (NeMo takes the seq-mask-tis geometric mean over token_mask
    alone; equal here when sample_mask is all ones).  kind None | 'tis' | 'icepop' | 'seq-mask-tis'.
    tis: clamp(w, ratio_min or 0, ratio_max); icepop: w if ratio_min <= w <= ratio_max else 0;
    seq-mask-tis: raw token w * [ratio_min <= exp(masked mean_t log rho) <= ratio_max]
    (comment's reference bounds: icepop 0.5-5, seq-mask-tis 0.999-1.002)."""
    if sequence_level:
        w = torch.exp(((prev_logprobs - generation_logprobs) * mask).sum(-1)).detach()
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0).unsqueeze(-1)
    else:
        w = torch.nan_to_num(torch.exp(prev_logprobs - generation_logprobs), nan=0.0, posinf=0.0, neginf=0.0)
    if ratio_max is None or kind is None:
        return w
    if kind == "tis":
        return torch.clamp(w, min=0.0 if ratio_min is None else ratio_min, max=ratio_max)
    if kind == "icepop":
        return torch.where((w >= ratio_min) & (w <= ratio_max), w, torch.zeros_like(w))
    lr = torch.nan_to_num(prev_logprobs - generation_logprobs, nan=0.0, posinf=0.0, neginf=0.0)
    geo = torch.exp((lr * mask).sum(-1) / (mask.sum(-1) + 1e-8)).detach()  # nemo masked_mean: /(n + 1e-8)
    return w * ((geo >= ratio_min) & (geo <= ratio_max)).float().unsqueeze(-1)


# ------------------------------------------------------------------------------------------------
# open-instruct (compute_rho_correction); weights multiply the per-token loss, denominator unchanged
# ------------------------------------------------------------------------------------------------
OI_DEFAULTS = dict(
    use_rho_correction=True,
    rho_clamp_lower_bound=0.0,
    rho_clamp_upper_bound=2.0,
    rho_mask_lower_bound=0.0,
    rho_mask_upper_bound=0.0,
    rho_mask_sequence_level=False,
)


def open_instruct_rho_weights(old_logprob, vllm_logprobs, response_mask, **cfg):
    """response_mask bool.  d = clamp(old - vllm, +-10) on valid tokens (0 elsewhere); rho = exp(d);
    effective rho = exp(sequence mean of d) if rho_mask_sequence_level else rho;
    drop where rho_eff < mask_lower (if > 0) or rho_eff > mask_upper (if > 0);
    weight = clamp(rho_eff, clamp_lower (if > 0), clamp_upper (if > 0)) on kept valid tokens, else 0.
    (the TV-divergence variant, rho_mask_tv_divergence, is not transcribed)."""
    c = dict(OI_DEFAULTS, **cfg)
    d = torch.where(response_mask, (old_logprob - vllm_logprobs).clamp(-10.0, 10.0), torch.zeros_like(old_logprob))
    rho = torch.exp(d)
    if not c["use_rho_correction"]:
        return torch.ones_like(rho)
    if c["rho_mask_sequence_level"]:
        v = response_mask.float()
        eff = torch.exp(((d * v).sum(-1, keepdim=True) / v.sum(-1, keepdim=True).clamp_min(1.0)).expand_as(d))
    else:
        eff = rho
    lo, hi = c["rho_mask_lower_bound"], c["rho_mask_upper_bound"]
    drop_lo = (eff < lo) & response_mask if lo > 0.0 else torch.zeros_like(response_mask)
    drop_hi = (eff > hi) & response_mask if hi > 0.0 else torch.zeros_like(response_mask)
    keep = response_mask & ~drop_lo & ~drop_hi
    w = eff
    if c["rho_clamp_lower_bound"] > 0.0:
        w = torch.clamp(w, min=c["rho_clamp_lower_bound"])
    if c["rho_clamp_upper_bound"] > 0.0:
        w = torch.clamp(w, max=c["rho_clamp_upper_bound"])
    return torch.where(keep, w, torch.zeros_like(w))


# ------------------------------------------------------------------------------------------------
# AReaL rejection sampling (2-D padded path); decoupled PPO: rho = pi_prox / pi_behave
# ------------------------------------------------------------------------------------------------
def areal_rejection_sampling(
    proximal_logprobs,
    old_logprobs,
    loss_mask,
    level="token",
    action="mask",
    metric="ratio",
    agg="mean",
    upper=5.0,
    lower=None,
):
    """Returns (new_loss_mask bool, behave_imp_weight, filtered_fraction).  Defaults = RejectionSamplingConfig.
    lr = prox - behave (fp32, non-finite -> 0).  metric: ratio = exp(lr); kl_k1 = lr; kl_k2 = lr^2/2;
    kl_k3 = exp(-lr) - 1 + lr  (note: the OPPOSITE direction from verl's k3 = exp(lr) - 1 - lr).
    in-bounds: lower <= metric <= upper (upper only if lower is None).
    sequence level: ratio metric aggregates lr in log space (sum / mean=geometric / max) and the
    correction weight becomes the sequence geometric mean exp(mean lr) for every token; KL metrics
    aggregate arithmetically.  mask action: drop out-of-bounds tokens/sequences, weight = raw rho on
    kept tokens.  clamp action (ratio only; lower defaults to 0): clamp the weight (token) or clamp
    the weights of out-of-bounds sequences.  ppo_actor_loss_fn divides by the ORIGINAL valid count:
    masked tokens still count in the denominator."""
    lm = loss_mask.bool()
    lr = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    lr = torch.where(torch.isfinite(lr), lr, torch.zeros_like(lr))
    if metric == "ratio":
        met = torch.exp(lr)
    elif metric == "kl_k1":
        met = lr
    elif metric == "kl_k2":
        met = lr**2 / 2.0
    else:
        met = torch.exp(-lr) - 1 - (-lr)
    w = torch.exp(lr)
    orig_w = w

    def inb(x):
        return (x >= lower) & (x <= upper) if lower is not None else x <= upper

    if level == "sequence":
        use_log = metric == "ratio"
        vals = lr if use_log else met
        mv = torch.where(lm, vals, torch.zeros_like(vals))
        cnt = lm.sum(-1, keepdim=True).clamp(min=1)
        if use_log:
            w = torch.exp(mv.sum(-1, keepdim=True) / cnt).expand_as(lr)
            orig_w = w
        if agg == "sum":
            s = mv.sum(-1, keepdim=True)
        elif agg == "mean":
            s = mv.sum(-1, keepdim=True) / cnt
        else:
            s = vals.masked_fill(~lm, float("-inf")).max(-1, keepdim=True)[0]
            s = torch.where(lm.sum(-1, keepdim=True) == 0, torch.zeros_like(s), s)
        sm = torch.exp(s) if use_log else s
        if action == "mask":
            keep = inb(sm).expand_as(lm)
        else:
            oob = (~inb(sm)).expand_as(lm)
            w = torch.where(oob, w.clamp(min=lower if lower is not None else 0.0, max=upper), w)
    else:
        if action == "mask":
            keep = inb(met)
        else:
            w = w.clamp(min=lower if lower is not None else 0.0, max=upper)
    if action == "mask":
        new = lm & keep
        frac = (lm & ~keep).sum().item() / max(lm.sum().item(), 1)
    else:
        new = lm
        frac = (lm & (orig_w != w)).sum().item() / max(lm.sum().item(), 1)
    w = torch.where(new, w, torch.zeros_like(w))
    return new, w, frac


if __name__ == "__main__":
    g = torch.Generator().manual_seed(4)
    B, T = 3, 5
    old = -torch.rand(B, T, generator=g) * 2
    ro = old + torch.randn(B, T, generator=g) * 0.4
    ro[1, 0] = old[1, 0] + 10.0  # catastrophic token -> slime veto of row 1
    mask = torch.ones(B, T)
    mask[2, 4] = 0
    ws, ms = slime_compute_mis_weights(list(old), list(ro), list(mask))
    assert ms[1].sum() == 0
    rho = torch.exp(old - ro)
    assert torch.allclose(slime_icepop_weight(old, ro), torch.where(rho <= 2.0, rho, 0.0))
    w = openrlhf_is_weight(old, ro, mask, "icepop")
    assert torch.allclose(w, torch.where((rho >= 0.5) & (rho <= 5.0), rho, 0.0))
    w = nemo_rl_is_weight(old, ro, mask, "seq-mask-tis", 1.002, 0.999)
    w = open_instruct_rho_weights(old, ro, mask.bool(), rho_mask_lower_bound=0.5, rho_mask_upper_bound=2.0)
    nm, bw, f = areal_rejection_sampling(old, ro, mask)
    assert torch.equal(nm, mask.bool() & (rho <= 5.0))
    print("mis_variants ok; areal filtered fraction", round(f, 4))
