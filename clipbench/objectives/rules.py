"""The clip rules of ../shared/docs/objectives.md, one small pure function each.

Every method's per-token loss has the form ``l = -A * surrogate``; a rule returns the surrogate
(see :class:`RuleOut`) and the float 0/1 ``keep`` mask of the tokens whose gradient flows.
Hard-clipped tokens get the *detached* clipped value through :func:`select` (an exact select
whose gradient is ``keep``; or :func:`straight` when the value is already at hand), so their
gradient is exactly zero and ``zero_grad = 1 - keep`` is the same mask that builds the loss (not
read from autograd). Bands are closed: a ratio exactly on a bound is in band (as in torch.clamp's
gradient).

Speed (B=64, T=2048 on CPU is a few dozen passes over (B, T) tensors, each pass and each op call
counting): masks are float 0/1 written into existing buffers where they can be, temporaries that
are used once live in the context's scratch buffer, and counts the diagnostics need are derived
from masks a rule builds anyway (RuleOut.zero_rows / beyond_rows / rescue).
"""

from __future__ import annotations

import math

import torch

from clipbench.objectives.context import RatioContext, RuleOut, feq, fle, flt, select, straight
from clipbench.objectives.registry import (ABC_EPS, EPS_HIGH, EPS_LOW, NSR_PARAMS, Param, _gt_one,
                                           _nonneg, _positive, interval, register)

