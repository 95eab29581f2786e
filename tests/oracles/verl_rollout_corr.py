"""Independent transcription of verl's rollout correction (IS weights, IcePop, rejection sampling).

Source: verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22),
verl/trainer/ppo/rollout_corr_helper.py:
  _parse_rollout_is_threshold (l.93), _parse_rollout_rs_thresholds (l.132),
  compute_rollout_rejection_mask (l.197), compute_rollout_correction_weights (l.522),
  compute_is_metrics (l.660), compute_rollout_correction_and_rejection_mask (l.786).
Config defaults: verl/trainer/config/algorithm/rollout_correction.yaml (rollout_is: null,
rollout_is_threshold: 2.0, rollout_rs: null, rollout_rs_threshold: null, batch_normalize: false).
Loss side: core_algos.py compute_policy_loss_vanilla (pg_losses * rollout_is_weights), agg_loss (l.1140).

Conventions are verl's: every tensor is (B, T) right-padded, response_mask (B, T) 0/1,
old_log_prob = trainer (FSDP) log-probs of the rollout policy, rollout_log_prob = vLLM/SGLang
log-probs.  log_ratio = old_log_prob - rollout_log_prob = log(pi_old / pi_rollout) = log rho.

Written from the behaviour of the source, not copied.
"""

from __future__ import annotations

import math

import torch

SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def _msum(x, m, axis=None):
    # verl_F.masked_sum: where(mask, x, 0) * mask, summed
    return (
        (torch.where(m.bool(), x, torch.zeros_like(x)) * m).sum(dim=axis)
        if axis is not None
        else (torch.where(m.bool(), x, torch.zeros_like(x)) * m).sum()
    )


def _mmean(x, m, axis=None):
    # verl_F.masked_mean: masked_sum / (mask.sum + 1e-8)
    den = m.sum(dim=axis) if axis is not None else m.sum()
    return _msum(x, m, axis) / (den + 1e-8)


def parse_is_threshold(spec) -> tuple[float, float | None]:
    """float / 'x' -> (upper, None) = TIS; 'lo_hi' -> (hi, lo) = IcePop."""
    if isinstance(spec, bool):
        raise TypeError("bool threshold")
    if isinstance(spec, (int, float)):
        return float(spec), None
    s = spec.strip()
    if "_" in s:
        lo, hi = s.split("_", 1)
        lo, hi = float(lo), float(hi)
        assert 0 < lo <= hi
        return hi, lo
    return float(s), None


