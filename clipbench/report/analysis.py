"""Numbers of a report, computed from a loaded sweep: plain dicts (JSON-able), no formatting.

    analyze(sweep, baseline=None) -> dict
      {"sweep", "baseline", "runs": {...counts, "excluded": [{run_id, label, seed, state, reason}]},
       "health": {run_id: {label, seed, state, steps_done, steps, skipped, skipped_frac, flags}},
       "identical": {block: [[label, label, ...]]}, "notes": [what the readers skipped],
       "blocks": [{"model", "n", "ks", "metrics", "labels": {label: {"method", "seeds", "run_ids", "final_steps"}},
                   "benchmarks": {bench: {"problems", "n", "rows": {label: MetricRow}, "base": MetricRow|None}},
                   "average": {"rows": {label: MetricRow}, "base": MetricRow|None},
                   "gain": {label: {bench|"average": {metric: percent|None}}}}],
       "quadrants": {block: {label: {...shares...}}},
       "dynamics": {block: {label: {...entropy, accuracy, off-policy out-of-band share...}}},
       "routing": {block: {label: {...moved tokens, agreement, load, clip split...}}} (routing.py: MoE runs),
       "stability": {block: {"rates", "rules": {rule: {"method", "cells": {lr: {...}}, "critical"}}}} or None
                    (stability.py: only for a learning-rate axis),
       "claims": [...] added by report.commands.build_report (claims.py builds on these figures)}
    MetricRow = {"seeds", "problems", "metrics": {metric: {"mean", "std", "ci": [lo, hi], "p", "per_seed"}}}

Values are fractions in [0, 1] (the renderers print percent). See ``stats`` for the statistics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from clipbench.report import health, stats
from clipbench.report.correction import label_correction
from clipbench.report.load import RunRecord, Sweep, resolve_baseline
from clipbench.report.routing import label_routing
from clipbench.report.stability import stability

QUADRANTS = ("q1", "q2", "q3", "q4")
CELLS = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
BASE_LABEL = "base (step 0)"


# ---- per-benchmark evaluation values ----------------------------------------------------------


def _payload_at(run: RunRecord, bench: str, step: int | None) -> dict | None:
    if step is None:
        return None
    return run.evals.get(step, {}).get(bench)


def _initial_step(run: RunRecord) -> int | None:
    """The step-0 evaluation of a run (the base model), when it was evaluated before training."""
    if not run.evals:
        return None
    first = min(run.evals)
    return first if first == 0 and first != run.final_step else None


def seed_values(runs: Sequence[RunRecord], bench: str, ks: Sequence[int], *, initial: bool = False):
    """Per-problem values of each run (seed) on one benchmark, aligned by problem id.

    Returns (problem_ids, {metric: (S, P) array}, run_ids) over the problems every run evaluated,
    or None when no run has the benchmark. ``initial`` takes the step-0 evaluation instead of the
    final (largest) step.
    """
    payloads = []
    for r in runs:
        p = _payload_at(r, bench, _initial_step(r) if initial else r.final_step)
        if p is not None:
            payloads.append((r, p))
    if not payloads:
        return None
    common = [str(i) for i in payloads[0][1]["problem_ids"]]
    shared = set(common)
    for _, p in payloads[1:]:
        shared &= {str(i) for i in p["problem_ids"]}
    ids = [i for i in common if i in shared]
    values: dict[str, list[np.ndarray]] = {m: [] for m in stats.metric_names(ks)}
    for _, p in payloads:
        index = {str(pid): j for j, pid in enumerate(p["problem_ids"])}
        correct = np.asarray(p["correct"], dtype=float)[[index[i] for i in ids]]  # (P, n)
        for m, v in stats.per_problem_values(correct, ks).items():
            values[m].append(v)
    return ids, {m: np.stack(v) for m, v in values.items()}, [r.run_id for r, _ in payloads]


def metric_row(values: Mapping[str, np.ndarray], problems: int, seeds: Sequence[int] | None = None) -> dict:
    """{metric: mean +- std over seeds, t CI over problems (seeds averaged per problem: within-seed
    sampling noise only)}; ``seeds``: the seed of each row of the values (``seed_ids``, for pairing)."""
    out = {}
    for m, v in values.items():  # v: (S, P)
        per_seed = v.mean(axis=1)
        mean, std = stats.mean_std(per_seed)
        out[m] = {
            "mean": mean,
            "std": std,
            "ci": list(stats.t_interval(v.mean(axis=0))),
            "p": None,
            "per_seed": per_seed.tolist(),
        }
    n_seeds = int(next(iter(values.values())).shape[0]) if values else 0
    row = {"seeds": n_seeds, "problems": problems, "metrics": out}
    if seeds is not None:
        row["seed_ids"] = [int(x) for x in seeds]
    return row


def _paired_diffs(a_ids, a_vals: np.ndarray, b_ids, b_vals: np.ndarray) -> np.ndarray:
    """Per-problem differences (seed-averaged a - seed-averaged b) over the problems both have."""
    a = dict(zip(a_ids, a_vals.mean(axis=0)))
    b = dict(zip(b_ids, b_vals.mean(axis=0)))
    shared = sorted(i for i in a if i in b)  # a canonical order: the bootstrap draw is order-free
    return np.array([a[i] - b[i] for i in shared])


# ---- one block (one base model) ---------------------------------------------------------------


def block_n(runs: Sequence[RunRecord], benches: Sequence[str]) -> int:
    """Samples per problem: the smallest n among the final evaluations (Pass@k needs k <= n)."""
    ns = [
        int(r.evals[r.final_step][b]["n"])
        for r in runs
        if r.final_step is not None
        for b in benches
        if b in r.evals[r.final_step]
    ]
    return min(ns) if ns else 0


def block_benchmarks(runs: Sequence[RunRecord]) -> list[str]:
    out: dict[str, None] = {}
    for r in runs:
        if r.final_step is not None:
            out.update(dict.fromkeys(sorted(r.evals[r.final_step])))
    return list(out)


def analyze_block(
    model: str,
    runs: Sequence[RunRecord],
    labels: Sequence[str],
    baseline: str | None,
    *,
    resamples: int = stats.BOOTSTRAP_RESAMPLES,
    seed: int = stats.BOOTSTRAP_SEED,
    tasks: Sequence[str] | None = None,
) -> dict:
    """One base model's tables. `tasks`: the benchmarks the aggregates read (default: all of them; a
    preregistered family's benchmark, so that a split the tuning read is no task)."""
    evaluated = [r for r in runs if r.final_step is not None]
    benches = block_benchmarks(evaluated)
    n = block_n(evaluated, benches)
    ks = stats.ks_for(n)
    metrics = stats.metric_names(ks)
    by_label = {lb: [r for r in evaluated if r.label == lb] for lb in labels}
    by_label = {lb: rs for lb, rs in by_label.items() if rs}
    base_runs = by_label.get(baseline) or (next(iter(by_label.values())) if by_label else [])

    block: dict = {
        "model": model,
        "n": n,
        "ks": ks,
        "metrics": metrics,
        "benchmarks": {},
        "gain": {},
        "labels": {
            lb: {
                "method": rs[0].method,
                "seeds": sorted(r.seed for r in rs),
                "run_ids": [r.run_id for r in rs],
                "final_steps": sorted({r.final_step for r in rs}),
            }
            for lb, rs in by_label.items()
        },
    }
    raw: dict[str, dict[str, tuple]] = {}  # bench -> label -> (ids, values)
    for bench in benches:
        entry = {"rows": {}, "base": None, "problems": 0, "n": n}
        raw[bench] = {}
        for lb, rs in by_label.items():
            got = seed_values(rs, bench, ks)
            if got is None:
                continue
            ids, values, run_ids = got
            seed_of = {r.run_id: r.seed for r in rs}
            raw[bench][lb] = (ids, values, [seed_of[rid] for rid in run_ids])
            entry["rows"][lb] = metric_row(values, len(ids), raw[bench][lb][2])
            entry["problems"] = max(entry["problems"], len(ids))
        got = seed_values(base_runs, bench, ks, initial=True)
        if got is not None:
            seed_of = {r.run_id: r.seed for r in base_runs}
            entry["base"] = metric_row(got[1], len(got[0]), [seed_of[rid] for rid in got[2]])
            raw[bench][BASE_LABEL] = (got[0], got[1], entry["base"]["seed_ids"])
        block["benchmarks"][bench] = entry

    block["average"] = _average(raw, by_label, metrics, benches)
    if baseline in by_label:
        _compare(block, raw, baseline, metrics, benches, resamples=resamples, seed=seed)
    on = [b for b in benches if tasks is None or b in tasks]
    block["aggregates"] = aggregates(raw, list(by_label), baseline, on, seed=seed)
    block["aggregate_tasks"] = on
    return block