_GRPO_SRC = "GRPO, DeepSeekMath (arXiv 2402.03300)"
_HARD_CLIP = "-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)"


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------
def _ppo_clip(ctx: RatioContext, level: str, eps_low: float, eps_high: float) -> RuleOut:
    """-min(x*A, clip(x)*A) on the token (r) or sequence (s) ratio: the gradient is zero exactly
    on (A>0, x>hi) and (A<0, x<lo), where the value is that bound."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    x, xd = ctx.ratio(level)
    keep = ctx.unclipped(xd, lo, hi)  # (B, T) or (B, 1)
    return RuleOut(select(x, ctx.bound(lo, hi), keep), xd, keep, "aligned")


def _band_clip(ctx: RatioContext, lo: torch.Tensor, hi: torch.Tensor, zero_cells: str) -> RuleOut:
    """Hard band [lo, hi] per row ((B, 1) bounds) on r: zero gradient outside, in any quadrant."""
    rd = ctx.r_d
    clipped = torch.maximum(rd, lo)
    clipped = torch.minimum(clipped, hi, out=clipped)
    keep = feq(clipped, rd)  # in band <=> clamping leaves r unchanged
    # select(r, clipped, keep) would be r where keep == 1 (there r == clipped) and clipped where
    # keep == 0: clipped itself, so the surrogate is clipped with gradient keep (no select pass).
    return RuleOut(straight(ctx.r, clipped, keep), rd, keep, zero_cells)


def _per_row(ctx: RatioContext, pos_value: float, neg_value: float, zero_value: float) -> torch.Tensor:
    """(B, 1): pos_value where A>0, neg_value where A<0, zero_value where A == 0 (values may be inf)."""
    return torch.where(ctx.pos_b, pos_value, torch.where(ctx.neg_b, neg_value, zero_value))


def _clip_bounds(p) -> dict:
    return {"clip_low": 1.0 - p["eps_low"], "clip_high": 1.0 + p["eps_high"]}


# --------------------------------------------------------------------------------------------
# Token-level hard clips
# --------------------------------------------------------------------------------------------
@register("dapo", params=(EPS_LOW(0.2), EPS_HIGH(0.28)),
          description="GRPO clip with decoupled (clip-higher) bounds",
          rule=_HARD_CLIP + "  (eps_high > eps_low)",
          source="DAPO (arXiv 2503.14476)", bounds=_clip_bounds)
@register("grpo", params=(EPS_LOW(0.2), EPS_HIGH(0.2)),
          description="PPO/GRPO clipped surrogate",
          rule=_HARD_CLIP, source=_GRPO_SRC, bounds=_clip_bounds)
def grpo(ctx: RatioContext, *, eps_low: float, eps_high: float) -> RuleOut:
    return _ppo_clip(ctx, "token", eps_low, eps_high)


@register("dual_clip", params=(EPS_LOW(0.2), EPS_HIGH(0.2),
                                Param("c", 3.0, "dual-clip cap on r for A<0", _gt_one)),
          description="GRPO clip plus a cap c on the loss of A<0 tokens (TRL's `delta`)",
          rule=_HARD_CLIP + "; A<0: min(max(-r*A, -clip(r)*A), -c*A)",
          source="Dual-clip PPO (arXiv 1912.09729); INTELLECT-2 delta (arXiv 2505.07291)",
          bounds=lambda p: {**_clip_bounds(p), "dual_clip_c": p["c"]})
def dual_clip(ctx: RatioContext, *, eps_low: float, eps_high: float, c: float) -> RuleOut:
    # The gradient flows on r <= 1+eps_high for A>0 and on 1-eps_low <= r <= c for A<0, where
    # min(max(-r*A, -clip(r)*A), -c*A) = |A| * min(max(r, clip(r)), c) is |A| * r; outside, the
    # value is the nearest bound of that band (c > 1, so past c the value is c whatever clip(r)).
    lo = _per_row(ctx, 0.0, 1.0 - eps_low, 0.0)  # r > 0: 0 is no lower bound
    hi = _per_row(ctx, 1.0 + eps_high, c, float("inf"))
    return _band_clip(ctx, lo, hi, "dual")


@register("abc", params=(ABC_EPS(1), ABC_EPS(2), ABC_EPS(3), ABC_EPS(4)),
          description="Asymmetric bounded clip: hard band in all four quadrants, no min",
          rule="-clip(r, lo, hi)*A; (lo, hi) = (1-eps2, 1+eps1) if A>0 else (1-eps4, 1+eps3)",
          source="ABC-GRPO (arXiv 2601.03895), eq. 5-8, Algorithm 1",
          band=lambda p: (1 - p["eps2"], 1 + p["eps1"], 1 - p["eps4"], 1 + p["eps3"]),
          bounds=lambda p: {"clip_pos": interval(1 - p["eps2"], 1 + p["eps1"]),
                            "clip_neg": interval(1 - p["eps4"], 1 + p["eps3"])})
def abc(ctx: RatioContext, *, eps1: float, eps2: float, eps3: float, eps4: float) -> RuleOut:
    # (B, 1) per-row band (A == 0 rows take the A>0 band; their gradient is 0 whatever it is).
    # The clip band is the reference band, so the zeroed tokens are exactly the out-of-band ones.
    lo = torch.where(ctx.neg_b, 1.0 - eps4, 1.0 - eps2)
    hi = torch.where(ctx.neg_b, 1.0 + eps3, 1.0 + eps1)
    return _band_clip(ctx, lo, hi, "band")


# --------------------------------------------------------------------------------------------
# Sequence-level (GSPO)
# --------------------------------------------------------------------------------------------
_GSPO_SRC = "GSPO (arXiv 2507.18071)"


@register("gspo", params=(EPS_LOW(3e-4), EPS_HIGH(4e-4)), level="sequence",
          description="Sequence-level ratio (length-normalised) with a hard clip per sequence",
          rule="s = exp(mean_t(logp - old_logp)); -min(s*A, clip(s, 1-eps_low, 1+eps_high)*A)",
          source=_GSPO_SRC, bounds=_clip_bounds)
def gspo(ctx: RatioContext, *, eps_low: float, eps_high: float) -> RuleOut:
    return _ppo_clip(ctx, "sequence", eps_low, eps_high)  # (B, 1): the whole sequence


@register("gspo_token", params=(EPS_LOW(3e-4), EPS_HIGH(4e-4)), level="sequence",
          description="GSPO-token: per-token s_tok with gspo's value and gradient",
          rule="s_tok = sg(s)*exp(logp - sg(logp)); grpo rule on s_tok with the sequence's clip decision",
          source=_GSPO_SRC + ", GSPO-token", bounds=_clip_bounds)
def gspo_token(ctx: RatioContext, *, eps_low: float, eps_high: float) -> RuleOut:
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    sd = ctx.s_d
    keep = ctx.unclipped(sd, lo, hi)  # (B, 1): the sequence's clip decision
    # s_tok = sg(s) * exp(lr - sg(lr)) has the value sg(s) and d/dlr = sg(s): with the clip, the
    # value is lerp(bound, sg(s), keep) and the gradient keep * sg(s) per row, (B, 1) both;
    # straight() broadcasts them to the tokens with no (B, T) forward pass.
    value = torch.lerp(ctx.bound(lo, hi), sd, keep)
    return RuleOut(straight(ctx.lr, value, keep * sd), sd, keep, "aligned")


# --------------------------------------------------------------------------------------------
# NSR and its deterministic twin
# --------------------------------------------------------------------------------------------
def _reach(ctx: RatioContext, sides: str, delta: float):
    """How far past the bound (ratio units) a token may be and still be in the band: delta on
    the active side(s), 0 elsewhere ((B, 1) for one side, the float delta for both)."""
    if sides == "both":
        return delta
    return (ctx.pos if sides == "upper" else ctx.neg) * delta


def _needs_draws(p: float, schedule: str) -> bool:
    """True when some p(d) lies strictly inside (0, 1): a Bernoulli draw is needed."""
    return p > 0.0 and (p < 1.0 or schedule == "linear")


def _draw_bits(p: float, schedule: str) -> int:
    """Resolution (bits) of the uniform U behind nsr's draws m = 1{U < p(d)}: the fewest of
    1 / 8 / 16 bits that represent a const p exactly (p = 1/2: 1; a multiple of 1/256: 8), else
    16 (P(m=1) = ceil(65536 p(d)) / 65536). Fewer bits, fewer random words to generate."""
    if schedule == "const":
        for bits in (1, 8):
            if float(p * 2 ** bits).is_integer():
                return bits
    return 16


def _nsr_bounds(p) -> dict:
    lo, hi, d = 1.0 - p["eps_low"], 1.0 + p["eps_high"], p["delta"]
    upper = interval(hi, hi + d, "(]") if p["sides"] in ("both", "upper") else "none"
    lower = interval(lo - d, lo, "[)") if p["sides"] in ("both", "lower") else "none"
    return {**_clip_bounds(p), "nsr_band_upper": upper, "nsr_band_lower": lower,
            "nsr_p": p["p"], "nsr_schedule": p["schedule"], "nsr_sides": p["sides"], "nsr_base": p["base"],
            "nsr_draw": "U < p(d), U uniform on {k/%d}" % 2 ** _draw_bits(p["p"], p["schedule"])}


# The band: d = xs - b is the distance past the bound (x - hi for A>0, lo - x for A<0); the base
# clip zeroes d > 0; the band is 0 < d <= delta, tested as b < xs <= b + reach.


@register("nsr", params=NSR_PARAMS, level="base",
          description="Near-boundary stochastic rescue: clipped tokens just past a bound keep "
                      "their unclipped loss with probability p(d)",
          rule=_HARD_CLIP + "; if 0 < d <= delta past the bound: m ~ Bernoulli(p(d)), m=1 -> -r*A",
          source="NSR (arXiv 2605.22703); band/probability/sides are clipbench's parametrisation",
          bounds=_nsr_bounds)
def nsr(ctx: RatioContext, *, eps_low: float, eps_high: float, delta: float, p: float, schedule: str,
        sides: str, base: str) -> RuleOut:
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    x, xd = ctx.ratio(base)
    xs, b = ctx.signed(xd, lo, hi)
    reach = _reach(ctx, sides, delta)
    b_reach = b + reach  # (B, 1): the far edge of the band
    # Tokens past the band (d > reach). The base clip's zeroed tokens (d > 0) are the diagnostics'
    # out_of_band ones, so they derive near (those not beyond) and rescued (those kept).
    beyond = ctx.rows(torch.gt(xs, b_reach, out=ctx.scratch(xs.shape)))
    # A token keeps its gradient iff xs <= b + m * reach, m the Bernoulli draw: d <= 0 (never
    # clipped) or 0 < d <= delta on an active side with m = 1 (rescued).
    if _needs_draws(p, schedule):
        if ctx.generator is None:
            raise ValueError("nsr with p in (0, 1) (or schedule='linear') draws its rescue masks from an "
                             "explicit torch.Generator: pass generator=torch.Generator().manual_seed(...)")
        # m = 1{U < p(d)} with U uniform on the grid {k / 2^bits} (bits: _draw_bits), so
        # P(m=1) = ceil(2^bits p(d)) / 2^bits: exactly p for const p = 1/2 (one bit) and for const
        # p a multiple of 1/256 (one byte), within 2^-16 of p(d) otherwise. One draw per token (per
        # sequence for base='sequence'), for every position, so the generator advances the same
        # whatever the ratios (replayable). m, then b + m * reach, in the scratch buffer.
        thr = ctx.scratch(xs.shape)
        bits = _draw_bits(p, schedule)
        if bits == 1:  # p = 1/2: U in {0, 1/2}, m = 1{U == 0}, a fair coin
            ctx.coin_flips(xs.shape, out=thr)
        elif bits == 8:  # k < 256 p, k uniform in 0..255 (256 p an integer)
            torch.lt(ctx.uniform8(xs.shape), round(p * 256.0), out=thr)
        else:
            k16 = ctx.uniform16(xs.shape)  # k - 32768, int16
            if schedule == "const":  # k < 65536 p  <=>  k16 < ceil(65536 p) - 32768 (integers)
                torch.lt(k16, math.ceil(p * 65536.0) - 32768, out=thr)
            else:  # p(d) = p * (1 - d / delta)
                torch.lt(k16, (xs - b) * (-p * 65536.0 / delta) + (p * 65536.0 - 32768.0), out=thr)
            del k16
        # reach: the float delta, or (B, 1) for one side
        thr = torch.add(b, thr, alpha=delta, out=thr) if isinstance(reach, float) else thr.mul_(reach).add_(b)
        keep = torch.le(xs, thr, out=xs)  # in xs's buffer (xs is not needed any more)
    else:  # p = 1 (const): every band token is rescued; p = 0: the base clip
        keep = torch.le(xs, b_reach if p >= 1.0 else b, out=xs)
    return RuleOut(select(x, ctx.bound(lo, hi), keep), xd, keep, "aligned", beyond_rows=beyond, rescue=True)


@register("decay", params=NSR_PARAMS, level="base",
          description="Deterministic twin of nsr: in the band the gradient is scaled by p(d)",
          rule=_HARD_CLIP + "; if 0 < d <= delta past the bound: -sg(p(d))*r*A",
          source="clipbench (expected-gradient twin of NSR, arXiv 2605.22703)",
          bounds=_nsr_bounds)
def decay(ctx: RatioContext, *, eps_low: float, eps_high: float, delta: float, p: float, schedule: str,
          sides: str, base: str) -> RuleOut:
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    x, xd = ctx.ratio(base)
    xs, b = ctx.signed(xd, lo, hi)
    # d <= 0, or in the band on an active side. A temporary in the scratch buffer: used by the
    # select below and counted here, never kept.
    in_reach = torch.le(xs, b + _reach(ctx, sides, delta), out=ctx.scratch(xs.shape))
    beyond = ctx.zero_rows(in_reach)  # (B,) d past the reach
    if schedule == "const":
        # gradient multiplier 1 unclipped (d <= 0), p in the band, 0 beyond: lerp(d <= 0, in_reach, p)
        # is exactly that (0/1 operands: 1 + p * 0, 0 + p * 1 (or 1 - (1 - p) * 1, exact), 0).
        # In xs's buffer (not needed any more).
        gate = torch.lerp(torch.le(xs, b, out=xs), in_reach, p, out=xs)
        zero = beyond if p > 0.0 else ctx.zero_rows(gate)  # p = 0: the base clip (gate == 1{d <= 0})
    else:  # p(d) = p * (1 - d / delta)
        pd = (xs - b) * (-p / delta) + p
        near = torch.gt(xs, b, out=xs).mul_(in_reach)  # 0 < d <= delta on an active side (xs's buffer)
        zero = beyond + ctx.rows(near * feq(pd, 0.0))  # and zero gradient where p(d) == 0 (d = delta)
        gate = torch.lerp(in_reach, pd, near, out=near)
    # value: x * gate (x unclipped, sg(p(d)) * x in the band), the bound beyond the band
    surrogate = select(x, ctx.bound(lo, hi), in_reach, gate)
    # in_band_near = (d > 0) - beyond: derived by the diagnostics (see RuleOut.beyond_rows)
    return RuleOut(surrogate, xd, None, "aligned", zero_rows=zero, beyond_rows=beyond)


# --------------------------------------------------------------------------------------------
# Soft / gradient-preserving rules
# --------------------------------------------------------------------------------------------
@register("cispo", params=(EPS_LOW(1.0), EPS_HIGH(4.0)),
          description="Clipped importance-sampling weight on a REINFORCE term; never zero",
          rule="-sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp",
          source="CISPO, MiniMax-M1 (arXiv 2506.13585)",
          bounds=lambda p: {"weight_cap": interval(max(0.0, 1 - p["eps_low"]), 1 + p["eps_high"]),
                            "weight_low": 1 - p["eps_low"], "weight_high": 1 + p["eps_high"]})
def cispo(ctx: RatioContext, *, eps_low: float, eps_high: float) -> RuleOut:
    w = ctx.r_d.clamp(1.0 - eps_low, 1.0 + eps_high)  # (B, T) detached weight
    return RuleOut(w * ctx.logp, ctx.r_d)


@register("sapo", params=(Param("tau_pos", 1.0, "gate temperature for A>0", _positive),
                          Param("tau_neg", 1.05, "gate temperature for A<0", _positive)),
          description="Soft adaptive gate: sigmoid in place of the hard clip, slope 1 at r=1",
          rule="-(4/tau) * sigmoid(tau*(r-1)) * A; tau = tau_pos if A>0 else tau_neg",
          source="SAPO (arXiv 2511.20347)",
          bounds=lambda p: {"gate": "sigmoid", "tau_pos": p["tau_pos"], "tau_neg": p["tau_neg"]})
def sapo(ctx: RatioContext, *, tau_pos: float, tau_neg: float) -> RuleOut:
    tau = _per_row(ctx, tau_pos, tau_neg, tau_pos)  # (B, 1); A == 0 rows: loss is 0 anyway
    gate = torch.sigmoid(torch.addcmul(-tau, tau, ctx.r))  # sigmoid(tau * (r - 1)), (B, T)
    return RuleOut(gate * (4.0 / tau), ctx.r_d)


@register("gppo", params=(EPS_LOW(0.2), EPS_HIGH(0.28),
                          Param("beta_low", 1.0, "gradient scale past the lower bound (A<0)", _nonneg),
                          Param("beta_high", 1.0, "gradient scale past the upper bound (A>0)", _nonneg)),
          description="Gradient-preserving clip: constant-magnitude gradient in the clipped cells",
          rule=_HARD_CLIP + "; clipped cells: -beta * b * r/sg(r) * A, b = the bound hit",
          source="GPPO, Klear-Reasoner (arXiv 2508.07629)",
          bounds=lambda p: {**_clip_bounds(p), "grad_past_high": p["beta_high"] * (1 + p["eps_high"]),
                            "grad_past_low": p["beta_low"] * (1 - p["eps_low"])})
def gppo(ctx: RatioContext, *, eps_low: float, eps_high: float, beta_low: float, beta_high: float) -> RuleOut:
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    rd = ctx.r_d
    unclipped = ctx.unclipped(rd, lo, hi)
    coef = _per_row(ctx, beta_high * hi, beta_low * lo, 0.0)  # (B, 1) beta * b
    # r * (beta*b / sg(r)) == beta*b * r/sg(r): value beta*b, d/dlogp = beta*b; one op on the graph.
    scale = torch.lerp(coef / rd, rd.new_tensor(1.0), unclipped)
    keep = None
    if beta_high == 0.0 or beta_low == 0.0:  # a zero beta zeroes that cell's gradient
        dead = _per_row(ctx, float(beta_high == 0.0), float(beta_low == 0.0), 0.0)  # (B, 1)
        keep = 1.0 - (1.0 - unclipped) * dead
    return RuleOut(ctx.r * scale, rd, keep, "aligned")
