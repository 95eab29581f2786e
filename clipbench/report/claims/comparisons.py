"""How two arms are compared on an endpoint: the paired tests behind every claim, and what two arms
must share to be compared (`setting`, `comparable`).

- Training figures (entropy, quadrant shares) are one number per run. Arms are paired by seed (the
  same seed draws the same prompts and the same initial samples for both); the interval is Student's
  t over the per-seed differences, the test a paired t-test (`scipy.stats.ttest_rel`; for one arm,
  `ttest_1samp`): `seed_test`.
- Accuracy (Avg@n at the last evaluation, `accuracy_claim`): with at least `SEED_TEST_MIN` (2) paired
  seeds, one number per run as for the training figures: each seed's Avg@n (the mean over its
  problems; benchmarks averaged) paired by seed, Student's t interval over the per-seed differences
  and a paired t-test. Another seed trains another model, so this is the test of whether a rerun with
  other seeds would agree (and the split halves use the same test). With one seed the seed noise
  cannot be estimated: the difference is paired by problem, the interval Student's t over problems and
  the p-value the paired bootstrap over problems (`stats.paired_bootstrap_p`). That test shows
  within-seed noise only: it speaks for the trained model at hand, not for another seed, and the row
  says so.
- Each result carries its design: the standard error, the smallest effect detectable at 80% power,
  and for an inconclusive one the seeds (or the multiple of the problems) that would detect it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from clipbench.config.stored import recorded
from clipbench.report import stats
from clipbench.report.analysis import _paired_diffs, block_benchmarks, block_n, seed_values
from clipbench.report.claims.endpoints import Q4_LEAD, avg_col, per_seed, q4_lead
from clipbench.report.claims.verdicts import DIFFERENCE, EQUIVALENCE, NONINFERIORITY, ClaimResult, decide, verdict
from clipbench.report.load import RunRecord, arm_setting
from clipbench.tracking.provenance import describe_machine

SEED_TEST_MIN = 2  # paired seeds from which accuracy is tested over seeds (one seed: over problems)


def setting(runs: Sequence[RunRecord]) -> tuple:
    """What two arms must share to be compared: the learning rate (and its schedule) and the routing
    replay."""
    first = runs[0].config
    return (recorded(first, "train.lr"), recorded(first, "train.lr_schedule"), replay(runs))


def comparable(a: Sequence[RunRecord], b: Sequence[RunRecord]) -> bool:
    """Whether two arms may be compared: the same setting (`setting`) and every other key that can
    change what a run computes (an evaluation setting included) equal (`load.arm_setting`)."""
    return setting(a) == setting(b) and arm_setting(a[0]) == arm_setting(b[0])


def replay(runs: Sequence[RunRecord]) -> str:
    return recorded(runs[0].config, "model.routing_replay") or "none"


def blocks(compared: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    """The runs by base model: the claims compare arms within one block."""
    out: dict[str, list[RunRecord]] = {}
    for r in compared:
        out.setdefault(r.model, []).append(r)
    return out


def params(r: RunRecord) -> dict:
    return r.objective.params if r.objective else {}


def _t_ci(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=float)
    if v.size < 2:
        return (math.nan, math.nan)
    return stats.t_interval(v)


def paired_seeds(a: dict[int, float], b: dict[int, float]) -> np.ndarray:
    return np.array([a[s] - b[s] for s in sorted(set(a) & set(b))])


def _ttest_rel_p(diffs: np.ndarray) -> float:
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    if diffs.size < 2 or np.allclose(diffs, diffs[0]):
        return 0.0 if diffs.size >= 2 and diffs[0] != 0 else (1.0 if diffs.size >= 2 else math.nan)
    return float(sps.ttest_1samp(diffs, 0.0).pvalue)  # = ttest_rel on the pairs


def _checksums(runs: Sequence[RunRecord]) -> list:
    return sorted({c for r in runs for c in r.checksums}, key=lambda c: c or "")


def _machines(runs: Sequence[RunRecord]) -> list[str]:
    """The machines a claim's runs ran on (`describe_machine` of each start; unrecorded ones left out)."""
    return sorted({describe_machine(s) for r in runs for s in (r.provenance or []) if s})


def _seed_design(res: ClaimResult, diffs: np.ndarray) -> ClaimResult:
    """se, df, mde of a paired t over seed differences; the seeds an inconclusive one would need."""
    if diffs.size >= 2:
        sd = float(diffs.std(ddof=1))
        res.se, res.df = sd / math.sqrt(diffs.size), float(diffs.size - 1)
        res.mde = stats.mde(res.se, res.df)
        n = stats.seeds_needed(sd, res.estimate, start=diffs.size) if res.verdict.startswith("inconclusive") else None
        res.needed = None if n is None else {"unit": "seeds", "n": n, "factor": n / diffs.size}
    return res


