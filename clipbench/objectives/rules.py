"""The built-in clip rules. Each is a short function that reads as its formula (docs/objectives.md).

A rule receives the inputs it names (``r`` the token ratio, ``A`` the advantages, ``s`` GSPO's
sequence ratio, ``logp``, ``mask``, ``u`` uniforms, ...; see ``registry.INPUTS``) and its parameters
as keyword arguments, and returns the per-token loss l (B, T) (or a per-sequence loss (B, 1),
broadcast to the sequence's tokens). The loss is minimised. Nothing else: padding, the KL term,
aggregation and every diagnostic (quadrant cells, zero-gradient, rescued, near-band tokens) are
derived by ``policy_loss`` from what the rule returns, the same way for every rule, built-in or plugin.

Conventions: ``sg(x)`` is ``x.detach()``; bands are closed (a ratio exactly on a bound is inside, as
in torch.clamp's gradient); ``d`` is how far a ratio lies past the PPO clip's active bound
(:func:`past_bound`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from clipbench.objectives.registry import (greater_than_one, interval, nonneg, positive, rule,
                                           unit_interval)

EPS_CHECKS = {"eps_low": nonneg, "eps_high": nonneg}


# --------------------------------------------------------------------------------------------
# Shared pieces (each a formula of its own)
# --------------------------------------------------------------------------------------------
def ppo_clip(x: torch.Tensor, A: torch.Tensor, lo, hi) -> torch.Tensor:
    """-min(x*A, clip(x, lo, hi)*A): the PPO clipped surrogate on a ratio x (token r or sequence s)."""
    return -torch.minimum(x * A, torch.clamp(x, lo, hi) * A)


def past_bound(x: torch.Tensor, A: torch.Tensor, lo, hi) -> torch.Tensor:
    """d: how far x lies past the PPO clip's active bound, in ratio units: x - hi for A>0, lo - x for
    A<0, 0 for A == 0 (no bound is active). PPO's clip zeroes the gradient exactly where d > 0.
    (Finite everywhere, so that a formula of d stays finite in torch.where's unselected branch.)"""
    return torch.where(A > 0, x - hi, torch.where(A < 0, lo - x, 0.0))


def on_side(A: torch.Tensor, sides: str) -> torch.Tensor:
    """(B, 1) bool: rows whose active bound takes part (upper: A>0, lower: A<0, both)."""
    return {"both": A != 0, "upper": A > 0, "lower": A < 0}[sides]


def _clip_bounds(p) -> dict:
    return {"clip_low": 1.0 - p["eps_low"], "clip_high": 1.0 + p["eps_high"]}


_GRPO_SRC = "GRPO, DeepSeekMath (arXiv 2402.03300); PPO (arXiv 1707.06347)"


# --------------------------------------------------------------------------------------------
# Token-level hard clips
# --------------------------------------------------------------------------------------------
@rule("grpo", source=_GRPO_SRC, checks=EPS_CHECKS, bounds=_clip_bounds)
def grpo(r, A, *, eps_low: float = 0.2, eps_high: float = 0.2):
    """-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A): PPO/GRPO clipped surrogate

    Zero gradient on (A>0, r > 1+eps_high) and (A<0, r < 1-eps_low); unbounded in Q4 as r grows.
    """
    return ppo_clip(r, A, 1 - eps_low, 1 + eps_high)


@rule("dapo", source="DAPO (arXiv 2503.14476)", checks=EPS_CHECKS, bounds=_clip_bounds)
def dapo(r, A, *, eps_low: float = 0.2, eps_high: float = 0.28):
    """-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A): GRPO clip with decoupled (clip-higher) bounds"""
    return ppo_clip(r, A, 1 - eps_low, 1 + eps_high)


def _dual_clip_warning(p) -> str | None:
    if p["c"] <= 1 + p["eps_high"]:
        return (f"c={p['c']:g} <= 1 + eps_high = {1 + p['eps_high']:g}: the cap binds inside the trust band; "
                "this is not TRL's `delta` (which needs delta > 1 + eps_high)")
    return None


@rule("dual_clip", source="Dual-clip PPO (arXiv 1912.09729); INTELLECT-2 delta (arXiv 2505.07291); "
      "verl core_algos.py `vanilla` (clip_ratio_c=3)", checks={**EPS_CHECKS, "c": greater_than_one},
      bounds=lambda p: {**_clip_bounds(p), "dual_clip_c": p["c"]}, warn=_dual_clip_warning)
def dual_clip(r, A, *, eps_low: float = 0.2, eps_high: float = 0.2, c: float = 3.0):
    """grpo, and min(grpo, -c*A) for A<0: GRPO clip plus a cap c on the loss of A<0 tokens

    The gradient is also zero for (A<0, r > c). Equals TRL's `delta=c` when c > 1 + eps_high, and
    verl's `vanilla` loss (PPO clip + dual clip with clip_ratio_c = 3.0) with the defaults.
    """
    loss = ppo_clip(r, A, 1 - eps_low, 1 + eps_high)
    return torch.where(A < 0, torch.minimum(loss, -c * A), loss)


@rule("abc", source="ABC-GRPO (arXiv 2601.03895), eq. 5-8, Algorithm 1",
      checks={f"eps{i}": nonneg for i in (1, 2, 3, 4)},
      band=lambda p: (1 - p["eps2"], 1 + p["eps1"], 1 - p["eps4"], 1 + p["eps3"]),
      bounds=lambda p: {"clip_pos": interval(1 - p["eps2"], 1 + p["eps1"]),
                        "clip_neg": interval(1 - p["eps4"], 1 + p["eps3"])})
def abc(r, A, *, eps1: float = 0.2, eps2: float = 0.2, eps3: float = 0.2, eps4: float = 0.2):
    """-clip(r, lo, hi)*A, (lo, hi) = (1-eps2, 1+eps1) if A>0 else (1-eps4, 1+eps3): asymmetric bounded clip, no min

    Zero gradient outside the band in all four quadrants: grpo in Q1/Q3, Q4 becomes bounded.
    """
    lo = torch.where(A < 0, 1 - eps4, 1 - eps2)  # (B, 1); A == 0 rows take the A>0 band (l = 0 anyway)
    hi = torch.where(A < 0, 1 + eps3, 1 + eps1)
    return -torch.clamp(r, lo, hi) * A


# --------------------------------------------------------------------------------------------
# Sequence-level (GSPO)
# --------------------------------------------------------------------------------------------
_GSPO_SRC = "GSPO (arXiv 2507.18071)"


@rule("gspo", source=_GSPO_SRC, level="sequence", checks=EPS_CHECKS, bounds=_clip_bounds)
def gspo(s, A, *, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """-min(s*A, clip(s, 1-eps_low, 1+eps_high)*A), s = exp(mean_t(logp - old_logp)): sequence ratio, hard clip

    Returns (B, 1): the whole sequence is zeroed when clipped.
    """
    return ppo_clip(s, A, 1 - eps_low, 1 + eps_high)


@rule("gspo_token", source=_GSPO_SRC + ", GSPO-token", level="sequence", checks=EPS_CHECKS, bounds=_clip_bounds)
def gspo_token(s, logp, A, *, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """grpo's rule on s_tok = sg(s)*exp(logp - sg(logp)): GSPO-token, per-token s_tok with gspo's value and gradient

    s_tok has the value s and d s_tok / d logp_t = s, so each token carries the sequence's clip decision.
    """
    s_tok = s.detach() * torch.exp(logp - logp.detach())  # (B, T)
    return ppo_clip(s_tok, A, 1 - eps_low, 1 + eps_high)


# --------------------------------------------------------------------------------------------
# NSR and its deterministic twin
# --------------------------------------------------------------------------------------------
_NSR_CHECKS = {**EPS_CHECKS, "delta": positive, "p": unit_interval}
_NSR_SRC = "NSR (arXiv 2605.22703); band/probability/sides are clipbench's parametrisation"


def _nsr_level(p) -> str:
    return p["base"]


def _nsr_draws(p) -> bool:
    """Draws are needed when some p(d) lies strictly inside (0, 1)."""
    return p["p"] > 0.0 and (p["p"] < 1.0 or p["schedule"] == "linear")


def _nsr_bounds(p) -> dict:
    lo, hi, d = 1.0 - p["eps_low"], 1.0 + p["eps_high"], p["delta"]
    upper = interval(hi, hi + d, "(]") if p["sides"] in ("both", "upper") else "none"
    lower = interval(lo - d, lo, "[)") if p["sides"] in ("both", "lower") else "none"
    return {**_clip_bounds(p), "nsr_band_upper": upper, "nsr_band_lower": lower,
            "nsr_p": p["p"], "nsr_schedule": p["schedule"], "nsr_sides": p["sides"], "nsr_base": p["base"],
            "nsr_draw": "u < p(d), u ~ U[0,1) per (row, position)" + (", u[:, 0] per sequence"
                                                                     if p["base"] == "sequence" else "")}


Schedule = Literal["const", "linear"]
Sides = Literal["both", "upper", "lower"]
Base = Literal["token", "sequence"]


def _near_band(x, A, eps_low, eps_high, delta, p, schedule, sides):
    """(near, p(d)): tokens 0 < d <= delta past an active bound, and their rescue probability."""
    d = past_bound(x.detach(), A, 1 - eps_low, 1 + eps_high)
    near = (d > 0) & (d <= delta) & on_side(A, sides)
    p_d = p if schedule == "const" else p * (1 - d / delta)
    return near, p_d


@rule("nsr", source=_NSR_SRC, level=_nsr_level, checks=_NSR_CHECKS, draws=_nsr_draws, bounds=_nsr_bounds,
      description="Near-boundary stochastic rescue: clipped tokens just past a bound keep their unclipped "
                  "loss with probability p(d)")
def nsr(r, s, A, u, *, eps_low: float = 0.2, eps_high: float = 0.28, delta: float = 0.1, p: float = 0.5,
        schedule: Schedule = "const", sides: Sides = "both", base: Base = "token"):
    """grpo on x (r, or s for base='sequence'); where 0 < d <= delta and u < p(d), the unclipped -x*A

    p(d) = p (const) or p*(1 - d/delta) (linear); sides: upper (A>0), lower (A<0) or both bounds
    rescue; base='sequence' uses one draw per sequence, u[:, 0].
    """
    x, u = (s, u[:, :1]) if base == "sequence" else (r, u)
    near, p_d = _near_band(x, A, eps_low, eps_high, delta, p, schedule, sides)
    rescued = near & (u < p_d)
    return torch.where(rescued, -x * A, ppo_clip(x, A, 1 - eps_low, 1 + eps_high))


@rule("decay", source="clipbench (expected-gradient twin of NSR, arXiv 2605.22703)", level=_nsr_level,
      checks=_NSR_CHECKS, bounds=_nsr_bounds,
      description="Deterministic twin of nsr: in the band the gradient is scaled by p(d)")
def decay(r, s, A, *, eps_low: float = 0.2, eps_high: float = 0.28, delta: float = 0.1, p: float = 0.5,
          schedule: Schedule = "const", sides: Sides = "both", base: Base = "token"):
    """grpo on x (r, or s for base='sequence'); where 0 < d <= delta, -sg(p(d))*x*A

    nsr's expected gradient with no noise; zero gradient beyond the band.
    """
    x = s if base == "sequence" else r
    near, p_d = _near_band(x, A, eps_low, eps_high, delta, p, schedule, sides)
    return torch.where(near, -p_d * x * A, ppo_clip(x, A, 1 - eps_low, 1 + eps_high))


# --------------------------------------------------------------------------------------------
# Soft / gradient-preserving rules
# --------------------------------------------------------------------------------------------
@rule("cispo", source="CISPO, MiniMax-M1 (arXiv 2506.13585); verl core_algos.py `cispo` (two-sided)",
      checks=EPS_CHECKS,
      bounds=lambda p: {"weight_cap": interval(max(0.0, 1 - p["eps_low"]), 1 + p["eps_high"]),
                        "weight_low": 1 - p["eps_low"], "weight_high": 1 + p["eps_high"]})
def cispo(r, A, logp, *, eps_low: float = 1.0, eps_high: float = 4.0):
    """-sg(clip(r, 1-eps_low, 1+eps_high))*A*logp: clipped importance-sampling weight on a REINFORCE term; never zero

    The weight is clipped two-sided around 1 (verl's parametrisation); the defaults (no lower cap,
    cap at 5) are TRL's `cispo`, see cispo_cap for its absolute-cap parametrisation.
    """
    return -torch.clamp(r, 1 - eps_low, 1 + eps_high).detach() * A * logp


@rule("sapo", source="SAPO (arXiv 2511.20347)", checks={"tau_pos": positive, "tau_neg": positive},
      bounds=lambda p: {"gate": "sigmoid", "tau_pos": p["tau_pos"], "tau_neg": p["tau_neg"]})
def sapo(r, A, *, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """-(4/tau)*sigmoid(tau*(r-1))*A, tau = tau_pos if A>0 else tau_neg: soft adaptive gate, slope 1 at r=1"""
    tau = torch.where(A > 0, tau_pos, tau_neg)  # (B, 1)
    return -(4 / tau) * torch.sigmoid(tau * (r - 1)) * A


@rule("gppo", source="GPPO, Klear-Reasoner (arXiv 2508.07629)",
      checks={**EPS_CHECKS, "beta_low": nonneg, "beta_high": nonneg},
      bounds=lambda p: {**_clip_bounds(p), "grad_past_high": p["beta_high"] * (1 + p["eps_high"]),
                        "grad_past_low": p["beta_low"] * (1 - p["eps_low"])})
def gppo(r, A, *, eps_low: float = 0.2, eps_high: float = 0.28, beta_low: float = 1.0, beta_high: float = 1.0):
    """grpo, but -beta*b*r/sg(r)*A where grpo clips: gradient-preserving clip, constant-magnitude gradient past the bound

    b is the bound hit: 1+eps_high with beta_high (A>0), 1-eps_low with beta_low (A<0).
    """
    lo, hi = 1 - eps_low, 1 + eps_high
    clipped = past_bound(r.detach(), A, lo, hi) > 0
    beta_b = torch.where(A > 0, beta_high * hi, beta_low * lo)  # (B, 1)
    return torch.where(clipped, -beta_b * r / r.detach() * A, -r * A)


# --------------------------------------------------------------------------------------------
# More rules users find elsewhere: verl (verl/trainer/ppo/core_algos.py), TRL
# (trl/trainer/grpo_trainer.py) and papers. verl's `vanilla` loss is `dual_clip` with its defaults
# (tests/test_objectives_external.py shows it); TRL's `delta` is `dual_clip` with c = delta.
# --------------------------------------------------------------------------------------------
_VERL = "verl verl/trainer/ppo/core_algos.py"
_TRL = "TRL trl/trainer/grpo_trainer.py _compute_loss"


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x (broadcast to the mask's (B, T)) over the valid tokens of this call, 0-d."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def first_k(key: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the k eligible positions of smallest key (ties: the earlier position); k is a
    0-d tensor (no host sync)."""
    flat = torch.where(eligible, key, float("inf")).flatten()
    rank = torch.empty_like(flat, dtype=torch.long)
    rank[flat.argsort(stable=True)] = torch.arange(flat.numel(), device=flat.device)
    return eligible & (rank.view_as(key) < k)


def _share_of_tokens(ratio: float, mask: torch.Tensor) -> torch.Tensor:
    """max(int(ratio * valid tokens), 1) as a 0-d tensor (float64: the same rounding as Python)."""
    return torch.floor(ratio * mask.sum().to(torch.float64)).clamp(min=1)


@rule("gpg", source=f"GPG (arXiv 2504.02546); {_VERL} `gpg`")
def gpg(logp, A):
    """-logp*A: GPG, plain policy gradient with no ratio and no clip"""
    return -logp * A


@rule("dro", source=f"{_VERL} `dro` (verl#7245, docs/algo/dro.md)", checks={"dro_beta": positive})
def dro(logp, log_ratio, A, *, dro_beta: float = 0.05):
    """-(logp*A - dro_beta/2*(logp - old_logp)^2): DRO, policy gradient with a quadratic log-ratio penalty in place of a clip

    verl requires dro_beta to be set (no default); 0.05 is the value of verl's own test. DRO expects
    advantages built for its soft off-policy formulation.
    """
    return -(logp * A - 0.5 * dro_beta * log_ratio.square())


@rule("clip_cov", source=f"Clip-Cov (arXiv 2505.22617); {_VERL} `clip_cov`", per_call=True,
      checks={**EPS_CHECKS, "clip_cov_ratio": unit_interval},
      bounds=lambda p: {**_clip_bounds(p), "per_call": "covariance, token count and random choice per call"})
def clip_cov(r, A, logp, mask, u, *, eps_low: float = 0.2, eps_high: float = 0.2, clip_cov_ratio: float = 2e-4,
             clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0):
    """grpo, with a random clip_cov_ratio share of the tokens whose (A - mean A)(logp - mean logp) lies in (lb, ub) detached: Clip-Cov

    The candidates are valid tokens that grpo did not clip; max(int(clip_cov_ratio * tokens), 1) of
    them (fewer if there are fewer) get zero loss and gradient, picked by the smallest u (verl:
    torch.randperm). Per call, as in verl: the means, the token count and the choice range over
    this call's tokens (verl's micro-batch).
    """
    loss = ppo_clip(r, A, 1 - eps_low, 1 + eps_high)
    cov = (A - masked_mean(A, mask)) * (logp - masked_mean(logp, mask)).detach()  # (B, T)
    clipped = past_bound(r.detach(), A, 1 - eps_low, 1 + eps_high) > 0
    candidate = (mask > 0) & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    chosen = first_k(u, candidate, _share_of_tokens(clip_cov_ratio, mask))
    return torch.where(chosen, torch.zeros_like(loss), loss)


@rule("kl_cov", source=f"KL-Cov (arXiv 2505.22617); {_VERL} `kl_cov`", per_call=True,
      checks={"kl_cov_ratio": unit_interval, "ppo_kl_coef": nonneg},
      bounds=lambda p: {"per_call": "covariance and token count per call"})
def kl_cov(r, A, logp, log_ratio, mask, *, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1):
    """-r*A, plus ppo_kl_coef*|logp - old_logp| on the kl_cov_ratio share of tokens of largest (A - mean A)(logp - mean logp): KL-Cov

    max(int(kl_cov_ratio * tokens), 1) tokens get the penalty (ties: the earlier position); no clip.
    Per call, as in verl: the means, the token count and the top-k range over this call's tokens.
    The default coefficient is verl's config default (its code falls back to 1.0 when unset).
    """
    cov = (A - masked_mean(A, mask)) * (logp - masked_mean(logp, mask)).detach()  # (B, T)
    top = first_k(-cov, mask > 0, _share_of_tokens(kl_cov_ratio, mask))
    return -r * A + torch.where(top, ppo_kl_coef * log_ratio.abs(), 0.0)


@rule("geo_mean", source=f"GMPO (arXiv 2507.20673); {_VERL} `geo_mean`", checks=EPS_CHECKS,
      band=lambda p: (math.exp(-p["eps_low"]), math.exp(p["eps_high"])) * 2,
      bounds=lambda p: {"log_ratio_clip": interval(-p["eps_low"], p["eps_high"])})
def geo_mean(log_ratio, A, mask, *, eps_low: float = 0.4, eps_high: float = 0.4):
    """-A*exp(mean_t sgn(A)*min(sgn(A)*lr, sgn(A)*clip(lr, -eps_low, eps_high))): GMPO, geometric mean of the token ratios, clipped per token in log space

    Returns (B, 1) (verl averages it over sequences: agg=seq-mean-token-mean); the mean divides by
    (tokens + 1e-8) as verl does. Clipped tokens get zero gradient. eps 0.4 is the paper's
    (e^-0.4, e^0.4) range (verl's config default would be 0.2).
    """
    sgn = torch.sign(A)
    lr = sgn * torch.minimum(sgn * log_ratio, sgn * torch.clamp(log_ratio, -eps_low, eps_high))
    return -A * torch.exp((lr * mask).sum(-1, keepdim=True) / (mask.sum(-1, keepdim=True) + 1e-8))


_DPPO_CHECKS = {"div_low": nonneg, "div_high": nonneg, "is_cap": positive}


@rule("dppo_tv", source=f"DPPO (arXiv 2602.04879); {_VERL} `dppo_tv`", checks=_DPPO_CHECKS,
      bounds=lambda p: {"tv_low": p["div_low"], "tv_high": p["div_high"], "is_cap": p["is_cap"]})
def dppo_tv(r, A, logp, old_logp, *, div_low: float = 0.15, div_high: float = 0.15, is_cap: float = 20.0):
    """-A*sg(min(r, is_cap))*logp while p - q <= div_high (A>0) / p - q >= -div_low (A<=0), else 0: DPPO-Binary-TV

    p = exp(logp), q = exp(old_logp): the trust region is on the probability change (total
    variation of the binary distribution), not on the ratio. Thresholds: verl's example
    (clip_ratio 0.15); is_cap is verl's code default (its actor config's clip_ratio_c = 3.0 applies
    unless overridden; the paper recommends a large cap).
    """
    p, q = logp.detach().exp(), old_logp.exp()
    inside = torch.where(A > 0, p - q <= div_high, p - q >= -div_low)
    return torch.where(inside, -A * torch.clamp(r, max=is_cap).detach() * logp, 0.0)


@rule("dppo_kl", source=f"DPPO (arXiv 2602.04879); {_VERL} `dppo_kl`", checks=_DPPO_CHECKS,
      bounds=lambda p: {"kl_low": p["div_low"], "kl_high": p["div_high"], "is_cap": p["is_cap"]})
def dppo_kl(r, A, logp, old_logp, *, div_low: float = 0.05, div_high: float = 0.05, is_cap: float = 20.0):
    """-A*sg(min(r, is_cap))*logp while the binary KL(q || p) stays within div_high (A>0) / div_low (A<=0) or p moved back, else 0: DPPO-Binary-KL

    KL = q*log(q/p) + (1-q)*log((1-q+1e-8)/(1-p+1e-8)); an A>0 token with p <= q (an A<=0 token with
    p >= q) is always inside. Thresholds: verl's example (clip_ratio 0.05).
    """
    lp = logp.detach()
    p, q = lp.exp(), old_logp.exp()
    kl = q * (old_logp - lp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    inside = torch.where(A > 0, (kl <= div_high) | (p <= q), (kl <= div_low) | (p >= q))
    return torch.where(inside, -A * torch.clamp(r, max=is_cap).detach() * logp, 0.0)


@rule("cispo_cap", source=f"CISPO (arXiv 2506.13585); ScaleRL (arXiv 2510.13786); {_TRL} loss_type='cispo'",
      checks={"cap": positive}, band=lambda p: (0.0, p["cap"], 0.0, p["cap"]),
      bounds=lambda p: {"weight_cap": interval(0.0, p["cap"])})
def cispo_cap(r, A, logp, *, cap: float = 5.0):
    """-sg(min(r, cap))*A*logp: CISPO with TRL's absolute cap on the IS weight (TRL's epsilon_high)

    The same rule as cispo with eps_low=1, eps_high=cap-1; cispo clips two-sided around 1 (verl).
    """
    return -torch.clamp(r, max=cap).detach() * A * logp


@rule("luspo", source=f"LUSPO (arXiv 2602.05261); {_TRL} loss_type='luspo'", level="sequence", checks=EPS_CHECKS,
      bounds=_clip_bounds)
def luspo(s, A, mask, *, eps_low: float = 2e-3, eps_high: float = 2.5e-3):
    """|y|*(-min(s*A, clip(s, 1-eps_low, 1+eps_high)*A)), |y| = the sequence's tokens: LUSPO, GSPO's sequence loss scaled by its length

    Returns (B, 1). TRL averages it over sequences: use agg=seq-mean-token-mean (then luspo equals
    gspo under seq-mean-token-sum). eps: the paper's section 5.1.
    """
    return mask.sum(-1, keepdim=True) * ppo_clip(s, A, 1 - eps_low, 1 + eps_high)


@rule("vespo", source=f"VESPO (arXiv 2602.10693); {_TRL} loss_type='vespo' (get_gamma_weights)", level="sequence",
      checks={"k_pos": nonneg, "k_neg": nonneg, "lambda_pos": nonneg, "lambda_neg": nonneg})
def vespo(log_ratio, A, logp, mask, *, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
          lambda_neg: float = 2.0):
    """-sg(phi(W))*A*logp, phi(W) = W^k * exp(lambda*(1 - W)), W = prod_t r_t: VESPO's gamma weight on the sequence ratio

    (k, lambda) = (k_pos, lambda_pos) for A >= 0 else (k_neg, lambda_neg), lambda >= 1e-4; log W sums
    the per-token log-ratios clamped to +-20, then is clamped to [log 1e-8, 20] (as TRL). TRL folds
    vLLM's importance-sampling correction into W; here it is the trainer's `weights` instead.
    """
    log_w = torch.clamp((torch.clamp(log_ratio, -20, 20) * mask).sum(-1, keepdim=True), math.log(1e-8), 20).detach()
    k = torch.where(A >= 0, k_pos, k_neg)
    lam = torch.where(A >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # (B, 1)
    return -phi * A * logp


@rule("ce_gppo", source="CE-GPPO (arXiv 2509.20712); Kwai-Klear/CE-GPPO README compute_gppo_loss_general_beta",
      checks={**EPS_CHECKS, "beta_low": nonneg, "beta_high": nonneg, "c": greater_than_one},
      bounds=lambda p: {**_clip_bounds(p), "grad_past_high": p["beta_high"] * (1 + p["eps_high"]),
                        "grad_past_low": p["beta_low"] * (1 - p["eps_low"]), "dual_clip_c": p["c"]})
def ce_gppo(r, A, *, eps_low: float = 0.2, eps_high: float = 0.2, beta_low: float = 0.75, beta_high: float = 1.0,
            c: float = 10.0):
    """gppo, and min(gppo, -c*A) for A<0: CE-GPPO, gradient-preserving clip with scales beta_low (beta1) / beta_high (beta2) and PPO's dual clip

    Defaults: the authors' 7B recipe (beta1 = 0.75, 0.5 for 1.5B; eps 0.2/0.2; clip_ratio_c = 10).
    """
    loss = gppo(r, A, eps_low=eps_low, eps_high=eps_high, beta_low=beta_low, beta_high=beta_high)
    return torch.where(A < 0, torch.minimum(loss, -c * A), loss)


@rule("dcpo", source="DCPO (arXiv 2509.02333); lime-RL/DCPO verl/trainer/ppo/core_algos.py get_clip_low_high, "
      "compute_policy_loss_dcpo (clip_type=dynamic)",
      checks={**EPS_CHECKS, "c": greater_than_one},
      bounds=lambda p: {"clip_low_min": 0.5, "clip_high_cap": max(p["c"], 10.0), "dual_clip_c": p["c"]})
def dcpo(r, A, old_logp, *, eps_low: float = 0.2, eps_high: float = 0.28, c: float = 10.0):
    """dual_clip with per-token bounds lo = (1+sqrt(max(1-4*eps_low/q, 0)))/2, hi = min((1+sqrt(1+4*eps_high/q))/2, max(c, 10)), q = exp(old_logp): DCPO's dynamic-adaptive clip

    Rare tokens (small q) get a wider band: the bounds solve |r - 1|*r*q <= eps. (q == 0, an
    underflow, takes the limit q -> 0: lo = 1/2, hi = max(c, 10).)
    """
    q = old_logp.exp()
    lo = (1 + torch.sqrt(torch.clamp(1 - 4 * eps_low / q, min=0))) / 2
    hi = torch.clamp((1 + torch.sqrt(1 + 4 * eps_high / q)) / 2, max=max(c, 10.0))
    loss = ppo_clip(r, A, lo, hi)
    return torch.where(A < 0, torch.minimum(loss, -c * A), loss)