def verl_rollout_is_weights(
    old_log_prob,
    rollout_log_prob,
    response_mask,
    rollout_is="token",
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=False,
):
    """Returns (weights (B, T) detached, metrics dict).

    token:    w_t = exp(clamp(lr_t, -20, 20)) * mask
    sequence: w_t = exp(clamp(sum_t mask*lr_t, -20, 20)) * mask   (product of token ratios)
    TIS (single threshold C):        w <- min(w, C)          (no lower truncation)
    IcePop ('lo_hi'):                 w <- w if lo <= w <= hi else 0   (mask NOT modified:
                                      zeroed tokens still count in every denominator)
    batch_normalize: divide by the batch mean of w (token: masked token mean; sequence: mean of
    per-sequence token means over sequences with >= 1 token), only if that mean > 1e-8.
    """
    assert rollout_is in ("token", "sequence")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    mask = response_mask.to(old_log_prob.dtype)
    lr = old_log_prob - rollout_log_prob
    if rollout_is == "token":
        lr_metrics = lr
        raw = torch.exp(torch.clamp(lr, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        lr_metrics = _msum(lr, mask, axis=-1).unsqueeze(-1)  # (B, 1)
        raw = torch.exp(torch.clamp(lr_metrics, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(lr)
    raw = raw * mask
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        keep = (raw >= lower) & (raw <= upper)
        w = torch.where(keep, raw, torch.zeros_like(raw))

    # metrics (a subset of compute_is_metrics; fractions measured on the RAW weights)
    lo_metric = 1.0 / upper if lower is None else lower
    metrics = {"rollout_is_mean": _mmean(w, mask).item()}
    if rollout_is == "sequence":
        metrics["rollout_is_ratio_fraction_high"] = (lr_metrics > math.log(upper)).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (lr_metrics < math.log(lo_metric)).float().mean().item()
        metrics["rollout_is_max"] = math.exp(min(lr_metrics.max().item(), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(lr_metrics.min().item())
    else:
        metrics["rollout_is_ratio_fraction_high"] = _mmean((raw > upper).float(), mask).item()
        metrics["rollout_is_ratio_fraction_low"] = _mmean((raw < lo_metric).float(), mask).item()
        b = mask.bool()
        metrics["rollout_is_max"] = w.masked_fill(~b, float("-inf")).max().item()
        metrics["rollout_is_min"] = w.masked_fill(~b, float("inf")).min().item()
    if lower is not None:
        oob = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = _mmean(oob.float(), mask).item()

    w = w.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = _mmean(w, mask)
        else:
            seq_w = _mmean(w, mask, axis=-1)
            seq_m = (mask.sum(-1) > 0).to(w.dtype)
            mean = (seq_w * seq_m).sum() / seq_m.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return w, metrics


def _parse_rs_thresholds(options, spec):
    if spec is None:
        raise ValueError("rollout_rs_threshold is required")
    raw = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(raw) == 1 and len(options) > 1:
        raw = raw * len(options)
    assert len(raw) == len(options)
    out = {}
    for opt, s in zip(options, raw):
        if opt.endswith("k1"):
            if "_" in s:
                lo, hi = (float(v) for v in s.split("_", 1))
            else:
                hi = float(s)
                lo = float(str(1.0 / hi))  # verl: str(1/upper) then float
            out[opt] = (lo, hi)
        else:
            assert "_" not in s
            out[opt] = (None, float(s))
    return out


def verl_rollout_rejection_mask(
    old_log_prob, rollout_log_prob, response_mask, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"
):
    """Returns (modified_response_mask, metrics).  All listed options must pass (logical AND).

    lr = clamp(old - rollout, -20, 20);  k1 = -lr;  k2 = lr^2 / 2;  k3 = exp(lr) - 1 - lr.
    k1 options keep  log(lo) <= stat <= log(hi)  (stat = -lr, its sequence sum or mean): note the
      bounds bound pi_rollout / pi_old (= 1/rho), i.e. rho in [1/hi, 1/lo].
    k2/k3 options keep stat <= hi.
    seq_sum / seq_mean use masked sum / masked mean over the sequence's tokens (mean: /(n+1e-8));
    seq_max: max over valid tokens (0 for an all-padding row).
    The returned mask multiplies response_mask: rejected tokens LEAVE the token-mean
    denominator (verl recomputes batch_num_tokens from this mask).
    """
    opts = []
    for o in (p.strip() for p in rollout_rs.split(",") if p.strip()):
        assert o in RS_OPTIONS, o
        if o not in opts:
            opts.append(o)
    thr = _parse_rs_thresholds(opts, rollout_rs_threshold)
    mask = response_mask.to(old_log_prob.dtype)
    mb = mask.bool()
    lr = torch.clamp(old_log_prob - rollout_log_prob, -SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}
    combined = torch.ones_like(mask)
    metrics = {}
    for o in opts:
        lo, hi = thr[o]
        k = stats[o[-2:]]
        if o.startswith("token"):
            stat = k
        elif o.startswith("seq_sum"):
            stat = _msum(k, mask, axis=-1).unsqueeze(-1)
        elif o.startswith("seq_mean"):
            stat = _mmean(k, mask, axis=-1).unsqueeze(-1)
        else:
            mx = k.masked_fill(~mb, float("-inf")).max(dim=-1).values
            stat = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx).unsqueeze(-1)
        if o.endswith("k1"):
            keep = (stat >= math.log(lo)) & (stat <= math.log(hi))
        else:
            keep = stat <= hi
        keep = keep.expand_as(mask)
        km = keep.to(mask.dtype)
        combined = combined * km
        metrics[f"rollout_rs_{o}_masked_fraction"] = _mmean(1 - km, mask).item()
    metrics["rollout_rs_masked_fraction"] = _mmean(1 - combined, mask).item()
    final_keep = (combined > 0.5) & mb
    metrics["rollout_rs_seq_masked_fraction"] = (~final_keep & mb).any(dim=-1).float().mean().item()
    return (response_mask * combined).to(response_mask.dtype), metrics


def verl_agg_token_mean(loss_mat, loss_mask, batch_num_tokens=None, dp_size=1):
    """verl agg_loss 'token-mean': masked_sum / batch_num_tokens * dp_size (global count if given)."""
    if batch_num_tokens is None:
        batch_num_tokens = loss_mask.sum()
    return _msum(loss_mat, loss_mask.to(loss_mat.dtype)) / batch_num_tokens * dp_size


def verl_vanilla_corrected(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    rollout_is_weights=None,
    clip_low=0.2,
    clip_high=0.2,
    clip_ratio_c=3.0,
):
    """compute_policy_loss_vanilla with the IS weight multiplied onto the clipped per-token loss,
    aggregated with token-mean over the (possibly RS-modified) response_mask."""
    lr = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(lr)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    c1 = torch.maximum(l1, l2)
    c2 = torch.min(-advantages * clip_ratio_c, c1)
    pg = torch.where(advantages < 0, c2, c1)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    return verl_agg_token_mean(pg, response_mask)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g) * 2
    roll = old + torch.randn(B, T, generator=g) * 0.3
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    rho = torch.exp(old - roll)
    w, m = verl_rollout_is_weights(old, roll, mask, "token", 2.0)
    assert torch.allclose(w, torch.minimum(rho, torch.tensor(2.0)) * mask)
    w, m = verl_rollout_is_weights(old, roll, mask, "token", "0.8_1.25")
    keep = (rho >= 0.8) & (rho <= 1.25)
    assert torch.allclose(w, torch.where(keep, rho, 0.0) * mask) and "rollout_is_oob_ratio" in m
    ws, _ = verl_rollout_is_weights(old, roll, mask, "sequence", 2.0)
    s = ((old - roll) * mask).sum(-1, keepdim=True)
    assert torch.allclose(ws, torch.exp(s).clamp(max=2.0) * mask)
    mm, m = verl_rollout_rejection_mask(old, roll, mask, "seq_mean_k1", "0.9_1.1")
    geo_inv = torch.exp(-((old - roll) * mask).sum(-1) / mask.sum(-1))  # pi_rollout/pi_old geo mean
    want = ((geo_inv >= 0.9) & (geo_inv <= 1.1)).float()[:, None] * mask
    assert torch.allclose(mm, want, atol=0)
    mm2, _ = verl_rollout_rejection_mask(old, roll, mask, "token_k3,seq_max_k2", "0.05,0.02")
    assert mm2.shape == mask.shape
    lp = old.clone().requires_grad_(True)
    A = torch.randn(B, 1, generator=g).expand(B, T)
    loss = verl_vanilla_corrected(lp, old, A, mm, w)
    loss.backward()
    print("verl_rollout_corr ok", round(loss.item(), 6), {k: round(v, 4) for k, v in m.items()})
