"""Stability over a learning-rate axis: each rule's gain over the base model at every rate, the runs
that collapsed (and how), and its critical learning rate. Plain dicts, no formatting.

    stability(compared, health) -> {model: {...}} or None     None: no block has two or more rates

It applies to a block (base model) where some rule's compared runs have at least two values of
``train.lr``. A block where every rule trained at one rate of its own (a tuned comparison: rates
chosen elsewhere) has no ladder, so no stability table, critical rate or tuned rate.
Definitions (also in docs/reports.md):
- A rule is a run's label without the learning rate (``load.assign_labels`` on the configs with
  ``train.lr`` removed), so ``grpo`` at every rate is one line.
- A run's gain over the base model: its final Avg@n minus its own step-0 Avg@n (the base model on
  the same problems and samples), in points, benchmarks averaged. Runs without a step-0 evaluation
  have no gain. Per (rule, rate): the mean over seeds and Student's t 95% interval over the seeds'
  gains (`stats.t_interval`; none with one seed).
- Collapse: the runs of a cell whose health flags name a kind of collapse (`health.KINDS`), counted
  per kind.
- The critical learning rate of a rule: the largest rate of the ladder at which its mean gain is
  >= 0 there and at every lower rate of the ladder (None: below the ladder, the lowest rate already
  loses accuracy). Its interval is bracketed by the rates whose gain interval excludes 0: the lower
  end is the largest rate at or below the estimate whose interval lies at or above 0 (None: no rate
  of the ladder is shown safe), the upper end the smallest rate above the estimate whose interval
  lies below 0 (None: no rate of the ladder is shown to lose). The critical rate lies in
  [lower, upper) if the gain falls with the rate; rates between the ends are ones where the seeds
  cannot tell. The bracket is built from uncorrected per-rate intervals: it has no stated coverage.
- The fitted critical rate (``critical_fit``), the one with a stated coverage: the gain of every (seed,
  rate) of a rule fitted against x = log(lr) by least squares (`numpy.polynomial.Polynomial.fit`; a
  quadratic from three rates, else a line), and solved for gain = 0 where the fit falls through 0 past
  its peak (the first descending root inside the ladder). Censored at the ladder's ends: a fit below 0
  at the lowest rate gives the lowest rate ("below"), one above 0 at the highest the highest
  ("above"); the fit never extrapolates. Its 95% interval is the percentile interval of the
  bootstrap over seeds (a seed's runs at every rate resampled together, `scipy.stats.bootstrap`,
  BOOTSTRAP_RESAMPLES resamples); the ratio to the reference rule's (grpo's) likewise, the seeds both
  rules have resampled together (paired by seed).
- The tuned rate (``best_rate``): the rate of the ladder with the highest mean gain over seeds (the
  lower rate on a tie); ``edge`` says when it is the ladder's lowest or highest rate (the ladder did
  not bracket it). lr* (``peak_fit``): the peak of the same least-squares fit against log(lr)
  (``fitted_peak``: the vertex of a concave quadratic inside the ladder; else the ladder's end where
  the fit is higher, censored "below" / "above"), with the same seed bootstrap interval and ratio.
- ``stability(..., bench=B)`` computes every gain on benchmark B alone: tuning reads a validation
  split, never the split the verdicts use (``clipbench report --tune-on B``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import numpy as np

from clipbench.config.stored import recorded
from clipbench.report import stats
from clipbench.report.health import KINDS
from clipbench.report.load import RunRecord, assign_labels

REFERENCE = "grpo"  # the rule the fitted critical rates are divided by (when the block has one grpo rule)


def run_lr(run: RunRecord) -> float | None:
    lr = recorded(run.config, "train.lr")
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def rule_labels(runs: Sequence[RunRecord]) -> dict[str, str]:
    """{run_id: label without the learning rate}: the runs of one rule at every rate share it."""
    clones = []
    for r in runs:
        cfg = copy.deepcopy(r.config)
        if isinstance(cfg.get("train"), dict):
            cfg["train"].pop("lr", None)
        clones.append(RunRecord(run_id=r.run_id, path=r.path, config=cfg, state=r.state))
    assign_labels(clones)
    return {c.run_id: c.label for c in clones}


def run_gain(run: RunRecord, bench: str | None = None) -> float | None:
    """Final Avg@n minus step-0 Avg@n (points), benchmarks both evaluations have averaged (`bench`
    alone when given); None without a step-0 evaluation distinct from the final one."""
    if not run.evals or 0 not in run.evals or run.final_step in (None, 0):
        return None
    start, end = run.evals[0], run.evals[run.final_step]
    benches = sorted(set(start) & set(end) & ({bench} if bench else set(start)))
    if not benches:
        return None
    return float(np.mean([100.0 * (np.mean(end[b]["correct"]) - np.mean(start[b]["correct"])) for b in benches]))


def cell(runs: Sequence[RunRecord], health: Mapping[str, dict], bench: str | None = None) -> dict:
    """One (rule, rate): the seeds' gains (on `bench` alone when given), their mean and t interval, the
    runs flagged per kind."""
    gains = {r.seed: g for r in runs if (g := run_gain(r, bench)) is not None}
    values = [gains[s] for s in sorted(gains)]
    mean = float(np.mean(values)) if values else math.nan
    ci = list(stats.t_interval(values)) if len(values) >= 2 else [math.nan, math.nan]
    kinds: dict[str, int] = {}
    flagged = 0
    for r in runs:
        found = (health.get(r.run_id) or {}).get("kinds") or []
        flagged += bool(found)
        for k in dict.fromkeys(found):
            kinds[k] = kinds.get(k, 0) + 1
    return {
        "seeds": sorted(gains),
        "gains": values,
        "mean": mean,
        "ci": ci,
        "runs": len(runs),
        "flagged": flagged,
        "kinds": {k: kinds[k] for k in KINDS if k in kinds},
    }


def critical_rate(cells: Mapping[float, dict]) -> dict:
    """{"rate", "lower", "upper"} from a rule's cells by rate (module docstring)."""
    rates = sorted(r for r, c in cells.items() if math.isfinite(c["mean"]))
    rate = None
    for r in rates:
        if cells[r]["mean"] < 0:
            break
        rate = r
    lower = upper = None
    if rate is not None:
        safe = [r for r in rates if r <= rate and cells[r]["ci"][0] >= 0]
        lower = max(safe) if safe else None
    losing = [r for r in rates if (rate is None or r > rate) and cells[r]["ci"][1] < 0]
    upper = min(losing) if losing else None
    return {"rate": rate, "lower": lower, "upper": upper, "rates": rates}


