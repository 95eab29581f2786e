"""Clipping diagnostics, derived the same way for every rule (built-in or plugin) from what it returns.

Inputs per call: the rule's per-token loss l (B, T) (before weights and KL), its per-token gradient
g = d(sum l)/d logp (computed by ``policy_loss`` with ``torch.autograd.grad`` on the small rule
graph), the ratio x the cells use (the token ratio r, or GSPO's s broadcast for sequence-level
rules), the advantages A and the method's reference band.

Cells (every valid token falls in exactly one):

    q1: A>0, x>1   q2: A>0, x<1   q3: A<0, x<1   q4: A<0, x>1   zero_adv: A==0   on_policy: A!=0, x==1

Per cell, over valid tokens:
    tokens            tokens in the cell
    out_of_band       x outside the reference band ([1-eps_low, 1+eps_high] by default, 0.2/0.2 without
                      eps; per sign of A for abc; A == 0 tokens use the A>0 band)
    zero_grad         g == 0 exactly (every zero_adv token of a rule whose loss is proportional to A)
    rescued           past the PPO clip's bound in the cells where PPO's clip zeroes the gradient
                      (A>0 x>hi, A<0 x<lo) yet g != 0 and l equals the unclipped -x*A (NSR's rescue)
    in_band_near      for rules with a ``delta`` parameter: 0 < d <= delta past an active bound (the
                      ``sides`` parameter, when present, picks the bounds)
    grad_mass         sum of |g| (how much gradient magnitude flows through the cell)
    rescued_grad_mass sum of |g| over rescued tokens

A rule whose clipped tokens keep a gradient (cispo, gppo, sapo, ...) counts them in out_of_band but
not in zero_grad. Zero-gradient and rescued tokens are read from the gradient itself, never declared.

Statistics combine exactly over micro-batches and ranks: :func:`step_sums` returns 0-d float64
tensors that are either additive (counts, sums) or extrema (``*/max``, ``*/min``); :func:`reduction`
names each key's reduction, :func:`combine` merges a list of them, :func:`all_reduce_sums` reduces
them across processes in three collective calls, and :func:`finalize` turns sums into the logged
stats. Nothing here syncs with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from clipbench.objectives.corrections.registry import MASKED, TRUNCATED
from clipbench.objectives.primitives import (  # one definition of d and of sides, shared with the rules
    masked_extreme,
    on_side,
    past_bound,
)

CELLS = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
COUNTS = ("tokens", "out_of_band", "zero_grad", "rescued", "in_band_near")
MASSES = ("grad_mass", "rescued_grad_mass")
FEATURES = COUNTS + MASSES
REDUCTIONS = ("sum", "max", "min")


def cell_index(A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, T) int64 index into CELLS of each token (A (B, 1), x (B, T))."""
    quadrant = torch.where(A > 0, torch.where(x > 1, 0, 1), torch.where(x < 1, 2, 3))
    return torch.where(A == 0, 4, torch.where(x == 1, 5, quadrant))


def cell_sums(
    *,
    x: torch.Tensor,
    A: torch.Tensor,
    valid: torch.Tensor,
    loss: torch.Tensor,
    grad: torch.Tensor,
    band: tuple[float, float, float, float],
    params: Mapping[str, Any],
) -> torch.Tensor:
    """(len(CELLS), len(FEATURES)) float64 sums per cell. x, valid, loss, grad: (B, T); A: (B, 1)."""
    lo_p, hi_p, lo_n, hi_n = band
    lo = torch.where(A < 0, lo_n, lo_p)  # (B, 1) the band of each row's sign
    hi = torch.where(A < 0, hi_n, hi_p)
    out_of_band = (x < lo) | (x > hi)
    zero_grad = grad == 0
    d = past_bound(x, A, lo, hi)  # > 0 exactly in the cells PPO's clip zeroes
    rescued = (d > 0) & ~zero_grad & (loss == -x * A)
    if isinstance(params.get("delta"), (int, float)):
        sides = params.get("sides") if params.get("sides") in ("both", "upper", "lower") else "both"
        near = (d > 0) & (d <= params["delta"]) & on_side(A, sides)
    else:
        near = torch.zeros_like(valid)
    g = grad.abs().to(torch.float64)
    features = torch.stack(
        [torch.ones_like(g), out_of_band.to(g), zero_grad.to(g), rescued.to(g), near.to(g), g, g * rescued], -1
    )  # (B, T, F)
    cells = torch.nn.functional.one_hot(cell_index(A, x), len(CELLS)).to(g) * valid.unsqueeze(-1)  # (B, T, C)
    return torch.einsum("btc,btf->cf", cells, features)


