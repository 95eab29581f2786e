"""Clipping diagnostics: quadrant cells, counts per cell, ratio statistics, log-ratio histogram.

Cells (every valid token falls in exactly one), on the ratio ``x`` the rule acts on — the token
ratio r for token-level rules, GSPO's sequence ratio s (broadcast to the sequence's tokens) for
sequence-level ones (gspo, gspo_token, nsr/decay with base='sequence'):

    q1: A>0, x>1   q2: A>0, x<1   q3: A<0, x<1   q4: A<0, x>1   zero_adv: A==0   on_policy: A!=0, x==1

Counts per cell (valid tokens only):
    tokens        tokens in the cell
    out_of_band   x outside the method's reference band (``MethodSpec.band``): [1-eps_low, 1+eps_high]
                  when the method has eps_low/eps_high, 0.2/0.2 otherwise (sapo); abc uses
                  [1-eps2, 1+eps1] for A>0 and [1-eps4, 1+eps3] for A<0; A==0 tokens use the A>0 band
    zero_grad     tokens whose policy-loss gradient the rule sets exactly to zero (1 - the rule's
                  ``keep`` mask, the one that builds the loss); every zero_adv token
                  (l = -A * ... = 0). The KL term is not included.
    rescued       tokens NSR rescued (0 for other methods)
    in_band_near  tokens in the NSR/decay band (0 < d <= delta past an active bound)

Counts are computed per row first (a few row sums: padding has x == 1, inside every band, and
keep == 1 there, so no per-token masking is needed) and then combined over rows by the sign of A
with one small matmul. Every statistic is a detached 0-d tensor (no host sync).
"""

from __future__ import annotations

import torch

from clipbench.objectives.context import RatioContext, RuleOut, bshape, fgt

CELLS = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
COUNTS = ("tokens", "out_of_band", "zero_grad", "rescued", "in_band_near")

# Per-row features (B, 11). Bands contain 1 (eps >= 0), so x>hi implies x>1 and x<lo implies
# x<1: out-of-band tokens are never in the x == 1 cell.
FEATURES = ("n", "gt", "lt", "hi", "lo", "zero", "zero_gt", "zero_lt", "rescued", "near", "beyond")
_F = {f: i for i, f in enumerate(FEATURES)}


def _cell_map(derive_rescued: bool = False, derive_near: bool = False) -> torch.Tensor:
    """(30, 3 * len(FEATURES)) linear map from [A>0; A<0; A==0] @ features to the (6, 5) counts.

    rescued / near tokens lie in the base clip's zeroed cells: q1 (A>0: x > hi) or q3 (A<0:
    x < lo). When a rule gives no per-row counts for them (nsr, decay), they are derived from
    the out_of_band counts of that cell (the reference band is the base clip's band there):
    rescued = out_of_band - zero_grad (derive_rescued), near = out_of_band - beyond (derive_near,
    "beyond" = tokens past the band)."""
    m = torch.zeros(len(CELLS), len(COUNTS), 3, len(FEATURES))
    POS, NEG, ZA = range(3)
    rescued = {"q1": ["hi", "-zero"], "q3": ["lo", "-zero"]} if derive_rescued else {"q1": ["rescued"], "q3": ["rescued"]}
    near = {"q1": ["hi", "-beyond"], "q3": ["lo", "-beyond"]} if derive_near else {"q1": ["near"], "q3": ["near"]}
    table = {  # cell: (row group, {count: [feature, or -feature]})
        "q1": (POS, {"tokens": ["gt"], "out_of_band": ["hi"], "zero_grad": ["zero_gt"],
                     "rescued": rescued["q1"], "in_band_near": near["q1"]}),
        "q2": (POS, {"tokens": ["lt"], "out_of_band": ["lo"], "zero_grad": ["zero_lt"]}),
        "q3": (NEG, {"tokens": ["lt"], "out_of_band": ["lo"], "zero_grad": ["zero_lt"],
                     "rescued": rescued["q3"], "in_band_near": near["q3"]}),
        "q4": (NEG, {"tokens": ["gt"], "out_of_band": ["hi"], "zero_grad": ["zero_gt"]}),
        "zero_adv": (ZA, {"tokens": ["n"], "out_of_band": ["hi", "lo"], "zero_grad": ["n"]}),
    }
    for cell, (grp, counts) in table.items():
        for count, feats in counts.items():
            for f in feats:
                sign = -1.0 if f.startswith("-") else 1.0
                m[CELLS.index(cell), COUNTS.index(count), grp, _F[f.lstrip("-")]] = sign
    on = CELLS.index("on_policy")  # x == 1 exactly: total - (x>1) - (x<1)
    for grp in (POS, NEG):
        for count, (total, gt, lt) in (("tokens", ("n", "gt", "lt")), ("zero_grad", ("zero", "zero_gt", "zero_lt"))):
            c = COUNTS.index(count)
            m[on, c, grp, _F[total]], m[on, c, grp, _F[gt]], m[on, c, grp, _F[lt]] = 1.0, -1.0, -1.0
    return m.reshape(len(CELLS) * len(COUNTS), 3 * len(FEATURES))


