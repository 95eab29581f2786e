"""The built-in sampler corrections, each with the defaults of the implementation it follows.

Notation: d = log rho = log pi_old(y_t) - log pi_sampler(y_t) (pi_old: the trainer's log-probs of
the rollout policy, `sampler.old_logp: recompute`); rho = exp(d), value-clamped to [e^-20, e^20]
where a source clamps it (verl's SAFETY_BOUND, SkyRL's safe_exp_delta); n = the row's valid tokens;
bands are closed (a value on a bound is kept) unless the source drops on the bound.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from clipbench.objectives.corrections.registry import applied, correction
from clipbench.objectives.signature import nonneg, positive, unit_interval

SAFETY = 20.0  # verl's SAFETY_BOUND, SkyRL's safe_exp_delta clip
VERL = "verl-project/verl @ 1dda039 verl/trainer/ppo/rollout_corr_helper.py (the same in verl 0.9.1)"
SKYRL = (
    "NovaSky-AI/SkyRL @ a956457 skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py "
    "(docs/content/docs/algorithms/off_policy_correction.mdx)"
)
TRL = "huggingface/trl @ f2cd577 (TRL 1.16) grpo_trainer.py _generate_and_score_completions"
OPEN_INSTRUCT = (
    "allenai/open-instruct @ e6c3044 open_instruct/grpo_utils.py compute_rho_correction "
    "(rho_mask_tv_divergence, added in 61afa04, #1681)"
)


def ratio(d: torch.Tensor) -> torch.Tensor:
    """rho = exp(clamp(d, -20, 20))."""
    return torch.exp(d.clamp(-SAFETY, SAFETY))


def seq_sum(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1) sum over the row's valid tokens (log of the product ratio)."""
    return torch.where(mask, d, 0.0).sum(-1, keepdim=True)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1) mean over the row's valid tokens (0 for a row without one)."""
    return seq_sum(x, mask) / mask.sum(-1, keepdim=True).clamp(min=1)


def _band(lo_name: str, hi_name: str, *, lo_max: float = 1.0):
    def check(p):
        if not p[lo_name] <= lo_max <= p[hi_name]:
            return f"needs {lo_name} <= {lo_max:g} <= {hi_name} (a band around rho = 1), got {p[lo_name]:g}, {p[hi_name]:g}"
        return None

    return check


@correction(
    "tis",
    source=f"Yao et al. 2025 (truncated IS); {VERL} compute_rollout_correction_weights "
    f"(rollout_is: token|sequence, rollout_is_threshold: 2.0); {TRL} token_truncate / sequence_truncate",
    level=lambda p: p["level"],
    checks={"cap": lambda v: None if v >= 1 else "must be >= 1", "floor": unit_interval},
    check=lambda p: None if p["floor"] < p["cap"] else "needs floor < cap",
)
def tis(d, mask, *, level: Literal["token", "sequence"] = "token", cap: float = 2.0, floor: float = 0.0):
    """w = clamp(rho, floor, cap) per token, or of the sequence's product ratio exp(sum_t d) on all its tokens: truncated importance sampling

    cap 2.0 is verl's rollout_is_threshold (and SkyRL's token cap); floor 0 is no lower truncation
    (verl; TRL's clip_min=None; OpenRLHF truncates to [0.5, 5]). The exponent is clamped at log cap
    before exp (no overflow; below, exp(d) exactly: verl floors it at e^-20). The former keys
    sampler.mismatch_is / mismatch_is_cap read as this correction.
    """
    x = d if level == "token" else seq_sum(d, mask)  # (B, T) or (B, 1)
    w = torch.exp(x.clamp(max=math.log(cap))).clamp(min=floor)
    return applied(w, torch.exp(x.clamp(-SAFETY, SAFETY)), truncated=(x > math.log(cap)) | (torch.exp(x) < floor))


