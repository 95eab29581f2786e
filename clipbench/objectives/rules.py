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