PROFILE_TAUS = [i / 20 for i in range(21)]  # the performance profile's thresholds (Avg@n, 0 to 1)


def aggregates(raw, labels: Sequence[str], baseline: str | None, benches: Sequence[str], *, seed: int) -> dict:
    """rliable's aggregates of each label's runs (Agarwal et al., 2021), one score per run and benchmark
    (its final Avg@n; the benchmarks are rliable's tasks): the interquartile mean over all runs x tasks
    and, against the baseline, the probability of improvement (the mean over tasks of P(X > Y) + P(X =
    Y) / 2), each with a 95% stratified bootstrap interval (the runs of each task resampled on their
    own, `stats.stratified_interval`); the performance profile, the share of run x task scores above
    each of PROFILE_TAUS; and the share above the base model's mean."""
    have = [b for b in benches if all(lb in raw[b] for lb in labels)]
    if not have or not labels:
        return {}
    scores = {lb: [raw[b][lb][1]["avg"].mean(axis=1) for b in have] for lb in labels}  # per task: (S,)
    base = [raw[b][BASE_LABEL][1]["avg"].mean() for b in have if BASE_LABEL in raw[b]]
    out = {}
    for lb in labels:
        cols = scores[lb]
        entry = {
            "runs": int(sum(c.size for c in cols)),
            "tasks": len(cols),
            "iqm": stats.iqm(np.concatenate(cols)),
            "iqm_ci": list(stats.stratified_interval(cols, stats.iqm_batched, seed=seed)),
            "profile": stats.performance_profile(np.concatenate(cols), PROFILE_TAUS),
            "scores": [float(x) for x in np.concatenate(cols)],  # every run x task score: the profile's figure
            "above_base": float(np.mean(np.concatenate(cols) > np.mean(base))) if len(base) == len(have) else None,
        }
        if baseline in scores and lb != baseline:
            base_cols = scores[baseline]
            entry["poi"] = float(np.mean([stats.probability_of_improvement(x, y) for x, y in zip(cols, base_cols)]))
            entry["poi_ci"] = list(stats.stratified_interval([*cols, *base_cols], stats.poi_batched, seed=seed))
        out[lb] = entry
    return out


