"""The statistics behind the report: functions over per-problem values (numpy, scipy.stats).

The problem is the unit of evaluation (docs/objectives.md, "Evaluation metrics"):

- per problem, Avg@n is its mean correctness over n samples and Pass@k the unbiased estimator
  ``1 - C(n-c, k) / C(n, k)`` (``clipbench.eval.passk``); seeds of one method are averaged per
  problem first;
- a 95% confidence interval over problems is Student's t interval of the mean of those per-problem
  values (``t_interval``, `scipy.stats.t`); the Average over benchmarks combines the benchmarks'
  standard errors with Welch-Satterthwaite degrees of freedom (``combined_t_interval``);
- that interval over problems is within-seed sampling noise only (another seed trains another model);
- a method is compared with the baseline with the seed as the unit (``seed_test``): each seed's value
  (the mean over its problems), paired by seed, a paired t over the seeds' differences
  (`scipy.stats.ttest_1samp`, its interval) and Holm's correction over the methods compared
  (``holm``: `statsmodels.stats.multitest.multipletests`);
- a claim that a method "does not lose" is a non-inferiority test against a declared margin m
  (``noninferiority``: the paired t of the difference against -m) and "no difference" an
  equivalence test (``tost``: two one-sided t tests against -m and +m);
- with one seed only the problems can be resampled: ``paired_bootstrap_p``, a paired bootstrap over
  problems (paired by problem id; `scipy.stats.bootstrap`'s bootstrap distribution, benchmarks
  resampled separately for the Average), p ``(1 + #{|d*_b - d| >= |d|}) / (B + 1)``: it speaks for the
  trained models at hand, not for another seed;
- aggregates over runs in the style of rliable (Agarwal et al., 2021): the interquartile mean and the
  probability of improvement (``rliable.metrics``) with stratified bootstrap intervals
  (``stratified_interval``, `scipy.stats.bootstrap` resampling the runs of each task separately).

scipy.stats is imported when a statistic is computed (about a second), not when the report
package is imported.
"""

from __future__ import annotations

import functools
import gc
import math
import warnings
from collections.abc import Sequence

import numpy as np

from clipbench.eval.passk import default_ks, pass_at_k_array

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95


def ks_for(n: int) -> list[int]:
    """Pass@k columns for n samples: the evaluation's k list (`passk.default_ks`) without k = 1, which is
    Avg@n: 2, 4, 8, ... below n, then n (the paper's k in {2..64} for n=64)."""

    return [k for k in default_ks(n) if k > 1]


def metric_names(ks: Sequence[int]) -> list[str]:
    """['avg', 'pass@2', ...]: 'avg' is Avg@n (mean correctness, the unbiased Pass@1)."""
    return ["avg"] + [f"pass@{k}" for k in ks]


def per_problem_values(correct: np.ndarray, ks: Sequence[int]) -> dict[str, np.ndarray]:
    """correct (P, n) 0/1 -> {'avg': (P,), 'pass@k': (P,)} per-problem values in [0, 1]."""

    correct = np.asarray(correct, dtype=float)
    if correct.ndim != 2:
        raise ValueError(f"correctness matrix must be 2-D (problems x samples), got shape {correct.shape}")
    n = correct.shape[1]
    c = correct.sum(axis=1).astype(np.int64)  # (P,)
    out = {"avg": correct.mean(axis=1)}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k_array(n, c, k)  # raises ValueError when k > n
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1; 0.0 for a single value) over seeds."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def t_interval(values: Sequence[float], level: float = CI_LEVEL) -> tuple[float, float]:
    """Student's t confidence interval of the mean of ``values`` (one per problem).

    (lo, hi) = mean -+ t_{(1+level)/2, P-1} * s / sqrt(P); a degenerate (mean, mean) when P < 2 or s = 0.
    """
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    v = np.asarray(values, dtype=float)
    m = float(v.mean())
    if v.size < 2:
        return m, m
    se = float(sps.sem(v))  # s / sqrt(P), ddof = 1
    if se == 0.0:
        return m, m
    lo, hi = sps.t.interval(level, v.size - 1, loc=m, scale=se)
    return float(lo), float(hi)