@correction(
    "icepop",
    source=f"IcePop (Ring-1T, arXiv 2510.18855); {VERL} rollout_is with threshold 'lo_hi' "
    f"(presets decoupled_token_icepop / bypass_pg_token_icepop: 0.5_5.0); {TRL} token_mask / "
    "sequence_mask (clip_min, clip_max)",
    level=lambda p: p["level"],
    checks={"low": nonneg, "high": lambda v: None if v <= 1e8 else "must be <= 1e8"},
    check=_band("low", "high"),
)
def icepop(
    d,
    mask,
    *,
    level: Literal["token", "sequence"] = "token",
    low: float = 0.5,
    high: float = 5.0,
    weight: Literal["rho", "one"] = "rho",
):
    """rho if low <= rho <= high else 0, per token or on the sequence's product ratio: IcePop / masked importance sampling (MIS)

    Masked tokens stay in every denominator (verl: weight 0 with the response mask untouched; TRL
    likewise). weight=one keeps a weight of 1 on kept tokens (SkyRL's token mask without TIS).
    TRL's default (sequence_mask) is level=sequence, low=0, high=3.
    """
    x = ratio(d) if level == "token" else ratio(seq_sum(d, mask))
    keep = (x >= low) & (x <= high)
    return applied(torch.where(keep, x if weight == "rho" else torch.ones_like(x), 0.0), x, masked=~keep)


@correction(
    "geo_mask",
    source=f"{SKYRL} compute_sequence_mask (sequence_mask_metric: geometric, geo_mask_low/high "
    "0.99/1.01: SkyRL's recommended first correction); OpenRLHF / NeMo-RL seq-mask-tis (weight=rho)",
    level="sequence",
    checks={"low": positive},
    check=_band("low", "high"),
)
def geo_mask(d, mask, *, low: float = 0.99, high: float = 1.01, weight: Literal["one", "rho"] = "one"):
    """g = exp(mean_t d) over the row's valid tokens; the whole row weighs 0 unless low <= g <= high: geometric-mean sequence mask

    SkyRL keeps a weight of 1 (the mask alone); OpenRLHF and NeMo-RL's seq-mask-tis keep the raw
    token rho (weight=rho). Masked rows stay in the denominators (SkyRL pre-scales its advantages
    by the unmasked counts). A row without valid tokens has g = 1.
    """
    g = ratio(seq_mean(d, mask))  # (B, 1)
    keep = (g >= low) & (g <= high)
    kept = ratio(d) if weight == "rho" else torch.ones_like(d)
    return applied(torch.where(keep, kept, 0.0), g, masked=~keep)


@correction(
    "veto",
    source=f"{SKYRL} compute_outlier_token_mask (outlier_token_is_threshold_low/high, suggested "
    "1e-4 / 100); THUDM/slime @ 624b824 examples/train_infer_mismatch_helper/mis.py calculate_veto_mask "
    "(low side only, rs_veto_threshold 1e-4)",
    level="sequence",
    checks={"low": positive},
    check=_band("low", "high"),
)
def veto(d, mask, *, low: float = 1e-4, high: float = 100.0, sides: Literal["both", "low"] = "both"):
    """the whole row weighs 0 if any valid token has rho < low (or, sides=both, rho > high), else 1: sequence outlier veto

    sides=low is slime's veto (catastrophic tokens the sampler found far likelier than the trainer).
    """
    rho = ratio(d)
    bad = mask & ((rho < low) | ((rho > high) if sides == "both" else torch.zeros_like(mask)))
    drop = bad.any(-1, keepdim=True)  # (B, 1)
    raw = torch.where(mask, rho, float("inf")).amin(-1, keepdim=True)  # the row's smallest rho
    return applied(
        torch.where(drop, 0.0, torch.ones_like(d)), torch.where(mask.any(-1, keepdim=True), raw, 1.0), masked=drop
    )


def _kl_rs_check(p) -> str | None:
    if p["estimator"] == "k1" and p["level"] == "seq_max":
        return "level seq_max needs estimator k2 or k3 (verl has no seq_max_k1)"
    if not 0 < p["low"] <= 1 <= p["high"]:
        return f"needs 0 < low <= 1 <= high, got {p['low']:g}, {p['high']:g}"
    return None