def _points(cells: Mapping[float, dict], seeds: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(x = log lr, gain) over the (seed, rate) pairs of `seeds` (a seed drawn twice counts twice)."""
    by = {lr: dict(zip(c["seeds"], c["gains"])) for lr, c in cells.items()}
    xs, ys = [], []
    for s in seeds:
        for lr, g in by.items():
            if s in g:
                xs.append(math.log(lr))
                ys.append(g[s])
    return np.array(xs), np.array(ys)


def fitted_root(x: np.ndarray, y: np.ndarray) -> tuple[float, str | None]:
    """(x where the least-squares fit of y on x crosses 0 going down, censoring): a quadratic with three
    or more distinct x, else a line; the first descending root inside [min x, max x]; without one, the
    lowest x when the fit is below 0 there ("below"), else the highest ("above")."""
    lo, hi = float(x.min()), float(x.max())
    deg = 2 if np.unique(x).size >= 3 else 1
    if np.unique(x).size < 2:
        return math.nan, None
    fit = np.polynomial.Polynomial.fit(x, y, deg)
    slope = fit.deriv()
    roots = sorted(float(r.real) for r in fit.roots() if abs(r.imag) < 1e-12 and lo <= r.real <= hi)
    falling = [r for r in roots if slope(r) < 0]
    if falling:
        return falling[0], None
    return (lo, "below") if fit(lo) < 0 else (hi, "above")


def fitted_peak(x: np.ndarray, y: np.ndarray) -> tuple[float, str | None]:
    """(x where the least-squares fit of y on x peaks, censoring): a quadratic with three or more
    distinct x, else a line; the vertex of a concave quadratic when it lies inside [min x, max x];
    otherwise the end where the fit is higher, censored "below" (the lowest x) or "above" (the highest)."""
    if np.unique(x).size < 2:
        return math.nan, None
    lo, hi = float(x.min()), float(x.max())
    deg = 2 if np.unique(x).size >= 3 else 1
    fit = np.polynomial.Polynomial.fit(x, y, deg).convert()  # coefficients in x itself
    c = np.pad(fit.coef, (0, 3 - fit.coef.size))
    if c[2] < 0 and lo <= (vertex := -c[1] / (2 * c[2])) <= hi:
        return float(vertex), None
    return (lo, "below") if fit(lo) >= fit(hi) else (hi, "above")


def best_rate(cells: Mapping[float, dict]) -> dict:
    """{"rate", "mean", "edge"}: the rate with the highest mean gain (the lower rate on a tie); edge
    "lowest" / "highest" when it is the ladder's end, else None."""
    rates = sorted(r for r, c in cells.items() if math.isfinite(c["mean"]))
    if not rates:
        return {"rate": None, "mean": math.nan, "edge": None}
    rate = max(rates, key=lambda r: (cells[r]["mean"], -r))
    edge = "lowest" if rate == rates[0] else ("highest" if rate == rates[-1] else None)
    return {"rate": rate, "mean": cells[rate]["mean"], "edge": edge if len(rates) > 1 else None}


def critical_fit(cells: Mapping[float, dict], reference: Mapping[float, dict] | None = None) -> dict | None:
    """{"rate", "censored", "ci", "ratio", "ratio_ci", "seeds"}: the fitted critical rate, its bootstrap
    interval over seeds and, with `reference` (the reference rule's cells), the ratio to its fitted rate
    (module docstring); None with fewer than 2 rates or 2 seeds."""
    return _fit(fitted_root, cells, reference)


def peak_fit(cells: Mapping[float, dict], reference: Mapping[float, dict] | None = None) -> dict | None:
    """critical_fit's dict for lr*, the peak of the fit (`fitted_peak`), and its ratio to the reference's."""
    return _fit(fitted_peak, cells, reference)


def _fit(solve, cells: Mapping[float, dict], reference: Mapping[float, dict] | None) -> dict | None:
    """`solve` (fitted_root or fitted_peak) on every seed's gains, with the seed bootstrap's interval."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    seeds = sorted({s for c in cells.values() for s in c["seeds"]})
    if len(cells) < 2 or len(seeds) < 2:
        return None
    at = lambda idx: solve(*_points(cells, [seeds[i] for i in np.asarray(idx, dtype=int)]))[0]  # noqa: E731
    x, censored = solve(*_points(cells, seeds))
    out = {"rate": math.exp(x), "censored": censored, "ci": [math.nan, math.nan], "seeds": len(seeds)}
    out.update(ratio=None, ratio_ci=[math.nan, math.nan])
    rng = np.random.default_rng(stats.BOOTSTRAP_SEED)
    boot = lambda stat, n: (
        sps.bootstrap(  # noqa: E731 - the seeds resampled with replacement
            (np.arange(n),), stat, n_resamples=stats.BOOTSTRAP_RESAMPLES, method="percentile", vectorized=False, rng=rng
        ).confidence_interval
    )
    ci = boot(at, len(seeds))
    out["ci"] = [math.exp(ci.low), math.exp(ci.high)]
    if reference is not None:
        shared = sorted(set(seeds) & {s for c in reference.values() for s in c["seeds"]})
        if len(shared) >= 2 and len(reference) >= 2:
            ratio = lambda idx: math.exp(  # noqa: E731
                solve(*_points(cells, [shared[i] for i in idx]))[0]
                - solve(*_points(reference, [shared[i] for i in idx]))[0]
            )
            out["ratio"] = ratio(np.arange(len(shared)))
            rci = boot(ratio, len(shared))
            out["ratio_ci"] = [float(rci.low), float(rci.high)]
    return out


def block_stability(runs: Sequence[RunRecord], health: Mapping[str, dict], bench: str | None = None) -> dict | None:
    rule_of = rule_labels(runs)
    per_rule: dict[str, set[float]] = {}
    for r in runs:
        if (lr := run_lr(r)) is not None:
            per_rule.setdefault(rule_of[r.run_id], set()).add(lr)
    if max(map(len, per_rule.values()), default=0) < 2:  # no rule at two rates: no ladder to read
        return None
    rates = sorted(set().union(*per_rule.values()))
    rules = list(dict.fromkeys(rule_of[r.run_id] for r in runs))
    out: dict = {"rates": rates, "rules": {}, "bench": bench}
    for rule in rules:
        mine = [r for r in runs if rule_of[r.run_id] == rule]
        cells = {
            lr: cell([r for r in mine if run_lr(r) == lr], health, bench)
            for lr in rates
            if any(run_lr(r) == lr for r in mine)
        }
        out["rules"][rule] = {
            "method": mine[0].method,
            "cells": cells,
            "critical": critical_rate(cells),
            "best": best_rate(cells),
        }
    refs = [rule for rule, info in out["rules"].items() if info["method"] == REFERENCE]
    ref = out["rules"][refs[0]]["cells"] if len(refs) == 1 else None
    out["reference"] = refs[0] if len(refs) == 1 else None
    for info in out["rules"].values():
        info["fit"] = critical_fit(info["cells"], ref)
        info["peak"] = peak_fit(info["cells"], ref)
    return out


def stability(compared: Sequence[RunRecord], health: Mapping[str, dict], bench: str | None = None) -> dict | None:
    """{model: block_stability} for the blocks where a rule has a learning-rate axis; None when none has.
    `bench`: every gain on that benchmark alone (tuning on a validation split)."""
    blocks: dict[str, list[RunRecord]] = {}
    for r in compared:
        blocks.setdefault(r.model, []).append(r)
    out = {m: s for m, rs in blocks.items() if (s := block_stability(rs, health, bench)) is not None}
    return out or None


def losing_rates(runs: Sequence[RunRecord], method: str = "grpo") -> set[float] | None:
    """The rates at which `method`'s mean gain over the base model is below 0 (where it loses
    accuracy: the cliff); None when the runs have no `method` run with a gain."""
    by_rate: dict[float, list[float]] = {}
    for r in runs:
        g = run_gain(r) if r.method == method else None
        if g is not None and (lr := run_lr(r)) is not None:
            by_rate.setdefault(lr, []).append(g)
    if not by_rate:
        return None
    return {lr for lr, gs in by_rate.items() if np.mean(gs) < 0}
