"""The statistics behind the report: functions over per-problem values (numpy, scipy.stats).

The problem is the unit of evaluation (docs/objectives.md, "Evaluation metrics"):

- per problem, Avg@n is its mean correctness over n samples and Pass@k the unbiased estimator
  ``1 - C(n-c, k) / C(n, k)`` (``clipbench.eval.passk``); seeds of one method are averaged per
  problem first;
- a 95% confidence interval over problems is Student's t interval of the mean of those per-problem
  values (``t_interval``, `scipy.stats.t`); the Average over benchmarks combines the benchmarks'
  standard errors with Welch-Satterthwaite degrees of freedom (``combined_t_interval``);
- a method is compared with the baseline by a paired bootstrap over problems (paired by problem
  id): resample problems with replacement, recompute the mean difference, and report the two-sided
  p-value of the null-centred bootstrap, ``(1 + #{|d*_b - d| >= |d|}) / (B + 1)``
  (``paired_bootstrap_p``). The resamples are `scipy.stats.bootstrap`'s bootstrap distribution;
  benchmarks are resampled separately (stratified: one sample per benchmark) for the Average.

scipy.stats is imported when a statistic is computed (about a second), not when the report
package is imported.
"""

from __future__ import annotations

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
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    if se == 0.0:
        return 0.0
    if not (math.isfinite(se) and math.isfinite(df)) or df <= 0:
        return math.nan
    return float((sps.t.ppf(1 - alpha / 2, df) + sps.t.ppf(power, df)) * se)


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

    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    groups = [np.asarray(g, dtype=float) for g in diffs_by_group]
    if not groups or any(g.size == 0 for g in groups):
        return math.nan
    observed = float(np.mean([g.mean() for g in groups]))
    varying = [g for g in groups if g.size > 1]  # scipy needs two observations; one resamples to itself
    fixed = sum(float(g.mean()) for g in groups if g.size == 1)
    if varying:

        def statistic(*samples, axis=-1):
            return sum(x.mean(axis=axis) for x in samples)

        with warnings.catch_warnings():  # a constant sample makes the (unused) interval degenerate
            warnings.simplefilter("ignore")
            res = sps.bootstrap(
                tuple(varying),
                statistic,
                n_resamples=resamples,
                method="percentile",
                vectorized=True,
                rng=np.random.default_rng(seed),
            )
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