def _average(raw, by_label, metrics, benches) -> dict:
    """The Average block: unweighted mean over benchmarks (the paper's Average rows)."""
    out = {"rows": {}, "base": None, "benchmarks": list(benches)}
    for lb in list(by_label) + [BASE_LABEL]:
        have = [b for b in benches if lb in raw[b]]
        if len(have) != len(benches) or not benches:
            continue
        row = {
            "seeds": min(raw[b][lb][1][metrics[0]].shape[0] for b in benches),
            "problems": sum(len(raw[b][lb][0]) for b in benches),
            "metrics": {},
        }
        s = min(raw[b][lb][1][metrics[0]].shape[0] for b in benches)
        row["seed_ids"] = list(raw[benches[0]][lb][2][:s])
        for m in metrics:
            per_seed = _average_per_seed([raw[b][lb][1][m] for b in benches])
            mean, std = stats.mean_std(per_seed)
            mean = float(np.mean([raw[b][lb][1][m].mean(axis=0).mean() for b in benches]))
            ci = stats.combined_t_interval([raw[b][lb][1][m].mean(axis=0) for b in benches])
            row["metrics"][m] = {"mean": mean, "std": std, "ci": list(ci), "p": None, "per_seed": per_seed}
        if lb == BASE_LABEL:
            out["base"] = row
        else:
            out["rows"][lb] = row
    return out


