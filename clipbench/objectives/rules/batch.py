"""Rules whose bounds come from a statistic of the whole mini-batch: BAPO's bound search, M2PO's
second-moment budget. The statistic is the rule's ``batch_stat`` (``rule(batch_stat=...)``):
computed without gradient over every micro-batch and rank of the mini-batch before its first
backward, so the rule is exact under micro-batching (the sources compute it per loss call, i.e.
per micro-batch).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from clipbench.objectives.primitives import ppo_clip
from clipbench.objectives.registry import interval, rule
from clipbench.objectives.signature import greater_than_one, nonneg, positive

BAPO = "WooooDyy/BAPO @ 7287044 recipe/bapo/policy_loss.py (loss file 3b8389c), config/bapo_trainer.yaml"
M2PO = (
    "Infini-AI-Lab/M2PO @ af54a3e (docs/static/m2po-images/alg.jpg: Algorithm 1; verl/trainer/ppo/core_algos.py "
    "kpo_clip_harmful_tokens, compute_m2po_policy_loss); inclusionAI/AReaL @ 4aef98d areal/trainer/ppo/actor.py "
    "_get_m2po_loss_mask"
)


# ---------------------------------------------------------------------------------------------
# BAPO


def _ladder(start: float, stop: float, step: float) -> list[float]:
    """start, start+step, ... capped at stop (Python floats, the released search's own arithmetic)."""
    out = [start]
    while out[-1] < stop and step > 0:
        out.append(min(out[-1] + step, stop))
    return out


def _first(cond: torch.Tensor) -> torch.Tensor:
    """Index of the first True, else the last index (0-d, no host sync)."""
    return torch.where(cond.any(), cond.to(torch.int64).argmax(), cond.numel() - 1)


def _bapo_sums(r, A, mask, lows, highs, p):
    """(pos (len(highs),), neg (len(lows),)) contribution sums of the mini-batch, float64."""
    r, A, m = r.to(torch.float64), A.to(torch.float64), mask.to(torch.float64)
    hi, lo = r.new_tensor(highs)[:, None, None], r.new_tensor(lows)[:, None, None]
    if p["measure"] == "released":  # the clipped value of each token: min(r, hi) A for A >= 0, max(r, lo) A else
        pos = (torch.minimum(r, hi) * A * m * (A >= 0)).sum((1, 2))
        neg = (torch.maximum(r, lo) * -A * m * (A < 0)).sum((1, 2))
    else:  # "gradient": r |A| over the tokens whose gradient the clip keeps
        pos = (r * A * m * ((A > 0) & (r <= hi))).sum((1, 2))
        neg = (r * -A * m * ((A < 0) & (r >= lo) & (r <= p["c"]))).sum((1, 2))
    return pos, neg


def _bapo_stat(r, A, mask, p) -> dict:
    """The released search: raise the lower bound while pos/neg < target (up to lower_max), then the
    upper bound (up to upper_max); pos/neg = inf when neg = 0, pos / (neg + 1e-8) otherwise."""
    lows = _ladder(p["lower_start"], p["lower_max"], p["lower_step"])
    highs = _ladder(p["upper_start"], p["upper_max"], p["upper_step"])
    pos, neg = _bapo_sums(r, A, mask, lows, highs, p)

    def ratio(a, b):
        return torch.where(b <= 0, torch.full_like(a, math.inf), a / (b + 1e-8))

    i = _first(ratio(pos[0], neg) >= p["target"])  # phase 1: the lower bound, upper at its start
    j = _first(ratio(pos, neg[i]) >= p["target"])  # phase 2: the upper bound (j = 0 when phase 1 reached it)
    total = pos[j] + neg[i]
    return {
        "clip_low": r.new_tensor(lows)[i].float(),
        "clip_high": r.new_tensor(highs)[j].float(),
        "pos_share": torch.where(total > 0, pos[j] / total.clamp(min=1e-300), 1.0).float(),
    }


def _bapo_check(p) -> str | None:
    if not 0 < p["lower_start"] <= p["lower_max"] <= 1 <= p["upper_start"] <= p["upper_max"]:
        return "needs 0 < lower_start <= lower_max <= 1 <= upper_start <= upper_max (absolute ratio bounds)"
    for side in ("lower", "upper"):
        span, step = p[f"{side}_max"] - p[f"{side}_start"], p[f"{side}_step"]
        if step > 0 and span / step > 1000:
            return f"{side}_step {step:g} makes more than 1000 candidate bounds"
    return None


@rule(
    "bapo",
    source=f"BAPO (arXiv 2510.18927); {BAPO}",
    batch_stat=_bapo_stat,
    check=_bapo_check,
    checks={"lower_step": nonneg, "upper_step": nonneg, "target": nonneg, "c": greater_than_one},
    band=lambda p: (p["lower_start"], p["upper_start"], p["lower_start"], p["upper_start"]),
    bounds=lambda p: {
        "clip_low_range": interval(p["lower_start"], p["lower_max"]),
        "clip_high_range": interval(p["upper_start"], p["upper_max"]),
        "target": p["target"],
        "measure": p["measure"],
        "dual_clip_c": p["c"],
        "stat_scope": "mini-batch",
    },
)
def bapo(
    r,
    A,
    stat,
    *,
    lower_start: float = 0.6,
    lower_max: float = 0.8,
    lower_step: float = 0.05,
    upper_start: float = 1.2,
    upper_max: float = 2.0,
    upper_step: float = 0.05,
    target: float = 1.0,
    c: float = 3.0,
    measure: Literal["released", "gradient"] = "released",
):
    """dual_clip with absolute bounds [clip_low, clip_high] searched on each mini-batch until the positive-to-negative contribution ratio reaches target: BAPO

    measure=released is the released code's contribution (each token's clipped surrogate value; a
    higher lower bound can only raise the negative side, the opposite of the paper's stated intent);
    measure=gradient counts r |A| over the tokens whose gradient the clip keeps (this project's
    reading of "filter low-probability negative tokens"; the paper's formula could not be checked).
    The search raises the lower bound (lower_start -> lower_max by lower_step) while the ratio is
    below target, then the upper bound (upper_start -> upper_max by upper_step).
    """
    loss = ppo_clip(r, A, stat["clip_low"], stat["clip_high"])
    return torch.where(A < 0, torch.minimum(loss, -c * A), loss)


# ---------------------------------------------------------------------------------------------
# M2PO


def _candidates(r, A, mask, p) -> torch.Tensor:
    valid = mask > 0
    if p["candidates"] == "all":
        return valid
    return valid & (((A > 0) & (r > 1)) | ((A < 0) & (r < 1)))  # the trust-region (harmful) tokens


def _m2(r: torch.Tensor) -> torch.Tensor:
    """M2 = (log r)^2, float32 (the statistic and the rule read the same values)."""
    return torch.log(r.detach().float()).square()


def _m2po_stat(r, A, mask, p) -> dict:
    """mask: the largest M2 candidates go until the rest's mean is <= tau (m2_cut: the largest kept
    M2; -1 when every candidate goes). clip: the official water-filling level t, the band
    [e^-t, e^t] ([0, 1e5], no band, when the candidates' mean M2 is already <= tau + 1e-12)."""
    cand = _candidates(r, A, mask, p)
    m2 = _m2(r)
    n = cand.sum()
    idx = torch.arange(m2.numel(), device=m2.device)
    inside = idx < n  # the sorted candidates come first
    mean = torch.where(cand, m2, 0.0).to(torch.float64).sum() / n.clamp(min=1)
    if p["action"] == "clip":
        asc = torch.where(cand, m2, math.inf).flatten().sort().values  # candidates first, smallest first
        return {**_water_fill(asc, inside, n, mean, p["tau"]), "m2": mean.float()}
    v = torch.where(cand, m2, -1.0).flatten().sort(descending=True).values  # largest first
    suffix = torch.where(inside, v.to(torch.float64), 0.0).flip(0).cumsum(0).flip(0)  # sum of v[k:] (candidates)
    ok = inside & (suffix / (n - idx).clamp(min=1) <= p["tau"])  # the rest's mean after dropping v[:k]
    k = torch.where(ok.any(), ok.to(torch.int64).argmax(), n)  # first k within budget; n: every candidate goes
    cut = torch.where(k < n, v[k.clamp(max=max(v.numel() - 1, 0))], -1.0) if v.numel() else m2.new_zeros(())
    kept = cand & (m2 <= cut)
    after = torch.where(kept, m2, 0.0).to(torch.float64).sum() / kept.sum().clamp(min=1)
    return {"m2_cut": cut.float(), "m2": mean.float(), "m2_after": after.float()}


def _water_fill(asc: torch.Tensor, inside: torch.Tensor, n: torch.Tensor, mean: torch.Tensor, tau: float) -> dict:
    """The official kpo_clip_harmful_tokens: the first k with sum_{i<=k} v_i + (n-k-1)(v_k - 1e-12) >=
    tau*n - 1e-12 (v ascending), t = sqrt(v_{k-1} - 1e-12) (0 for k = 0), band [e^-t, e^t] in float32."""
    v = torch.where(inside, asc, 0.0).to(torch.float64)
    cs = v.cumsum(0)
    idx = torch.arange(v.numel(), device=v.device)
    k = (
        (inside & (cs + (n - 1 - idx) * (v - 1e-12) >= tau * n - 1e-12)).to(torch.int64).argmax()
        if v.numel()
        else idx.new_zeros(())
    )
    t = torch.where(k > 0, (v[(k - 1).clamp(min=0)] - 1e-12).clamp(min=0).sqrt(), 0.0) if v.numel() else v.new_zeros(())
    band = (n > 0) & (mean > tau + 1e-12)
    lo, hi = torch.exp(-t.float()), torch.exp(t.float())
    return {"clip_low": torch.where(band, lo, 0.0), "clip_high": torch.where(band, hi, 1e5)}


@rule(
    "m2po",
    source=f"M2PO (arXiv 2510.01161); {M2PO}",
    batch_stat=_m2po_stat,
    checks={"tau": positive},
    band=lambda p: (0.8, 1.2, 0.8, 1.2),
    bounds=lambda p: {
        "m2_budget": p["tau"],
        "candidates": p["candidates"],
        "action": p["action"],
        "stat_scope": "mini-batch",
    },
)
def m2po(
    r,
    A,
    mask,
    stat,
    *,
    tau: float = 0.04,
    candidates: Literal["trust_region", "all"] = "trust_region",
    action: Literal["mask", "clip"] = "mask",
):
    """-M*r*A, M = 0 on the candidates of largest (log r)^2 until the rest's mean is <= tau: M2PO (action=clip: PPO clip in the water-filling band [e^-t, e^t])

    candidates=trust_region: the two cells PPO's clip acts on, (A>0, r>1) and (A<0, r<1) (the paper's
    Algorithm 1, the official code); all: every token (AReaL's m2_threshold). Masked tokens keep
    their place in the token-mean denominator (the paper divides by sum |o_i|); tokens tied with
    the largest kept M2 stay. action=clip is the official code: no mask; PPO's clip with the band
    whose level t caps the candidates' M2 at a mean of tau (every token, no dual clip; no band when
    their mean is already within it).
    """
    if action == "clip":
        return ppo_clip(r, A, stat["clip_low"], stat["clip_high"])
    masked = _candidates(r.detach(), A, mask, {"candidates": candidates}) & (_m2(r) > stat["m2_cut"])
    return torch.where(masked, 0.0, -r * A)