@correction(
    "kl_rs",
    source=f"{VERL} compute_rollout_rejection_mask (rollout_rs: token_k1..seq_max_k3; presets: "
    "seq_mean_k3 0.01 'K3-RS', seq_mean_k1 '0.999_1.001' 'Geo-RS', seq_sum_k1 '0.5_2.0')",
    level=lambda p: "token" if p["level"] == "token" else "sequence",
    denominator="drop",
    checks={"max_kl": positive},
    check=_kl_rs_check,
)
def kl_rs(
    d,
    mask,
    *,
    estimator: Literal["k1", "k2", "k3"] = "k3",
    level: Literal["token", "seq_sum", "seq_mean", "seq_max"] = "seq_mean",
    low: float = 0.999,
    high: float = 1.001,
    max_kl: float = 0.01,
):
    """1 if the KL estimate of pi_sampler vs pi_old is within its bound (k1 = -d in [log low, log high]; k2 = d^2/2 or k3 = rho - 1 - d at most max_kl), per token or its sequence sum / mean / max, else 0: verl's rejection sampling

    d is clamped to +-20. k1's bounds are on pi_sampler / pi_old (= 1/rho), as verl's. Rejected
    tokens leave every denominator (verl rewrites the response mask); kept tokens weigh 1.
    seq_mean divides by n + 1e-8 (verl's masked_mean); seq_max of a row without tokens is 0.
    """
    lr = d.clamp(-SAFETY, SAFETY)
    k = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.exp(lr) - 1.0 - lr}[estimator]
    if level == "token":
        stat = k
    elif level == "seq_sum":
        stat = seq_sum(k, mask)
    elif level == "seq_mean":
        stat = seq_sum(k, mask) / (mask.sum(-1, keepdim=True) + 1e-8)
    else:
        top = torch.where(mask, k, float("-inf")).amax(-1, keepdim=True)
        stat = torch.where(torch.isinf(top), 0.0, top)
    keep = (stat >= math.log(low)) & (stat <= math.log(high)) if estimator == "k1" else stat <= max_kl
    return applied(torch.where(keep, 1.0, 0.0).expand_as(d), stat, rejected=~keep & mask)


def _vaco_check(p) -> str | None:
    if p["cap"] <= 1 or not 0 <= p["floor"] < 1:
        return f"needs 0 <= floor < 1 < cap (a truncation around rho = 1), got {p['floor']:g}, {p['cap']:g}"
    if p["high"] and p["high"] <= p["low"]:
        return f"needs low < high (the TV band), got {p['low']:g}, {p['high']:g}"
    return None


@correction(
    "vaco",
    source=f"VACO (arXiv 2603.01365); {OPEN_INSTRUCT}: defaults rho_clamp_upper_bound 2.0, "
    "rho_mask_lower/upper_bound 0 (off; 0 for high here would make vaco tis), high 2.0 as its "
    "test_rho_mask_tv_divergence",
    level="sequence",
    checks={"low": nonneg, "high": nonneg, "floor": nonneg},
    check=_vaco_check,
)
def vaco(d, mask, A, *, cap: float = 2.0, floor: float = 0.0, low: float = 0.0, high: float = 2.0):
    """w = clamp(rho, floor, cap), but 0 on a token with sign(d)*A > 0 in a sequence whose TV = mean_t |rho - 1| lies outside [low, high]: VACO's TV-divergence mask

    rho = exp(d) with d clamped to +-10 (open-instruct); the mask spares the tokens whose update
    lowers the sequence's TV (sign(d)*A <= 0: the step moves pi_old toward the sampler). low = 0 or
    high = 0 leaves that side open (open-instruct's "0 disables"). Masked tokens stay in the
    denominators (open-instruct multiplies the per-token loss by the weights). It reads the
    advantages (apply_correction(..., advantages=)).
    """
    lr = d.clamp(-10.0, 10.0)
    rho = torch.exp(lr)
    tv = seq_mean((rho - 1.0).abs(), mask)  # (B, 1)
    outside = ((tv < low) if low > 0 else torch.zeros_like(tv, dtype=torch.bool)) | (
        (tv > high) if high > 0 else torch.zeros_like(tv, dtype=torch.bool)
    )
    drop = outside & (torch.sign(lr) * A > 0) & mask  # (B, T)
    w = torch.clamp(rho, min=floor if floor > 0 else None, max=cap)
    return applied(torch.where(drop, 0.0, w), tv, truncated=(rho > cap) | (rho < floor), masked=drop)