def combined_se(groups: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(se, df) of the unweighted mean over groups (benchmarks) of each group's mean over its problems.

    se^2 = sum_b s_b^2 / P_b / B^2; degrees of freedom by Welch-Satterthwaite,
    df = (sum_b v_b)^2 / sum_b v_b^2 / (P_b - 1) with v_b = s_b^2 / P_b (one group: s / sqrt(P), P - 1).
    (nan, nan) when a group has fewer than 2 values; (0.0, nan) when every group is constant.
    """
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    arrays = [np.asarray(g, dtype=float) for g in groups]
    if not arrays or any(a.size < 2 for a in arrays):
        return math.nan, math.nan
    v = np.array([sps.sem(a) ** 2 for a in arrays])
    if v.sum() == 0.0:
        return 0.0, math.nan
    df = v.sum() ** 2 / sum(vb**2 / (a.size - 1) for vb, a in zip(v, arrays) if vb > 0)
    return float(math.sqrt(v.sum()) / len(arrays)), float(df)


def combined_t_interval(groups: Sequence[Sequence[float]], level: float = CI_LEVEL) -> tuple[float, float]:
    """CI of the unweighted mean over groups (benchmarks) of each group's mean over its problems
    (`combined_se`: the benchmarks' standard errors, Welch-Satterthwaite df)."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    m = float(np.mean([np.asarray(g, dtype=float).mean() for g in groups]))
    se, df = combined_se(groups)
    if not se or not math.isfinite(se):
        return m, m
    lo, hi = sps.t.interval(level, df, loc=m, scale=se)
    return float(lo), float(hi)


ALPHA = 0.05  # the claims' significance level (two-sided)
POWER = 0.80  # the power at which the smallest detectable effect is stated


def mde(se: float, df: float, *, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest effect a two-sided test at level `alpha` detects with probability `power`:
    ``(t_{1-alpha/2, df} + t_{power, df}) * se`` (Bloom 1995; the t quantiles from `scipy.stats.t`).
    The exact effect for 80% noncentral-t power (scipy.stats.nct) is 5.1% larger at df = 2, 1.2% at
    df = 4, 0.1% at df = 9, equal to 0.01% at df = 127.
    nan when se or df is not finite (df nan with se 0: 0.0, nothing varies)."""
    if se == 0.0:
        return 0.0
    if not (math.isfinite(se) and math.isfinite(df)) or df <= 0:
        return math.nan
    return _t_sum(float(df), alpha, power) * se


@functools.lru_cache(maxsize=4096)
def _t_sum(df: float, alpha: float, power: float) -> float:
    """t_{1-alpha/2, df} + t_{power, df} (scipy.stats.t), cached: `seeds_needed` bisects over df."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    return float(sps.t.ppf(1 - alpha / 2, df) + sps.t.ppf(power, df))


def seeds_needed(sd: float, effect: float, *, start: int = 2, limit: int = 10_000) -> int | None:
    """The fewest paired seeds n (>= start) whose design detects `effect` at 80% power:
    ``mde(sd / sqrt(n), n - 1) <= |effect|``; None when no n up to `limit` does (or effect is 0)."""
    if not (math.isfinite(sd) and math.isfinite(effect)) or effect == 0.0:
        return None
    detects = lambda n: mde(sd / math.sqrt(n), n - 1) <= abs(effect)  # noqa: E731 - monotone in n
    lo, hi = max(start, 2), limit
    if not detects(hi):
        return None
    while lo < hi:  # bisection: the first n that detects
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if detects(mid) else (mid + 1, hi)
    return lo


def _bootstrap(samples, statistic, *, resamples: int, seed: int, level: float = CI_LEVEL):
    """`scipy.stats.bootstrap` of a vectorized ``statistic(*samples, axis=-1)``, each sample resampled on
    its own (percentile method, ``numpy.random.default_rng(seed)``). A constant or degenerate resample
    warns about its interval; the distribution and the percentile interval are still right."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sps.bootstrap(
            tuple(samples),
            statistic,
            n_resamples=resamples,
            method="percentile",
            vectorized=True,
            confidence_level=level,
            rng=np.random.default_rng(seed),
        )


def paired_bootstrap_p(
    diffs_by_group: Sequence[Sequence[float]], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> float:
    """Two-sided paired-bootstrap p-value that the mean difference is zero.

    ``diffs_by_group``: per benchmark, the per-problem differences (method - baseline), paired by
    problem id and averaged over seeds. The statistic is the unweighted mean over groups of each
    group's mean difference (one group: the plain mean). `scipy.stats.bootstrap` resamples the
    problems of each group with replacement, ``resamples`` times, from ``np.random.default_rng(seed)``;
    the p-value is ``(1 + #{|d*_b - d| >= |d|}) / (resamples + 1)`` over its bootstrap distribution
    (null-centred bootstrap; 1.0 when d == 0). A group of one problem resamples to itself.
    """

    groups = [np.asarray(g, dtype=float) for g in diffs_by_group]
    if not groups or any(g.size == 0 for g in groups):
        return math.nan
    observed = float(np.mean([g.mean() for g in groups]))
    varying = [g for g in groups if g.size > 1]  # scipy needs two observations; one resamples to itself
    fixed = sum(float(g.mean()) for g in groups if g.size == 1)
    if varying:

        def statistic(*samples, axis=-1):
            return sum(x.mean(axis=axis) for x in samples)

        res = _bootstrap(varying, statistic, resamples=resamples, seed=seed)
        boot = (res.bootstrap_distribution + fixed) / len(groups)
    else:
        boot = np.full(resamples, observed)
    extreme = np.abs(boot - observed) >= abs(observed) - 1e-12
    return float((1 + extreme.sum()) / (resamples + 1))


def gain_percent(method: float, baseline: float) -> float | None:
    """The paper's Gain: (m - b) / b * 100; None (printed blank) when b == 0 or either is missing."""
    if baseline is None or method is None or not math.isfinite(baseline) or not math.isfinite(method):
        return None
    if baseline == 0:
        return None
    return (method - baseline) / baseline * 100.0


# ---- the seed as the unit -------------------------------------------------------------------------


def seed_test(diffs: Sequence[float], *, level: float = CI_LEVEL) -> dict:
    """A paired t over seeds: ``diffs`` one difference per seed (method - baseline, paired by seed).

    {"estimate", "ci": [lo, hi], "p", "df", "n", "sd"}: the mean difference, Student's t interval over the
    seeds' differences, the two-sided p of `scipy.stats.ttest_1samp` against 0 (= `ttest_rel` on the
    pairs), the differences' sample sd (what `seeds_needed` reads). Fewer than 2 seeds: ci, p and sd nan. Every difference equal: the interval is that value and p
    is 0.0 (1.0 when it is 0): nothing varies.
    """
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    d = np.asarray(diffs, dtype=float)
    out = {"estimate": float(d.mean()) if d.size else math.nan, "ci": [math.nan, math.nan], "p": math.nan}
    out.update({"df": float(d.size - 1), "n": int(d.size), "sd": float(d.std(ddof=1)) if d.size > 1 else math.nan})
    if d.size < 2:
        return out
    if np.allclose(d, d[0]):
        out["ci"], out["p"] = [float(d[0])] * 2, 0.0 if d[0] != 0 else 1.0
        return out
    res = sps.ttest_1samp(d, 0.0)
    ci = res.confidence_interval(level)
    out["ci"], out["p"] = [float(ci.low), float(ci.high)], float(res.pvalue)
    return out


def holm(pvalues: Sequence[float], *, alpha: float = ALPHA) -> list[float]:
    """Holm-adjusted p-values (`statsmodels.stats.multitest.multipletests`, method 'holm') of a family;
    a nan p (no test) stays nan and is not counted in the family."""
    from statsmodels.stats.multitest import multipletests  # noqa: PLC0415 - statsmodels is heavy

    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, math.nan)
    ok = np.isfinite(p)
    if ok.any():
        # statsmodels' holm branch calls gc.collect(), about a second on a report's heap: the objects
        # that exist now are frozen (skipped by the collector) for the call, then thawed
        gc.freeze()
        try:
            out[ok] = multipletests(p[ok], alpha=alpha, method="holm")[1]
        finally:
            gc.unfreeze()
    return [float(x) for x in out]


def _one_sided(d: np.ndarray, null: float, alternative: str) -> float:
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    if d.size < 2:
        return math.nan
    if np.allclose(d, d[0]):  # no spread: the sign of d - null decides
        x = d[0] - null
        return 0.0 if (x > 0 if alternative == "greater" else x < 0) else 1.0
    return float(sps.ttest_1samp(d, null, alternative=alternative).pvalue)


def noninferiority(diffs: Sequence[float], margin: float) -> dict:
    """Non-inferiority of a paired difference against the margin ``margin`` (> 0, the figure's unit).

    {"p": two-sided p of the paired t against -margin, "p_noninferior": one-sided p of H0 d <= -margin,
    "p_inferior": one-sided p of H0 d >= -margin}. The 95% interval's lower end lies above -margin
    exactly when p < 0.05 with the estimate above -margin (each one-sided test at 0.025): the
    interval-against-the-margin reading of the non-inferiority test (CONSORT; Walker & Nowacki 2011).
    """
    d = np.asarray(diffs, dtype=float)
    hi, lo = _one_sided(d, -margin, "greater"), _one_sided(d, -margin, "less")
    p = min(1.0, 2 * min(hi, lo)) if math.isfinite(hi) and math.isfinite(lo) else math.nan
    return {"p": p, "p_noninferior": hi, "p_inferior": lo}


def tost(diffs: Sequence[float], margin: float) -> dict:
    """Equivalence within +-``margin`` by two one-sided paired t tests (TOST, Schuirmann 1987):
    {"p": max of the two one-sided p's (equivalent when < alpha), "p_lower": H0 d <= -margin,
    "p_upper": H0 d >= +margin}; the same as the (1 - 2 alpha) t interval lying inside +-margin."""
    d = np.asarray(diffs, dtype=float)
    lo, hi = _one_sided(d, -margin, "greater"), _one_sided(d, margin, "less")
    return {"p": max(lo, hi) if math.isfinite(lo) and math.isfinite(hi) else math.nan, "p_lower": lo, "p_upper": hi}


# ---- rliable's aggregates ------------------------------------------------------------------------


def stratified_interval(samples: Sequence[Sequence[float]], statistic, *, level: float = CI_LEVEL, seed: int = 0):
    """(lo, hi) percentile interval of ``statistic(*samples, axis=-1)`` by the stratified bootstrap: each
    sample (one task's runs, or one arm's) resampled with replacement on its own (`scipy.stats.bootstrap`,
    vectorized: `statistic` takes a batch of resamples along the leading axes, BOOTSTRAP_RESAMPLES
    resamples, ``numpy.random.default_rng(seed)``); (nan, nan) when a sample has fewer than 2 values."""

    arrays = [np.asarray(a, dtype=float) for a in samples]
    if any(a.size < 2 for a in arrays):
        return math.nan, math.nan
    res = _bootstrap(arrays, statistic, resamples=BOOTSTRAP_RESAMPLES, seed=seed, level=level)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def iqm(scores: Sequence[float]) -> float:
    """Interquartile mean of run scores (`rliable.metrics.aggregate_iqm`: the mean of the middle 50%)."""
    from rliable import metrics  # noqa: PLC0415 - rliable is an optional-weight dependency

    return float(metrics.aggregate_iqm(np.asarray(scores, dtype=float).reshape(-1, 1)))


def probability_of_improvement(x: Sequence[float], y: Sequence[float]) -> float:
    """P(X > Y) + P(X = Y) / 2 over the runs of two arms on one task (the Mann-Whitney U statistic over
    |X| |Y|; `rliable.metrics.probability_of_improvement`)."""
    from rliable import metrics  # noqa: PLC0415 - rliable is an optional-weight dependency

    return float(
        metrics.probability_of_improvement(
            np.asarray(x, dtype=float).reshape(-1, 1), np.asarray(y, dtype=float).reshape(-1, 1)
        )
    )


def iqm_batched(*tasks: np.ndarray, axis: int = -1) -> np.ndarray:
    """The IQM of the run x task scores pooled, for a batch of resamples (`scipy.stats.trim_mean`, 25%
    cut each side: what rliable.metrics.aggregate_iqm computes, over the last axis)."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    return sps.trim_mean(np.concatenate(tasks, axis=-1), 0.25, axis=-1)


def poi_batched(*xs: np.ndarray, axis: int = -1) -> np.ndarray:
    """The probability of improvement for a batch of resamples: xs the first arm's tasks, then the
    second's (as many); per task P(X > Y) + P(X = Y) / 2 over all pairs, averaged over tasks (what
    rliable.metrics.probability_of_improvement computes through the Mann-Whitney U statistic)."""
    k = len(xs) // 2
    per_task = [
        ((x[..., :, None] > y[..., None, :]) + 0.5 * (x[..., :, None] == y[..., None, :])).mean(axis=(-2, -1))
        for x, y in zip(xs[:k], xs[k:])
    ]
    return np.mean(per_task, axis=0)


def performance_profile(scores: Sequence[float], taus: Sequence[float]) -> list[float]:
    """rliable's run-score distribution: the fraction of runs whose score exceeds each tau
    (rliable.library.create_performance_profile; computed here with numpy because rliable.library
    imports `arch`, which does not import under pandas 3)."""
    s = np.asarray(scores, dtype=float)
    return [float((s > t).mean()) for t in taus]