def step_sums(
    *,
    x: torch.Tensor,
    A: torch.Tensor,
    valid: torch.Tensor,
    loss: torch.Tensor,
    grad: torch.Tensor,
    band,
    params: Mapping[str, Any],
    r: torch.Tensor,
    log_ratio: torch.Tensor,
    s: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every statistic of one call as combinable 0-d float64 tensors (see the module docstring).

    r, log_ratio: (B, T) detached (padding: r == 1, log_ratio == 0); s: (B, 1) for sequence-level
    rules; kl: (B, T) per-token KL to the reference (0 at padding) when a reference is used."""
    per_cell = cell_sums(x=x, A=A, valid=valid, loss=loss, grad=grad, band=band, params=params)
    sums = {f"{c}/{f}": per_cell[i, j] for i, c in enumerate(CELLS) for j, f in enumerate(FEATURES)}
    r64 = r.to(torch.float64)
    sums["n_tokens"] = valid.sum().to(torch.float64)
    sums["ratio/sum"] = torch.where(valid, r64, 0.0).sum()
    # k3 estimator of KL(old || new): r - 1 - log r >= 0 (0 at padding)
    sums["approx_kl/sum"] = torch.where(valid, r64 - 1 - log_ratio.to(torch.float64), 0.0).sum()
    sums["ratio/max"] = masked_extreme(r, valid, "max")
    sums["ratio/min"] = masked_extreme(r, valid, "min")
    if kl is not None:
        sums["kl_ref/sum"] = torch.where(valid, kl.to(torch.float64), 0.0).sum()
    if s is not None:
        has = valid.any(-1, keepdim=True)  # (B, 1) sequences with >= 1 valid token
        sums["n_seqs"] = has.sum().to(torch.float64)
        sums["seq_ratio/sum"] = torch.where(has, s.to(torch.float64), 0.0).sum()
        sums["seq_ratio/max"] = masked_extreme(s, has, "max")
        sums["seq_ratio/min"] = masked_extreme(s, has, "min")
    return sums


SPLIT_COUNTS = ("tokens", "out_of_band")  # what a token split (`split_cell_sums`) counts per cell


def split_cell_sums(
    *,
    x: torch.Tensor,
    A: torch.Tensor,
    valid: torch.Tensor,
    loss: torch.Tensor,
    grad: torch.Tensor,
    band,
    params: Mapping[str, Any],
    splits: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The cells' token and out-of-band counts over each named subset of the tokens (e.g. a MoE
    policy's tokens whose experts moved, and the others): ``{name}/{cell}/tokens|out_of_band``.
    splits: name -> (B, T) bool; each subset is intersected with `valid`."""
    out = {}
    for name, keep in splits.items():
        per_cell = cell_sums(x=x, A=A, valid=valid & keep, loss=loss, grad=grad, band=band, params=params)
        out.update(
            {f"{name}/{c}/{f}": per_cell[i, FEATURES.index(f)] for i, c in enumerate(CELLS) for f in SPLIT_COUNTS}
        )
    return out


CORRECTION_COUNTS = ("truncated", "masked")


def correction_cell_sums(
    *, x: torch.Tensor, A: torch.Tensor, valid: torch.Tensor, status: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What the sampler correction did, per cell of the clip: ``correction/{cell}/truncated`` and
    ``correction/{cell}/masked`` (masked or rejected) token counts (status: corrections' int8 codes)."""
    flags = torch.stack([(status == TRUNCATED), (status >= MASKED)], -1).to(torch.float64)  # (B, T, 2)
    cells = torch.nn.functional.one_hot(cell_index(A, x), len(CELLS)).to(torch.float64) * valid.unsqueeze(-1)
    per = torch.einsum("btc,btf->cf", cells, flags)
    return {f"correction/{c}/{f}": per[i, j] for i, c in enumerate(CELLS) for j, f in enumerate(CORRECTION_COUNTS)}


def stat_sums(stat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rule's mini-batch statistic as sums: ``stat/<name>/max`` (the same value in every call of
    the mini-batch, so the maximum over calls and ranks is it); logged as ``stat/<name>``."""
    return {f"stat/{k}/max": v.detach().to(torch.float64) for k, v in stat.items()}


def reduction(key: str) -> str:
    """How a key of ``sums`` combines over micro-batches and ranks: "sum", "max" or "min"."""
    return "max" if key.endswith("/max") else "min" if key.endswith("/min") else "sum"


def combine(sums_list: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One ``sums`` of several calls (micro-batches of one mini-batch): each key reduced by its kind."""
    sums_list = list(sums_list)
    if not sums_list:
        raise ValueError("combine() needs at least one sums dict")
    keys = list(sums_list[0])
    for other in sums_list[1:]:
        if list(other) != keys:
            raise ValueError("combine(): the sums have different keys (different methods or options)")
    out = {}
    for key in keys:
        stacked = torch.stack([s[key] for s in sums_list])
        out[key] = {"sum": stacked.sum, "max": stacked.amax, "min": stacked.amin}[reduction(key)](0)
    return out


def reduce_sums(sums, reduce: Callable[[torch.Tensor, str], None], *, to=None):
    """``sums`` (one mapping, or a list of them: e.g. every optimizer step of a rollout batch) with
    every key reduced by ``reduce(tensor, kind)`` (in place, kind "sum"/"max"/"min"), called once per
    kind on the stacked keys of that kind for all of them: one collective per kind. A key missing
    from one mapping of a list reads 0 there. ``to``: a device the result moves to, in one transfer
    per kind (the host, for logging)."""
    rows = [sums] if isinstance(sums, Mapping) else list(sums)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out: list[dict[str, torch.Tensor]] = [dict(r) for r in rows]
    for kind in REDUCTIONS:
        ks = [k for k in keys if reduction(k) == kind]
        if not ks:
            continue
        zero = next(r[k] for r in rows for k in ks if k in r).new_zeros((), dtype=torch.float64)
        stacked = torch.stack(
            [torch.stack([r[k].to(torch.float64) if k in r else zero for k in ks]) for r in rows]
        )  # (mappings, keys)
        reduce(stacked, kind)
        if to is not None:
            stacked = stacked.to(to)
        for row, vals in zip(out, stacked):
            row.update(zip(ks, vals.unbind(0)))
    return out[0] if isinstance(sums, Mapping) else out


def all_reduce_sums(sums: Mapping[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """``sums`` all-reduced across the processes of ``group`` (torch.distributed): the one-liner a
    data-parallel trainer needs before :func:`finalize`."""

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    return reduce_sums(sums, lambda vector, kind: dist.all_reduce(vector, op=ops[kind], group=group))


def finalize(sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The logged stats (docs/architecture.md) from ``sums``: "{cell}/{count}" and "{cell}/{mass}",
    clip_events, ratio/mean|min|max, approx_kl, kl_ref (with a reference), seq_ratio/* (sequence
    level), correction/{cell}/{truncated,masked} (with a sampler correction), stat/<name> (a rule's
    mini-batch statistic). Means divide by the valid-token (sequence) count; an empty batch gives ratio 1, KL 0."""
    stats = {f"{c}/{f}": sums[f"{c}/{f}"] for c in CELLS for f in FEATURES}
    stats["clip_events"] = sum(sums[f"{c}/out_of_band"] for c in CELLS)
    n = sums["n_tokens"]
    empty = n == 0
    n1 = n.clamp(min=1.0)
    one = torch.ones_like(n)
    stats["ratio/mean"] = torch.where(empty, one, sums["ratio/sum"] / n1)
    stats["ratio/min"] = torch.where(empty, one, sums["ratio/min"])
    stats["ratio/max"] = torch.where(empty, one, sums["ratio/max"])
    stats["approx_kl"] = sums["approx_kl/sum"] / n1
    if "kl_ref/sum" in sums:
        stats["kl_ref"] = sums["kl_ref/sum"] / n1
    if "n_seqs" in sums:
        none = sums["n_seqs"] == 0
        stats["seq_ratio/mean"] = torch.where(none, one, sums["seq_ratio/sum"] / sums["n_seqs"].clamp(min=1.0))
        stats["seq_ratio/min"] = torch.where(none, one, sums["seq_ratio/min"])
        stats["seq_ratio/max"] = torch.where(none, one, sums["seq_ratio/max"])
    for k, v in sums.items():
        if k.startswith("correction/") and k.split("/")[1] in CELLS:
            stats[k] = v
        elif k.startswith("stat/") and k.endswith("/max"):
            stats[k[: -len("/max")]] = v
        elif (
            len(parts := k.split("/")) == 3 and parts[1] in CELLS and parts[2] in SPLIT_COUNTS and parts[0] not in CELLS
        ):
            stats[k] = v  # a token split's cell counts (split_cell_sums)
    return stats


HIST_BINS, HIST_LO, HIST_HI = 41, -0.5, 0.5


def log_ratio_counts(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    bins: int = HIST_BINS,
    lo: float = HIST_LO,
    hi: float = HIST_HI,
) -> torch.Tensor:
    """(2 * (bins + 2),) int64 counts of log r = logp - old_logp over valid tokens, on the inputs'
    device (no host sync: the trainer adds them up and transfers once per rollout step). The first
    bins + 2 are A > 0, the rest A < 0; within each, index 0 is the underflow (log r < lo), 1..bins
    the bins [edges[i-1], edges[i]), bins + 1 the overflow (log r >= hi). A == 0 tokens are in neither."""
    if bins < 1 or not hi > lo:
        raise ValueError(f"need bins >= 1 and hi > lo, got bins={bins}, lo={lo}, hi={hi}")
    with torch.no_grad():
        lr = logp.detach().float() - old_logp.detach().float()  # (B, T)
        edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64, device=lr.device)
        idx = torch.bucketize(lr, edges.to(lr), right=True)  # 0 .. bins+1
        A = advantages.detach().reshape(-1, 1)
        side = (A < 0).long().expand_as(idx)  # 0: A > 0, 1: A < 0 (one bincount for both)
        keep = (mask != 0) & ~torch.isnan(lr) & (A != 0)
        return torch.bincount((idx + side * (bins + 2))[keep], minlength=2 * (bins + 2))


def histogram_dict(counts: torch.Tensor, bins: int = HIST_BINS, lo: float = HIST_LO, hi: float = HIST_HI) -> dict:
    """``{"edges": [bins + 1 floats], "pos": [bins + 2 ints], "neg": [bins + 2 ints]}`` from
    `log_ratio_counts` (summed over anything): the artifact's row (a host transfer)."""
    c = [int(x) for x in counts.cpu().tolist()]
    return {
        "edges": torch.linspace(lo, hi, bins + 1, dtype=torch.float64).tolist(),
        "pos": c[: bins + 2],
        "neg": c[bins + 2 :],
    }


def log_ratio_histogram(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    bins: int = HIST_BINS,
    lo: float = HIST_LO,
    hi: float = HIST_HI,
) -> dict:
    """The histogram of one batch as the artifact's dict (`log_ratio_counts`, then `histogram_dict`)."""
    return histogram_dict(log_ratio_counts(logp, old_logp, advantages, mask, bins, lo, hi), bins, lo, hi)