def _problem_design(res: ClaimResult, diffs: Sequence[np.ndarray]) -> ClaimResult:
    """se, df, mde of the mean per-problem difference (benchmarks combined); the multiple of the
    problems an inconclusive one would need, (mde / |estimate|)^2 (se shrinks as 1 / sqrt(problems))."""
    res.se, res.df = stats.combined_se([100.0 * d for d in diffs])
    res.mde = stats.mde(res.se, res.df)
    if res.verdict.startswith("inconclusive") and res.estimate and math.isfinite(res.mde) and res.mde > 0:
        factor = (res.mde / abs(res.estimate)) ** 2
        res.needed = {"unit": "problems", "n": math.ceil(factor * res.n), "factor": factor}
    return res


def seed_test(
    claim: str,
    source: str,
    label: str,
    figure: str,
    diffs,
    seeds: list,
    runs,
    kind: str = DIFFERENCE,
    margin: float | None = None,
) -> ClaimResult:
    """A claim tested by a paired t over the seeds' differences `diffs` (one per seed in `seeds`):
    against 0 (difference), -margin (non-inferiority, two-sided: the 95% interval's lower end against
    -margin) or +-margin (equivalence, TOST)."""
    est, p = float(diffs.mean()), _ttest_rel_p(diffs)
    p_outside = math.nan
    if kind == NONINFERIORITY:
        p = stats.noninferiority(diffs, margin)["p"] if diffs.size >= 2 else math.nan
    elif kind == EQUIVALENCE:
        p = stats.tost(diffs, margin)["p"] if diffs.size >= 2 else math.nan
        p_outside = stats.noninferiority(diffs if est < 0 else -diffs, margin)["p"] if diffs.size >= 2 else math.nan
    res = ClaimResult(
        claim,
        source,
        label,
        figure,
        est,
        _t_ci(diffs),
        p,
        "paired t, seeds" if kind == DIFFERENCE else f"paired t, seeds; {kind}, margin {margin:g}",
        int(diffs.size),
        "",
        seeds=seeds,
        checksums=_checksums(runs),
        kind=kind,
        margin=margin,
        p_outside=p_outside,
        machines=_machines(runs),
    )
    res.verdict = decide(res, p)
    return _seed_design(res, diffs)


def seed_claim(
    claim: str,
    source: str,
    a_label: str,
    a: Sequence[RunRecord],
    b_label: str,
    b: Sequence[RunRecord],
    figure: str,
    value,
    column: str,
) -> ClaimResult | None:
    """A training figure (one `value` per run) of arm a against arm b, paired by seed."""
    va, vb = per_seed(a, value), per_seed(b, value)
    diffs = paired_seeds(va, vb)
    if diffs.size == 0:
        return None
    res = seed_test(claim, source, f"{a_label} - {b_label}", figure, diffs, sorted(set(va) & set(vb)), [*a, *b])
    res.reads = [[a_label, [column], 1], [b_label, [column], -1]]
    return res


def _seed_accuracy(blocks: Sequence[tuple], runs: Sequence[RunRecord], metric: str) -> dict[int, float]:
    """{seed: Avg@n in points} from seed_values' blocks (one per benchmark): each run's mean over its
    problems, benchmarks averaged (a seed missing a benchmark is left out)."""
    seed_of = {r.run_id: r.seed for r in runs}
    per: dict[int, list[float]] = {}
    for _, values, run_ids in blocks:
        for rid, v in zip(run_ids, values[metric].mean(axis=1)):
            per.setdefault(seed_of[rid], []).append(100.0 * float(v))
    return {s: float(np.mean(v)) for s, v in per.items() if len(v) == len(blocks)}


def _avg_n(runs: Sequence[RunRecord], benches: Sequence[str]) -> tuple[str, str]:
    """(the Avg@n metric's name for the runs' samples per problem, the claims' figure text)."""
    n = block_n(runs, benches)
    return stats.metric_names(stats.ks_for(n))[0], f"Avg@{n}, last eval (pts, {', '.join(benches)})"


def seed_avg(runs: Sequence[RunRecord], benches: Sequence[str]) -> tuple[dict[int, float], str]:
    """({seed: Avg@n at the last evaluation, points, benchmarks averaged}, the figure's text)."""
    metric, figure = _avg_n(runs, benches)
    blocks = [g for g in (seed_values(runs, bench, [1]) for bench in benches) if g is not None]
    return _seed_accuracy(blocks, runs, metric), figure