_CELL_MAPS = {(dr, dn): _cell_map(dr, dn) for dr in (False, True) for dn in (False, True)}


def _row_features(ctx: RatioContext, out: RuleOut, lo, hi) -> torch.Tensor:
    """(B, len(FEATURES)) per-row token counts. Padding has x == 1 and keep == 1, so it falls in
    no feature but n."""
    x = out.ratio  # (B, T) or (B, 1), detached
    n = ctx.n_tok.reshape(-1)  # (B,)
    zeros = torch.zeros_like(n)
    n_gt, n_lt = ctx.count_rows(torch.gt, x, 1.0), ctx.count_rows(torch.lt, x, 1.0)
    n_hi, n_lo = ctx.rows_outside(x, lo, hi)
    feats = [n, n_gt, n_lt, n_hi, n_lo]
    keep = out.keep
    if keep is None and out.zero_rows is None:
        feats += [zeros, zeros, zeros]
    else:
        z = ctx.zero_rows(keep) if out.zero_rows is None else out.zero_rows
        if out.zero_cells == "aligned":  # zeroed tokens of A>0 rows have x > 1, of A<0 rows x < 1
            z_lt = z * ctx.neg.reshape(-1)
            z_gt = z - z_lt
        elif out.zero_cells == "band":  # zeroed == out of band: x > hi (> 1) or x < lo (< 1)
            z_gt, z_lt = n_hi, n_lo
        elif out.zero_cells == "dual":  # x < 1 part: A<0 rows' x < lo
            z_lt = n_lo * ctx.neg.reshape(-1)
            z_gt = z - z_lt
        else:  # kept tokens with x > 1 (x < 1), in the scratch buffer
            shape = bshape(x.shape, keep.shape)
            z_gt = n_gt - ctx.rows(torch.gt(x, 1.0, out=ctx.scratch(shape)).mul_(keep))
            z_lt = n_lt - ctx.rows(torch.lt(x, 1.0, out=ctx.scratch(shape)).mul_(keep))
        feats += [z, z_gt, z_lt]
    feats += [zeros if out.rescued_rows is None else out.rescued_rows,
              zeros if out.near_rows is None else out.near_rows,
              zeros if out.beyond_rows is None else out.beyond_rows]
    return torch.stack(feats, 1)


def cell_counts(ctx: RatioContext, out: RuleOut, band: tuple[float, float, float, float]) -> torch.Tensor:
    """(6, 5) float32 counts: rows CELLS, columns COUNTS."""
    lo_p, hi_p, lo_n, hi_n = band
    if (lo_p, hi_p) == (lo_n, hi_n):
        lo, hi = lo_p, hi_p
    else:  # per-row band (abc): A<0 rows use the negative band, others the positive one
        lo = torch.lerp(ctx.A.new_tensor(lo_p), ctx.A.new_tensor(lo_n), ctx.neg)
        hi = torch.lerp(ctx.A.new_tensor(hi_p), ctx.A.new_tensor(hi_n), ctx.neg)
    feats = _row_features(ctx, out, lo, hi)  # (B, F)
    groups = torch.cat([ctx.pos, ctx.neg, 1.0 - ctx.pos - ctx.neg], 1).T  # (3, B)
    per_group = groups @ feats  # (3, F)
    cell_map = _CELL_MAPS[(out.rescue and out.rescued_rows is None,
                           out.near_rows is None and out.beyond_rows is not None)]
    return (cell_map.to(feats.device) @ per_group.reshape(-1)).reshape(len(CELLS), len(COUNTS))