def _average_per_seed(arrays: Sequence[np.ndarray]) -> list[float]:
    """Per seed (the i-th run of each benchmark), the mean over benchmarks; seeds all benchmarks share."""
    s = min(a.shape[0] for a in arrays)
    return [float(np.mean([a[i].mean() for a in arrays])) for i in range(s)]


def _seed_diffs(a_row: dict, b_row: dict, metric: str) -> np.ndarray:
    """Per seed both rows have (sorted), a's value minus b's: the differences a seed-level test pairs."""
    a = dict(zip(a_row.get("seed_ids", []), a_row["metrics"][metric]["per_seed"]))
    b = dict(zip(b_row.get("seed_ids", []), b_row["metrics"][metric]["per_seed"]))
    return np.array([a[s] - b[s] for s in sorted(set(a) & set(b))])


def _compare(block, raw, baseline, metrics, benches, *, resamples: int, seed: int) -> None:
    """Gain (%), and per label against the baseline the seed-level paired t (delta, its interval and p,
    Holm-adjusted over the labels of each benchmark and metric), in place. The paired bootstrap over
    problems is kept as ``p_problems``: within-seed sampling noise only."""
    entries = {bench: block["benchmarks"][bench]["rows"] for bench in benches}
    if block["average"]["rows"]:
        entries["average"] = block["average"]["rows"]
    for lb in block["labels"]:
        if lb == baseline:
            continue
        gains: dict[str, dict] = {}
        for key, rows in entries.items():
            if lb not in rows or baseline not in rows:
                continue
            gains[key] = {}
            have = benches if key == "average" else [key]
            for m in metrics:
                cell = rows[lb]["metrics"][m]
                gains[key][m] = stats.gain_percent(cell["mean"], rows[baseline]["metrics"][m]["mean"])
                test = stats.seed_test(_seed_diffs(rows[lb], rows[baseline], m))
                cell.update(
                    delta=test["estimate"],
                    delta_ci=test["ci"],
                    delta_sd=test["sd"],
                    p=test["p"],
                    paired_seeds=test["n"],
                )
                diffs = [
                    _paired_diffs(raw[b][lb][0], raw[b][lb][1][m], raw[b][baseline][0], raw[b][baseline][1][m])
                    for b in have
                ]
                cell["p_problems"] = stats.paired_bootstrap_p(diffs, resamples=resamples, seed=seed)
        block["gain"][lb] = gains
    for rows in entries.values():  # Holm over the labels compared with the baseline, per metric
        others = [lb for lb in rows if lb != baseline and rows[lb]["metrics"][metrics[0]].get("p") is not None]
        for m in metrics:
            adjusted = stats.holm([rows[lb]["metrics"][m]["p"] for lb in others])
            for lb, p in zip(others, adjusted):
                rows[lb]["metrics"][m]["p_holm"] = p
                rows[lb]["metrics"][m]["family"] = len(others)


# ---- clip quadrants ---------------------------------------------------------------------------


def _sum_key(rows: Sequence[Mapping], key: str) -> float:
    return float(sum(r.get(key) or 0.0 for r in rows))


def run_quadrants(metrics: Sequence[Mapping]) -> dict | None:
    """Shares of one run, summed over all its optimizer steps; None when nothing was logged.

    ``share`` (%): each quadrant's ``q{i}/out_of_band`` / the sum over Q1-Q4 (the paper's Figure 4f);
    ``zero_grad`` / ``rescued`` / ``out_of_band`` (%): summed over all six cells, / all tokens;
    ``grad_share`` (%): each quadrant's ``q{i}/grad_mass`` (sum of |d loss_t / d logp_t|) / the sum
    over Q1-Q4: where the policy gradient flows; ``rescued_grad`` (%): the rescued tokens' gradient
    mass / all gradient mass (nan for runs logged before gradient mass existed).
    """
    tokens = sum(_sum_key(metrics, f"{c}/tokens") for c in CELLS)
    if tokens == 0:
        return None
    events = {q: _sum_key(metrics, f"{q}/out_of_band") for q in QUADRANTS}
    total = sum(events.values())
    mass = {q: _sum_key(metrics, f"{q}/grad_mass") for q in QUADRANTS}
    all_mass = sum(_sum_key(metrics, f"{c}/grad_mass") for c in CELLS)
    rescued_mass = sum(_sum_key(metrics, f"{c}/rescued_grad_mass") for c in CELLS)
    quad_mass = sum(mass.values())
    return {
        "events": total,
        "tokens": tokens,
        "share": {q: (100.0 * events[q] / total if total else math.nan) for q in QUADRANTS},
        "zero_grad": 100.0 * sum(_sum_key(metrics, f"{c}/zero_grad") for c in CELLS) / tokens,
        "rescued": 100.0 * sum(_sum_key(metrics, f"{c}/rescued") for c in CELLS) / tokens,
        "out_of_band": 100.0 * sum(_sum_key(metrics, f"{c}/out_of_band") for c in CELLS) / tokens,
        "grad_share": {q: (100.0 * mass[q] / quad_mass if quad_mass else math.nan) for q in QUADRANTS},
        "rescued_grad": 100.0 * rescued_mass / all_mass if all_mass else math.nan,
    }


