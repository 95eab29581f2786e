"""Near-boundary Stochastic Rescue (NSR) and its deterministic twin (decay): tokens just past a
clip bound keep (a share of) their unclipped gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

from clipbench.objectives.primitives import on_side, past_bound, ppo_clip
from clipbench.objectives.registry import interval, rule
from clipbench.objectives.rules.common import EPS_CHECKS, clip_bounds
from clipbench.objectives.signature import positive, unit_interval

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
    return {
        **clip_bounds(p),
        "nsr_band_upper": upper,
        "nsr_band_lower": lower,
        "nsr_p": p["p"],
        "nsr_schedule": p["schedule"],
        "nsr_sides": p["sides"],
        "nsr_base": p["base"],
        "nsr_draw": "u < p(d), u ~ U[0,1) per (row, position)"
        + (", u[:, 0] per sequence" if p["base"] == "sequence" else ""),
    }


Schedule = Literal["const", "linear"]
Sides = Literal["both", "upper", "lower"]
Base = Literal["token", "sequence"]


def _near_band(x, A, eps_low, eps_high, delta, p, schedule, sides):
    """(near, p(d)): tokens 0 < d <= delta past an active bound, and their rescue probability."""
    d = past_bound(x.detach(), A, 1 - eps_low, 1 + eps_high)
    near = (d > 0) & (d <= delta) & on_side(A, sides)
    p_d = p if schedule == "const" else p * (1 - d / delta)
    return near, p_d


@rule(
    "nsr",
    source=_NSR_SRC,
    level=_nsr_level,
    checks=_NSR_CHECKS,
    draws=_nsr_draws,
    bounds=_nsr_bounds,
    description="Near-boundary stochastic rescue: clipped tokens just past a bound keep their unclipped "
    "loss with probability p(d)",
)
def nsr(
    r,
    s,
    A,
    u,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    delta: float = 0.1,
    p: float = 0.5,
    schedule: Schedule = "const",
    sides: Sides = "both",
    base: Base = "token",
):
    """grpo on x (r, or s for base='sequence'); where 0 < d <= delta and u < p(d), the unclipped -x*A

    The base is the hard clip (grpo's rule with eps_low / eps_high). For a token the base rule
    zeroes, d is its distance past the bound in ratio units (r - (1+eps_high) or (1-eps_low) - r);
    if 0 < d <= delta it is rescued (m = 1{u < p(d)}, u uniform on [0, 1)) and takes the unclipped
    loss -x*A; deeper violations stay clipped. p(d) = p (const) or p*(1 - d/delta) (linear); sides:
    upper (A>0), lower (A<0) or both bounds rescue; base='sequence' applies it to gspo's s with one
    draw per sequence, the row's first uniform u[:, 0]. The expected gradient is p(d) x the
    unclipped gradient inside the band, zero beyond. The uniforms are drawn per (rollout row,
    position) from an explicit generator seeded from the run seed and step (or passed in), so a run
    replays and the draws do not depend on how the mini-batch is split.
    """
    x, u = (s, u[:, :1]) if base == "sequence" else (r, u)
    near, p_d = _near_band(x, A, eps_low, eps_high, delta, p, schedule, sides)
    rescued = near & (u < p_d)
    return torch.where(rescued, -x * A, ppo_clip(x, A, 1 - eps_low, 1 + eps_high))


@rule(
    "decay",
    source="clipbench (expected-gradient twin of NSR, arXiv 2605.22703)",
    level=_nsr_level,
    checks=_NSR_CHECKS,
    bounds=_nsr_bounds,
    description="Deterministic twin of nsr: in the band the gradient is scaled by p(d)",
)
def decay(
    r,
    s,
    A,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    delta: float = 0.1,
    p: float = 0.5,
    schedule: Schedule = "const",
    sides: Sides = "both",
    base: Base = "token",
):
    """grpo on x (r, or s for base='sequence'); where 0 < d <= delta, -sg(p(d))*x*A

    The same band as nsr: nsr's expected gradient with no noise (tested by Monte Carlo); zero
    gradient beyond the band.
    """
    x = s if base == "sequence" else r
    near, p_d = _near_band(x, A, eps_low, eps_high, delta, p, schedule, sides)
    return torch.where(near, -p_d * x * A, ppo_clip(x, A, 1 - eps_low, 1 + eps_high))