_COUNT_KEYS = tuple(f"{c}/{k}" for c in CELLS for k in COUNTS)
_RATIO_KEYS = ("ratio/mean", "approx_kl", "ratio/max", "ratio/min")


def step_stats(ctx: RatioContext, out: RuleOut, band, level: str) -> dict[str, torch.Tensor]:
    """All per-step diagnostics as detached 0-d tensors (keys: docs/architecture.md)."""
    counts = cell_counts(ctx, out, band)
    stats = dict(zip(_COUNT_KEYS, counts.reshape(-1).unbind(0)))
    stats["clip_events"] = counts[:, 1].sum()

    r, lr, maskf = ctx.r_d, ctx.lr_d, ctx.maskf  # padding: r == 1, lr == 0 exactly
    buf = ctx.scratch(r.shape)  # one reused buffer for the four reductions
    s_rm1 = torch.sub(r, 1.0, out=buf).sum()  # sum of r - 1 (0 at padding)
    s_k3 = buf.sub_(lr).sum()  # k3 estimator of KL(old || new): r - 1 - log r >= 0, 0 at padding
    # over valid tokens only: padding -> 0 in r * mask and in mask / r (r > 0)
    top = torch.mul(r, maskf, out=buf).max()
    inv = torch.div(maskf, r, out=buf).max()
    red = torch.stack([s_rm1, s_k3, top, inv])
    n = ctx.n_tok.sum()
    n1 = n.clamp(min=1.0)
    vals = torch.stack([red[0] / n1 + 1.0, red[1] / n1, red[2], 1.0 / red[3]])
    vals = torch.where(n > 0, vals, vals.new_tensor([1.0, 0.0, 1.0, 1.0]))  # empty batch
    stats.update(zip(_RATIO_KEYS, vals.unbind(0)))
    if level == "sequence":
        s = ctx.s_d.reshape(-1)
        has = fgt(ctx.n_tok.reshape(-1), 0.0)
        n_seq = has.sum()
        none = n_seq == 0
        stats["seq_ratio/mean"] = (s * has).sum() / n_seq.clamp(min=1.0)
        stats["seq_ratio/min"] = torch.where(none, 1.0, torch.add(s, 1.0 - has, alpha=1e30).min())
        stats["seq_ratio/max"] = torch.where(none, 1.0, (s * has).max())
    return stats


def log_ratio_histogram(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, bins: int = 41, lo: float = -0.5, hi: float = 0.5) -> dict:
    """Histogram of log r = logp - old_logp over valid tokens, split by the sign of A.

    Returns ``{"edges": [bins + 1 floats], "pos": [bins + 2 ints], "neg": [bins + 2 ints]}``;
    counts index 0 is the underflow (log r < lo), 1..bins the bins [edges[i-1], edges[i]),
    bins + 1 the overflow (log r >= hi). A == 0 tokens are in neither. For the artifact (host sync).
    """
    if bins < 1 or not hi > lo:
        raise ValueError(f"need bins >= 1 and hi > lo, got bins={bins}, lo={lo}, hi={hi}")
    with torch.no_grad():
        lr = logp.detach().float() - old_logp.detach().float()  # (B, T)
        edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
        idx = torch.bucketize(lr, edges.to(lr), right=True)  # 0 .. bins+1
        A = advantages.detach().reshape(-1, 1)
        side = (A < 0).long().expand_as(idx)  # 0: A > 0, 1: A < 0 (one bincount for both)
        keep = (mask != 0) & ~torch.isnan(lr) & (A != 0)
        counts = torch.bincount((idx + side * (bins + 2))[keep], minlength=2 * (bins + 2)).tolist()
        out = {"edges": edges.tolist(), "pos": counts[:bins + 2], "neg": counts[bins + 2:]}
    return out