def accuracy_claim(
    claim: str,
    source: str,
    a_label: str,
    a: Sequence[RunRecord],
    b_label: str,
    b: Sequence[RunRecord],
    *,
    b_initial: bool = False,
    kind: str = DIFFERENCE,
    margin: float | None = None,
) -> ClaimResult | None:
    """Avg@n at the last evaluation of arm a against arm b, over the benchmarks both have. ``b_initial``:
    compare with b's step-0 evaluation (the base model) instead of its last; ``kind`` and ``margin``:
    a non-inferiority or equivalence claim (points)."""
    a = [r for r in a if r.final_step is not None]
    b = [r for r in b if r.final_step is not None]
    benches = [x for x in block_benchmarks([*a, *b]) if x in block_benchmarks(a) and x in block_benchmarks(b)]
    if not benches:
        return None
    metric, figure = _avg_n([*a, *b], benches)
    blocks = [
        (ga, gb)
        for ga, gb in ((seed_values(a, bench, [1]), seed_values(b, bench, [1], initial=b_initial)) for bench in benches)
        if ga is not None and gb is not None
    ]
    if not blocks:
        return None
    va = _seed_accuracy([ga for ga, _ in blocks], a, metric)
    vb = _seed_accuracy([gb for _, gb in blocks], b, metric)
    if len(set(va) & set(vb)) >= SEED_TEST_MIN:
        res = seed_test(
            claim,
            source,
            f"{a_label} - {b_label}",
            figure,
            paired_seeds(va, vb),
            sorted(set(va) & set(vb)),
            [*a, *b],
            kind,
            margin,
        )
        res.reads = [
            [a[0].label, [avg_col(x) for x in benches], 1],
            [b[0].label, [avg_col(x, start=b_initial) for x in benches], -1],
        ]
        return res
    return _problem_claim(claim, source, f"{a_label} - {b_label}", figure, blocks, metric, a, b, kind, margin)


def _problem_claim(claim, source, label, figure, blocks, metric, a, b, kind, margin) -> ClaimResult | None:
    """One seed: the difference paired by problem, the paired bootstrap over problems."""
    diffs = [_paired_diffs(ga[0], ga[1][metric], gb[0], gb[1][metric]) for ga, gb in blocks]
    if all(d.size == 0 for d in diffs):
        return None
    allv = 100.0 * np.concatenate(diffs)
    est = float(np.mean([100.0 * d.mean() for d in diffs]))
    p_outside, shift = math.nan, (margin or 0.0) / 100.0
    if kind == NONINFERIORITY:  # the differences against -margin
        p = stats.paired_bootstrap_p([d + shift for d in diffs])
    elif kind == EQUIVALENCE:  # TOST by the bootstrap's one-sided halves: the larger of the two
        p = max(
            stats.paired_bootstrap_p([d + shift for d in diffs]), stats.paired_bootstrap_p([d - shift for d in diffs])
        )
        p_outside = stats.paired_bootstrap_p([d + (shift if est < 0 else -shift) for d in diffs])
    else:
        p = stats.paired_bootstrap_p(diffs)
    test = "paired bootstrap, problems (within-seed noise only)"
    res = ClaimResult(
        claim,
        source,
        label,
        figure,
        est,
        _t_ci(allv),
        p,
        test if kind == DIFFERENCE else f"{test}; {kind}, margin {margin:g}",
        int(allv.size),
        "",
        seeds=sorted({r.seed for r in a} & {r.seed for r in b}),
        checksums=_checksums([*a, *b]),
        kind=kind,
        margin=margin,
        p_outside=p_outside,
        machines=_machines([*a, *b]),
    )
    res.verdict = decide(res, p)
    return _problem_design(res, diffs)


def q4_claim(claim: str, source: str, label: str, runs: Sequence[RunRecord]) -> ClaimResult | None:
    """Q4's lead over the next largest quadrant, per seed; a one-sample t over the seeds."""
    leads = per_seed(runs, q4_lead)
    lead = np.array([leads[s] for s in sorted(leads)])
    if not lead.size:
        return None
    est, p = float(lead.mean()), _ttest_rel_p(lead)
    res = ClaimResult(
        claim,
        source,
        f"{label}: Q4 - next largest quadrant",
        Q4_LEAD.figure(runs, ""),
        est,
        _t_ci(lead),
        p,
        "paired t, seeds",
        int(lead.size),
        verdict(est, p),
        seeds=sorted(leads),
        checksums=_checksums(runs),
        machines=_machines(runs),
        reads=[[label, [Q4_LEAD.column], 1]],
    )
    return _seed_design(res, lead)