def label_quadrants(runs: Sequence[RunRecord]) -> dict | None:
    """Mean +- std over seeds of each run's shares (each seed weighs the same)."""
    per_run = [q for q in (run_quadrants(r.metrics) for r in runs) if q is not None]
    if not per_run:
        return None

    def ms(values):
        m, s = stats.mean_std(values)
        return {"mean": m, "std": s}

    return {
        "seeds": len(per_run),
        "events": sum(q["events"] for q in per_run),
        "tokens": sum(q["tokens"] for q in per_run),
        "share": {k: ms([q["share"][k] for q in per_run]) for k in QUADRANTS},
        "grad_share": {k: ms([q["grad_share"][k] for q in per_run]) for k in QUADRANTS},
        **{k: ms([q[k] for q in per_run]) for k in ("zero_grad", "rescued", "out_of_band", "rescued_grad")},
    }


# ---- training dynamics ------------------------------------------------------------------------

NONZERO_ADV_CELLS = ("q1", "q2", "q3", "q4", "on_policy")  # the tokens a rule acts on (A != 0)


def _first_last_fifth(values: Sequence[float]) -> tuple[float, float]:
    """Means of the first and the last fifth of a series (at least one value each)."""
    k = max(1, len(values) // 5)
    return float(np.mean(values[:k])), float(np.mean(values[-k:]))


def run_dynamics(metrics: Sequence[Mapping]) -> dict | None:
    """What one run's training did, from its metrics rows; None without entropy rows.

    ``entropy``: token entropy (nats) of the first and last fifth of the optimizer steps;
    ``accuracy``: sampled accuracy of the rollouts, first and last fifth of the rollout steps;
    ``off_policy_out_of_band`` (%): out-of-band tokens / tokens with A != 0 over the off-policy
    optimizer steps (all but the first of each rollout step, whose ratios are exactly 1);
    ``completion_tokens``: mean completion length over the rollout steps (nan when not logged).
    """
    rows = [r for r in metrics if r.get("entropy") is not None]
    if not rows:
        return None
    by_step: dict = {}
    for r in rows:  # rows are in optimizer-step order
        by_step.setdefault(r.get("step"), []).append(r)
    firsts = [rs[0] for rs in by_step.values()]
    off = [r for rs in by_step.values() for r in rs[1:]]
    tokens = sum(_sum_key(off, f"{c}/tokens") for c in NONZERO_ADV_CELLS)
    oob = sum(_sum_key(off, f"{c}/out_of_band") for c in NONZERO_ADV_CELLS)
    lengths = [r["response_length/mean"] for r in firsts if r.get("response_length/mean") is not None]
    return {
        "entropy": _first_last_fifth([r["entropy"] for r in rows]),
        "accuracy": _first_last_fifth([r.get("accuracy") or 0.0 for r in firsts]),
        "off_policy_out_of_band": 100.0 * oob / tokens if tokens else math.nan,
        "completion_tokens": float(np.mean(lengths)) if lengths else math.nan,
    }


def label_dynamics(runs: Sequence[RunRecord]) -> dict | None:
    """Mean +- std over seeds of each run's dynamics (first/last pairs kept as pairs)."""
    per_run = [d for d in (run_dynamics(r.metrics) for r in runs) if d is not None]
    if not per_run:
        return None

    def ms(values):
        m, s = stats.mean_std(values)
        return {"mean": m, "std": s}

    out: dict = {"seeds": len(per_run)}
    for key in ("entropy", "accuracy"):
        out[key] = {"first": ms([d[key][0] for d in per_run]), "last": ms([d[key][1] for d in per_run])}
    for key in ("off_policy_out_of_band", "completion_tokens"):
        out[key] = ms([d[key] for d in per_run])
    return out


# ---- the whole sweep --------------------------------------------------------------------------


def analyze(
    sweep: Sweep,
    baseline: str | None = None,
    *,
    resamples: int = stats.BOOTSTRAP_RESAMPLES,
    seed: int = stats.BOOTSTRAP_SEED,
    tune_on: str | None = None,
) -> dict:
    """Every number of the report. Only runs that finished with their final evaluation are compared
    (`health.exclusion_reason`); the others are listed under runs.excluded with the reason.
    `tune_on`: the benchmark the learning-rate axis's gains are read on (report/stability.py)."""
    labels = sweep.labels()
    methods = {r.label: r.method for r in sweep.runs}
    base = resolve_baseline(labels, methods, baseline)
    states: dict[str, int] = {}
    for r in sweep.runs:
        states[r.state] = states.get(r.state, 0) + 1
    reasons = {r.run_id: health.exclusion_reason(r) for r in sweep.runs}
    compared = [r for r in sweep.runs if reasons[r.run_id] is None]
    blocks: dict[str, list[RunRecord]] = {}
    for r in compared:
        blocks.setdefault(r.model, []).append(r)
    tasks = [sweep.claims.benchmark] if sweep.claims is not None else None  # preregistered: its split alone
    out = {
        "sweep": sweep.name,
        "baseline": base,
        "bootstrap": {
            "resamples": resamples,
            "seed": seed,
            "test": "p_problems: paired over problems, two-sided, null-centred (within-seed sampling noise only)",
        },
        "significance": {
            "test": "paired t over seeds (seed the unit), two-sided",
            "correction": "Holm over the labels",
        },
        "ci": {
            "level": stats.CI_LEVEL,
            "method": "Student t over problems (seeds averaged per problem): within-seed sampling noise only",
        },
        "runs": {
            "total": len(sweep.runs),
            "states": states,
            "compared": len(compared),
            "without_eval": [r.run_id for r in sweep.runs if r.final_step is None],
            "excluded": [
                {"run_id": r.run_id, "label": r.label, "seed": r.seed, "state": r.state, "reason": reasons[r.run_id]}
                for r in sweep.runs
                if reasons[r.run_id] is not None
            ],
        },
        "health": {
            r.run_id: {"label": r.label, "seed": r.seed, "state": r.state, **health.run_health(r)} for r in sweep.runs
        },
        "blocks": [
            analyze_block(model, rs, labels, base, resamples=resamples, seed=seed, tasks=tasks)
            for model, rs in blocks.items()
        ],
        "quadrants": {},
        "identical": {
            model: health.identical_results({lb: [r for r in rs if r.label == lb] for lb in labels})
            for model, rs in blocks.items()
        },
        "notes": list(sweep.notes),
        "dynamics": {},
        "correction": {},
        "routing": {},
    }
    out["stability"] = stability(compared, out["health"], tune_on)
    for model, rs in blocks.items():
        q, dyn = {}, {}
        corr = {lb: c for lb in labels if (c := label_correction([r for r in rs if r.label == lb])) is not None}
        if corr:
            out["correction"][model] = corr
        routing = {lb: c for lb in labels if (c := label_routing([r for r in rs if r.label == lb])) is not None}
        if routing:
            out["routing"][model] = routing
        for lb in labels:
            got = label_quadrants([r for r in rs if r.label == lb])
            if got is not None:
                q[lb] = got
            got = label_dynamics([r for r in rs if r.label == lb])
            if got is not None:
                dyn[lb] = got
        out["quadrants"][model] = q
        out["dynamics"][model] = dyn
    return out
