"""The off-policy axis on the organism: its pilot, its gate, its map (docs/studies/offpolicy*.md).

    python scripts/offpolicy_study.py pilot --results-dir results --out docs/studies/offpolicy_pilot

Reads the runs of a sweep over `sampler.lag` from the results store and writes a page of tables and
its numbers per run (JSON). Per run: test and validation Avg@n at step 0 and at the end (n =
eval.n_ends), test Pass@n, the token entropy's first and last fifth, the rule's own out-of-band share
(`clip_events` over all tokens and optimizer steps: the clip fraction verl logs as pg_clipfrac), and
the batch's staleness against the behaviour policy (`offpolicy/*`, the mean over the rollout steps
at the full lag, the first `lag` steps left out), and whether its accuracy collapsed (the report's
definition, clipbench/report/health.py: the final Avg@n below half of step 0's, or the reward's last
tenth below half its first).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from organism_gate import TEST, VAL, per_run

from clipbench.config.stored import recorded
from clipbench.report import stats as report_stats
from clipbench.report.analysis import run_quadrants
from clipbench.report.health import run_health
from clipbench.report.load import RunRecord, load_results

STALENESS = ("out_of_band", "kl", "ess", "ess_seq", "q1", "q2", "q3", "q4", "zero_adv")
COLLAPSES = ("accuracy collapse", "reward collapse")


def lag_of(run: RunRecord) -> int:
    return int(recorded(run.config, "sampler.lag") or 0)


def staleness(run: RunRecord, lag: int) -> dict:
    """Mean over the rollout steps at the full lag (step >= lag) of each `offpolicy/*` value."""
    first: dict[int, dict] = {}
    for r in run.metrics:
        first.setdefault(int(r["step"]), r)
    rows = [r for s, r in sorted(first.items()) if s >= lag and r.get("offpolicy/kl") is not None]
    return {k: float(np.mean([r[f"offpolicy/{k}"] for r in rows])) if rows else math.nan for k in STALENESS}


def row(run: RunRecord) -> dict:
    lag = lag_of(run)
    out = per_run(run)
    q = run_quadrants(run.metrics)
    kinds = run_health(run).get("kinds", [])
    out.update(
        lag=lag,
        clip=q["out_of_band"] if q else math.nan,  # % of tokens out of the rule's band, over every optimizer step
        staleness=staleness(run, lag),
        kinds=list(kinds),
        collapsed=any(k in kinds for k in COLLAPSES),
    )
    return out


def load_rows(results: str, sweep: str) -> tuple[list[dict], int]:
    data = load_results(results, sweep)
    finished = [r for r in data.runs if r.state == "finished"]
    return [row(r) for r in finished], len(data.runs)


def f1(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def pilot_page(rows: list[dict], total: int, sweep: str) -> str:
    lags = sorted({r["lag"] for r in rows})
    by = {(r["method"], r["lag"]): r for r in rows}
    out = [
        f"# The off-policy axis's pilot: `{sweep}`",
        "",
        f"{len(rows)} of {total} runs finished. One seed per cell: a pilot, not a verdict. Test and validation",
        "Avg@64 and Pass@64 in points; entropy in nats (last fifth / first fifth of the optimizer steps);",
        "GRPO's clip: its own out-of-band tokens over all tokens and optimizer steps (%); staleness: the",
        "rollout batch's current policy against its behaviour policy at the start of the update, the mean",
        "over the rollout steps at the full lag (`offpolicy/*`, docs/metrics.md).",
        "",
        "| lag | rule | test Avg@64 start -> end | val end | test Pass@64 end | entropy end (ratio) | clip % | out of band % | KL | ESS | ESS seq | collapse |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lag in lags:
        for method in ("grpo", "unclipped"):
            r = by.get((method, lag))
            if r is None:
                continue
            t, v, s, e = r[TEST], r.get(VAL, {}), r["staleness"], r["entropy"]
            out.append(
                f"| {lag} | {method} | {f1(t['avg_start'])} -> {f1(t['avg_end'])} | {f1(v.get('avg_end', math.nan))} "
                f"| {f1(t['pass_end'])} | {e['last_fifth']:.3f} ({e['ratio']:.2f}) | {r['clip']:.2f} "
                f"| {100 * s['out_of_band']:.2f} | {s['kl']:.4f} | {s['ess']:.3f} | {s['ess_seq']:.3f} "
                f"| {', '.join(r['kinds']) or '-'} |"
            )
    out.append("")
    gaps = []
    for lag in lags:
        g, u = by.get(("grpo", lag)), by.get(("unclipped", lag))
        if g and u:
            gaps.append(f"lag {lag}: {u[TEST]['avg_end'] - g[TEST]['avg_end']:+.1f}")
    out += ["Unclipped minus GRPO, test Avg@64 at the end (one seed): " + "; ".join(gaps) + ".", ""]
    return "\n".join(out)


# ---- the study: per-seed endpoints, the gate at a lag, the family of claims ---------------------

ARMS = ("grpo", "unclipped", "dapo", "dual_clip", "cispo", "m2po", "bapo", "grpo_decoupled")
AA = "grpo_aa"  # GRPO on seeds disjoint from the map's: the A/A control's second label
FIELDS = (
    "arm",
    "lag",
    "seed",
    "build",
    "run_id",
    "test_avg_start",
    "test_avg_end",
    "test_pass_start",
    "test_pass_end",
    "val_avg_end",
    "entropy_first",
    "entropy_last",
    "collapsed",
    "clip",
    "oob",
    "kl",
    "ess",
    "ess_seq",
)
MARGIN = 3.0  # points of test Avg@64: "no difference" (the prereg)
G6_LOSS = 5.0  # points: the unclipped surrogate "loses" at the top lag (the prereg)


def arm_of(run: RunRecord, aa_seeds: Sequence[int] = ()) -> str:
    """The study's arm: the rule, `_decoupled` when the ratio is against the recomputed current policy
    (sampler.old_logp: recompute, the behaviour gap through sampler.correction), `grpo_aa` for GRPO on
    the A/A control's seeds."""
    arm = run.method + ("_decoupled" if recorded(run.config, "sampler.old_logp") == "recompute" else "")
    return AA if arm == "grpo" and run.seed in aa_seeds else arm


def seed_row(r: dict, arm: str, build: str) -> dict:
    """One run's endpoints as a flat row of per_seed.csv (points, nats, shares in %)."""
    t, s = r[TEST], r["staleness"]
    return {
        "arm": arm,
        "lag": r["lag"],
        "seed": r["seed"],
        "build": build,
        "run_id": r["run_id"],
        "test_avg_start": t["avg_start"],
        "test_avg_end": t["avg_end"],
        "test_pass_start": t["pass_start"],
        "test_pass_end": t["pass_end"],
        "val_avg_end": r.get(VAL, {}).get("avg_end", math.nan),
        "entropy_first": r["entropy"]["first_fifth"],
        "entropy_last": r["entropy"]["last_fifth"],
        "collapsed": int(r["collapsed"]),
        "clip": r["clip"],
        "oob": 100 * s["out_of_band"],
        "kl": s["kl"],
        "ess": s["ess"],
        "ess_seq": s["ess_seq"],
    }


def write_per_seed(rows: list[dict], path: Path) -> None:
    import csv  # noqa: PLC0415 - only here

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in sorted(rows, key=lambda r: (r["build"], r["arm"], r["lag"], r["seed"])):
            w.writerow({k: (repr(float(v)) if isinstance(v, float) else v) for k, v in r.items()})


def read_per_seed(path: Path) -> list[dict]:
    import csv  # noqa: PLC0415 - only here

    ints = {"lag", "seed", "collapsed"}
    text = {"arm", "build", "run_id"}
    with open(path, newline="") as f:
        return [
            {k: (v if k in text else int(v) if k in ints else float(v)) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def select(rows: list[dict], arm: str, lag: int, build: str = "shipped") -> dict[int, dict]:
    return {r["seed"]: r for r in rows if r["arm"] == arm and r["lag"] == lag and r["build"] == build}


def paired(rows: list[dict], a: str, b: str, lag: int, key: str, build: str = "shipped") -> list[float]:
    """a - b of `key`, one difference per seed both arms finished."""
    ra, rb = select(rows, a, lag, build), select(rows, b, lag, build)
    return [ra[s][key] - rb[s][key] for s in sorted(set(ra) & set(rb))]


def signed_rank(diffs: Sequence[float]) -> float:
    """Two-sided p of the Wilcoxon signed-rank test of paired differences (exact for small n)."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    d = np.asarray(diffs, dtype=float)
    if d.size < 2 or np.allclose(d, 0):
        return math.nan if d.size < 2 else 1.0
    return float(sps.wilcoxon(d).pvalue)


def gate(rows: list[dict], lag: int) -> dict:
    """G1-G5 of docs/studies/organism.md and G6 (the axis is real) at one lag; the seed is the unit."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    g = select(rows, "grpo", lag)
    grpo = [g[s] for s in sorted(g)]
    out: dict = {"lag": lag, "seeds": sorted(g)}
    if len(grpo) < 2:
        return out
    t = report_stats.seed_test([r["test_avg_end"] - r["test_avg_start"] for r in grpo])
    out["G1"] = {**t, "pass": t["estimate"] >= 8.0 and t["ci"][0] > 4.0}
    ratios = [r["entropy_last"] / r["entropy_first"] for r in grpo]
    hits = sum(x <= 0.5 for x in ratios)
    out["G2"] = {"ratios": ratios, "hits": hits, "n": len(ratios), "pass": len(ratios) >= 10 and hits >= 9}
    d = paired(rows, "dapo", "grpo", lag, "entropy_last")
    t = report_stats.seed_test(d)
    out["G3"] = {**t, "p_signed_rank": signed_rank(d), "pass": t["estimate"] > 0 and t["p"] < 0.05}
    t = report_stats.seed_test([r["test_pass_end"] - r["test_pass_start"] for r in grpo])
    out["G4"] = {**t, "pass": t["estimate"] <= 1.0 and out["G1"]["pass"]}
    aa = select(rows, AA, lag)
    fam = {}  # the preregistered 4 (organism.md's fifth, validation Avg@64, is not evaluated in this study)
    for name, f in (
        ("test Avg@64 gain", lambda r: r["test_avg_end"] - r["test_avg_start"]),
        ("test Avg@64 end", lambda r: r["test_avg_end"]),
        ("test Pass@64 end", lambda r: r["test_pass_end"]),
        ("entropy, last fifth", lambda r: r["entropy_last"]),
    ):
        xa, xb = [f(r) for r in grpo], [f(aa[s]) for s in sorted(aa)]
        if len(xb) >= 2:
            p = float(sps.ttest_ind(xa, xb, equal_var=False).pvalue)
            fam[name] = {"diff": float(np.mean(xa) - np.mean(xb)), "p": 1.0 if math.isnan(p) else p}
    for v, adj in zip(fam.values(), report_stats.holm([v["p"] for v in fam.values()])):
        v["p_holm"] = adj
    out["G5"] = {"family": fam, "pass": bool(fam) and all(v["p_holm"] >= 0.05 for v in fam.values())}
    return out


def g6(rows: list[dict], top: int) -> dict:
    """The axis is real: the unclipped surrogate equivalent to GRPO at lag 0 (TOST, +-MARGIN points of
    test Avg@64), and at the top lag losing >= G6_LOSS points (the paired mean, its 95% interval
    below 0) or collapsing on at least half its seeds."""
    d0 = paired(rows, "unclipped", "grpo", 0, "test_avg_end")
    dt = paired(rows, "unclipped", "grpo", top, "test_avg_end")
    eq, loss = report_stats.tost(d0, MARGIN), report_stats.seed_test(dt)
    u = select(rows, "unclipped", top)
    collapsed = sum(r["collapsed"] for r in u.values())
    loses = loss["estimate"] <= -G6_LOSS and loss["ci"][1] < 0
    return {
        "equivalent_at_0": {**report_stats.seed_test(d0), "p_tost": eq["p"], "pass": eq["p"] < 0.05},
        "top": top,
        "loss_at_top": {**loss, "pass": loses},
        "collapsed_at_top": {"n": collapsed, "of": len(u), "pass": 2 * collapsed >= len(u) > 0},
        "pass": eq["p"] < 0.05 and (loses or (2 * collapsed >= len(u) > 0)),
    }


def family(rows: list[dict], lags: Sequence[int], arms: Sequence[str], build: str = "shipped") -> dict:
    """The preregistered claims: for each lag and arm, against GRPO at that lag, paired over seeds.
    Primary (Holm over its claims): test Avg@64 end, difference (paired t) and equivalence within
    +-MARGIN (TOST). Secondary (Holm over its own): test Pass@64 end (paired t) and last-fifth entropy
    (Wilcoxon signed-rank; the paired t beside it)."""
    primary, secondary = [], []
    for lag in lags:
        for arm in arms:
            d = paired(rows, arm, "grpo", lag, "test_avg_end", build)
            if len(d) < 2:
                continue
            t = report_stats.seed_test(d)
            sd = float(np.std(d, ddof=1))
            base = {
                "arm": arm,
                "lag": lag,
                "n": len(d),
                **t,
                "mde": report_stats.mde(sd / math.sqrt(len(d)), len(d) - 1),
            }
            primary.append({**base, "kind": "difference", "endpoint": "test Avg@64", "p_test": t["p"]})
            primary.append(
                {**base, "kind": "equivalence", "endpoint": "test Avg@64", "p_test": report_stats.tost(d, MARGIN)["p"]}
            )
            dp = paired(rows, arm, "grpo", lag, "test_pass_end", build)
            tp = report_stats.seed_test(dp)
            secondary.append(
                {
                    "arm": arm,
                    "lag": lag,
                    "n": len(dp),
                    **tp,
                    "kind": "difference",
                    "endpoint": "test Pass@64",
                    "p_test": tp["p"],
                }
            )
            de = paired(rows, arm, "grpo", lag, "entropy_last", build)
            te = report_stats.seed_test(de)
            secondary.append(
                {
                    "arm": arm,
                    "lag": lag,
                    "n": len(de),
                    **te,
                    "kind": "difference",
                    "endpoint": "entropy, last fifth",
                    "p_t": te["p"],
                    "p_test": signed_rank(de),
                }
            )
    for fam in (primary, secondary):
        for c, adj in zip(fam, report_stats.holm([c["p_test"] for c in fam])):
            c["p_holm"] = adj
            c["verdict"] = verdict_of(c)
    return {"primary": primary, "secondary": secondary}


def followup(rows: list[dict], lag: int = 128) -> list[dict]:
    """The follow-up's family (docs/studies/offpolicy_followup_prereg.md), Holm over all of it: each new
    arm against GRPO and against the unclipped surrogate (differences) and within +-MARGIN of the
    unclipped surrogate (TOST) at `lag`; the unclipped surrogate against GRPO on the second build."""
    claims = []

    def claim(a: str, b: str, kind: str, build: str = "shipped") -> None:
        d = paired(rows, a, b, lag, "test_avg_end", build)
        if len(d) < 2:
            return
        t = report_stats.seed_test(d)
        p = report_stats.tost(d, MARGIN)["p"] if kind == "equivalence" else t["p"]
        claims.append({"a": a, "b": b, "build": build, "kind": kind, "n": len(d), **t, "p_test": p})

    for arm in FOLLOWUP_ARMS:
        claim(arm, "grpo", "difference")
        claim(arm, "unclipped", "difference")
        claim(arm, "unclipped", "equivalence")
    claim("unclipped", "grpo", "difference", "build2")
    # Holm over the preregistered family of FOLLOWUP_FAMILY whatever ran: a claim without its runs
    # counts with p = 1 (it cannot be rejected), so a partial family is never adjusted over fewer claims
    ps = [c["p_test"] for c in claims] + [1.0] * (FOLLOWUP_FAMILY - len(claims))
    for c, adj in zip(claims, report_stats.holm(ps)):
        c["p_holm"] = adj
        c["verdict"] = verdict_of(c)
    return claims


def followup_table(claims: list[dict]) -> list[str]:
    out = [
        f"| comparison | build | kind | estimate [95% CI] | n | p | p Holm (family of {FOLLOWUP_FAMILY}, "
        f"{len(claims)} with runs) | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in claims:
        out.append(
            f"| {c['a']} - {c['b']} | {c['build']} | {c['kind']} | {ci_text(c)} | {c['n']} | {p_text(c['p_test'])} "
            f"| {p_text(c['p_holm'])} | {c['verdict']} |"
        )
    return out


def verdict_of(c: dict) -> str:
    if not math.isfinite(c["p_holm"]) or c["p_holm"] >= 0.05:
        return "inconclusive"
    if c["kind"] == "equivalence":
        return "equivalent"
    return "higher" if c["estimate"] > 0 else "lower"


def replication(primary: list[dict], again: list[dict]) -> dict:
    """Each primary claim on the second build: replicates (the same verdict, the same sign of the
    estimate), contradicted (the opposite conclusive verdict), else fragile; and the count over the
    primary's conclusive verdicts alone."""
    by = {(c["arm"], c["lag"], c["kind"]): c for c in again}
    out = []
    for c in primary:
        o = by.get((c["arm"], c["lag"], c["kind"]))
        if o is None:
            continue
        same = o["verdict"] == c["verdict"] and np.sign(o["estimate"]) == np.sign(c["estimate"])
        opposite = {o["verdict"], c["verdict"]} == {"higher", "lower"} or (
            "equivalent" in {o["verdict"], c["verdict"]} and {o["verdict"], c["verdict"]} & {"higher", "lower"}
        )
        out.append({**c, "again": o, "status": "replicates" if same else "contradicted" if opposite else "fragile"})
    conclusive = [x for x in out if x["verdict"] != "inconclusive"]
    return {
        "claims": out,
        "verdicts": len(conclusive),
        "verdicts_replicated": sum(x["status"] == "replicates" for x in conclusive),
        "contradicted": sum(x["status"] == "contradicted" for x in out),
    }


# ---- the pages ------------------------------------------------------------------------------------

STUDY_SWEEPS = (
    "offpolicy_gate",
    "offpolicy_gate_aa",
    "offpolicy_g6",
    "offpolicy_map",
    "offpolicy_map_ends",
    "offpolicy_top",
)
BUILD2_SWEEPS = ("offpolicy_build2", "offpolicy_build2_top")
FOLLOWUP_ARMS = ("dual_clip", "cispo", "m2po", "bapo", "grpo_decoupled")
FOLLOWUP_FAMILY = 3 * len(FOLLOWUP_ARMS) + 1  # 16: three claims per new arm, one on the second build
AA_SEEDS = range(110, 120)
TOP = 128


def study_rows(results: str) -> tuple[list[dict], list[dict], dict]:
    """(per-seed rows of every finished run of the study's sweeps found, the store-derived rows (with
    curves) for the figures, {sweep: (finished, total)})."""
    rows, full, counts = [], [], {}
    for sweep in (*STUDY_SWEEPS, *BUILD2_SWEEPS):
        if not (Path(results) / sweep / "manifest.json").is_file():
            continue
        data = load_results(results, sweep)
        done = [r for r in data.runs if r.state == "finished"]
        counts[sweep] = (len(done), len(data.runs))
        build = "build2" if sweep in BUILD2_SWEEPS else "shipped"
        for run in done:
            r = row(run)
            arm = arm_of(run, AA_SEEDS)
            rows.append(seed_row(r, arm, build))
            full.append({**r, "arm": arm, "build": build})
    return rows, full, counts


def ci_text(t: dict, nd: int = 1) -> str:
    lo, hi = t["ci"]
    return f"{t['estimate']:+.{nd}f} [{lo:+.{nd}f}, {hi:+.{nd}f}]"


def p_text(p: float) -> str:
    return "n/a" if not math.isfinite(p) else "<0.001" if p < 0.001 else f"{p:.3f}"


def gate_page(rows: list[dict], counts: dict) -> str:
    """The gate at lag 0 and the top lag, G6 at every lag run, and each arm's endpoints per lag, from
    per-seed rows alone (per_seed.csv)."""
    shipped = [r for r in rows if r["build"] == "shipped"]
    lags = sorted({r["lag"] for r in shipped})
    out = [
        "# The off-policy axis's gate",
        "",
        "Generated by `scripts/offpolicy_study.py gate` from `per_seed.csv` (one row per finished run;",
        "docs/studies/offpolicy_prereg.md fixed every test and threshold before the runs). Runs finished: "
        + ", ".join(f"{s} {d} of {n}" for s, (d, n) in counts.items())
        + ". The seed is the unit of every test.",
        "",
        "## G1-G5 at lag 0 and at the top lag",
        "",
        "| gate | passes when | lag 0 | lag " + str(TOP) + " |",
        "|---|---|---|---|",
    ]
    gates = {lag: gate(shipped, lag) for lag in (0, TOP)}

    def cell(g: dict, key: str) -> str:
        if key not in g:
            return "not run"
        v = g[key]
        ok = "**passes**" if v["pass"] else "**fails**"
        if key in ("G1", "G4"):
            return f"{ci_text(v)} points, {v['n']} seeds: {ok}"
        if key == "G2":
            return f"{v['hits']} of {v['n']} seeds (ratios {min(v['ratios']):.2f}-{max(v['ratios']):.2f}): {ok}"
        if key == "G3":
            return f"{ci_text(v, 4)} nats, p {p_text(v['p'])} (signed-rank {p_text(v['p_signed_rank'])}): {ok}"
        worst = min((x["p_holm"] for x in v["family"].values()), default=math.nan)
        return f"smallest Holm p {p_text(worst)} over {len(v['family'])} endpoints: {ok}"

    for key, what in (
        ("G1", "RL works: grpo's test Avg@64 gain >= +8, lower end > +4"),
        ("G2", "entropy collapse: last fifth <= 0.5 x first on >= 9 of 10 seeds"),
        ("G3", "clip-higher keeps entropy: dapo - grpo > 0, paired t p < 0.05"),
        ("G4", "sharpening: grpo's Pass@64 end - base <= +1, with G1"),
        ("G5", "one A/A draw: grpo seeds 100-109 vs 110-119, nothing after Holm over 4"),
    ):
        out.append(f"| {key} | {what} | {cell(gates[0], key)} | {cell(gates[TOP], key)} |")
    out += [
        "",
        "## G6: is the axis real? The unclipped surrogate against GRPO at each lag",
        "",
        "G6 holds at a lag when the unclipped surrogate is equivalent to GRPO at lag 0 (TOST within +-3",
        "points) and at that lag loses >= 5 points (paired mean, 95% interval below 0) or collapses on at",
        "least half its seeds.",
        "",
        "| lag | unclipped - grpo, test Avg@64 [95% CI] | n | p (paired t) | TOST p (+-3) | unclipped collapsed | G6 |",
        "|---|---|---|---|---|---|---|",
    ]
    for lag in lags:
        d = paired(shipped, "unclipped", "grpo", lag, "test_avg_end")
        if len(d) < 2:
            continue
        t = report_stats.seed_test(d)
        u = select(shipped, "unclipped", lag)
        verdict = "(its reference)" if lag == 0 else ("**holds**" if g6(shipped, lag)["pass"] else "**fails**")
        out.append(
            f"| {lag} | {ci_text(t)} | {t['n']} | {p_text(t['p'])} | {p_text(report_stats.tost(d, MARGIN)['p'])} "
            f"| {sum(r['collapsed'] for r in u.values())} of {len(u)} | {verdict} |"
        )
    claims = followup(rows)
    if claims:
        out += [
            "",
            "## The follow-up at lag " + str(TOP) + " (docs/studies/offpolicy_followup_prereg.md)",
            "",
            "Each rule the gate did not run against GRPO and against the unclipped surrogate, paired over seeds",
            "100-109; the unclipped surrogate against GRPO again on the second build (seeds 100-104). Holm over the",
            "whole family; higher / lower: the adjusted p < 0.05; equivalent: within +-3 points at the adjusted level.",
            "",
            *followup_table(claims),
        ]
    out += ["", "## Each arm at each lag (mean ± sd over seeds)", ""]
    out += [
        "| arm | lag | seeds | test Avg@64 start -> end | test Pass@64 end | entropy first -> last fifth | clip % | out of band % | KL | ESS | ESS seq |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(vals: list[float], nd: int = 1) -> str:
        v = np.asarray(vals, dtype=float)
        return f"{v.mean():.{nd}f} ± {v.std(ddof=1) if len(v) > 1 else 0:.{nd}f}"

    for arm, build in [(a, "shipped") for a in (*ARMS, AA)] + [(a, "build2") for a in ARMS]:
        for lag in lags:
            rs = list(select(rows, arm, lag, build).values())
            if not rs:
                continue
            col = lambda k: [r[k] for r in rs]  # noqa: E731
            out.append(
                f"| {arm if build == 'shipped' else arm + ' (build 2)'} | {lag} | {len(rs)} | {ms(col('test_avg_start'))} -> {ms(col('test_avg_end'))} "
                f"| {ms(col('test_pass_end'))} | {ms(col('entropy_first'), 3)} -> {ms(col('entropy_last'), 3)} "
                f"| {ms(col('clip'), 2)} | {ms(col('oob'), 2)} | {ms(col('kl'), 4)} | {ms(col('ess'), 3)} "
                f"| {ms(col('ess_seq'), 3)} |"
            )
    out += [
        "",
        "clip %: the arm's own out-of-band tokens over all tokens and optimizer steps (its rule's band; the",
        "clip fraction verl logs as pg_clipfrac); out of band %, KL, ESS: the rollout batch's current policy",
        "against its behaviour policy at the start of each update, the mean over the rollout steps at the",
        "full lag (`offpolicy/*`, docs/metrics.md).",
        "",
    ]
    return "\n".join(out)


def figures(full: list[dict], out: Path) -> None:
    """Each arm's test Avg@64 minus GRPO's against the lag (seed intervals), GRPO's staleness against
    the lag, and the entropy curves at the top lag."""
    import matplotlib  # noqa: PLC0415 - only for the figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in full if r["build"] == "shipped"]
    per_seed = [seed_row(r, r["arm"], r["build"]) for r in rows]
    lags = sorted({r["lag"] for r in rows})
    x_of = {lag: i for i, lag in enumerate(lags)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    grpo = [np.mean([r["test_avg_end"] for r in select(per_seed, "grpo", lag).values()]) for lag in lags]
    ax.plot(range(len(lags)), grpo, "o-", color="black", label="grpo (its own Avg@64)")
    ax.set_xticks(range(len(lags)), [str(k) for k in lags])
    ax.set_xlabel("policy lag (rollout steps)")
    ax.set_ylabel("grpo: test Avg@64 (points)")
    ax.set_title("What staleness costs GRPO")
    ax2 = axes[1]
    for i, arm in enumerate(a for a in ARMS if a != "grpo"):
        xs, ys, los, his = [], [], [], []
        for lag in lags:
            d = paired(per_seed, arm, "grpo", lag, "test_avg_end")
            if len(d) < 2:
                continue
            t = report_stats.seed_test(d)
            xs.append(x_of[lag] + 0.06 * (i - 3))
            ys.append(t["estimate"])
            los.append(t["estimate"] - t["ci"][0])
            his.append(t["ci"][1] - t["estimate"])
        if xs:
            ax2.errorbar(xs, ys, yerr=[los, his], fmt="o-", capsize=3, label=arm)
    ax2.axhline(0, color="gray", lw=0.8)
    ax2.axhspan(-MARGIN, MARGIN, color="gray", alpha=0.1, label="+-3 points")
    ax2.set_xticks(range(len(lags)), [str(k) for k in lags])
    ax2.set_xlabel("policy lag (rollout steps)")
    ax2.set_ylabel("arm - grpo, test Avg@64 (points, 95% CI)")
    ax2.set_title("Each rule against GRPO")
    ax2.legend(fontsize=8)
    ax3 = axes[2]
    g = {lag: list(select(per_seed, "grpo", lag).values()) for lag in lags}
    ax3.plot(
        range(len(lags)), [np.mean([r["clip"] for r in g[lag]]) for lag in lags], "o-", label="grpo's clip share (%)"
    )
    ax3.plot(
        range(len(lags)), [np.mean([r["oob"] for r in g[lag]]) for lag in lags], "s--", label="out of [0.8, 1.2] (%)"
    )
    ax3.set_xticks(range(len(lags)), [str(k) for k in lags])
    ax3.set_xlabel("policy lag (rollout steps)")
    ax3.set_ylabel("% of tokens")
    ax4 = ax3.twinx()
    ax4.plot(
        range(len(lags)),
        [np.mean([r["ess_seq"] for r in g[lag]]) for lag in lags],
        "^:",
        color="tab:red",
        label="ESS, sequences (right)",
    )
    ax4.set_ylabel("effective sample size / n")
    ax4.set_ylim(0, 1.05)
    h1, l1 = ax3.get_legend_handles_labels()
    h2, l2 = ax4.get_legend_handles_labels()
    ax3.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax3.set_title("How stale GRPO's batches are")
    fig.tight_layout()
    fig.savefig(out / "offpolicy_axis.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for arm, color in (("grpo", "black"), ("unclipped", "tab:red"), ("dapo", "tab:blue")):
        series = [r["entropy"]["series"] for r in rows if r["arm"] == arm and r["lag"] == TOP]
        if not series:
            continue
        m = min(map(len, series))
        arr = np.array([s_[:m] for s_ in series])
        mean = arr.mean(0)
        half = report_stats_t(arr) if len(arr) > 1 else np.zeros(m)  # 95% t interval over seeds, per step
        ax.plot(np.arange(m), mean, color=color, label=f"{arm} ({len(arr)} seeds)")
        ax.fill_between(np.arange(m), mean - half, mean + half, color=color, alpha=0.15)
    ax.set_xlabel("rollout step")
    ax.set_ylabel("mean token entropy (nats)")
    ax.set_title(f"Entropy at policy lag {TOP} (95% CI over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "offpolicy_entropy_top.png", dpi=110)
    plt.close(fig)


def report_stats_t(arr: np.ndarray) -> np.ndarray:
    """Half-width of the 95% t interval over seeds (rows) at each column."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    n = arr.shape[0]
    return sps.t.ppf(0.975, n - 1) * arr.std(0, ddof=1) / math.sqrt(n)


# ---- the replay: every arm's rule on GRPO's recorded stale batches -----------------------------------

REPLAY_RULES = "grpo,unclipped,dapo,dual_clip,cispo,m2po,bapo"
REPLAY_SEEDS = range(100, 105)


def replay_runs(results: str) -> list[tuple[int, int, Path]]:
    """(lag, seed, run dir) of every finished, recorded GRPO run of the study's sweeps on the replay's seeds."""
    out = []
    for sweep in STUDY_SWEEPS:
        if not (Path(results) / sweep / "manifest.json").is_file():
            continue
        for run in load_results(results, sweep).runs:
            if (
                run.state == "finished"
                and arm_of(run) == "grpo"
                and run.seed in REPLAY_SEEDS
                and run.status.get("records")
            ):
                out.append((lag_of(run), run.seed, run.path))
    return sorted(out)


def run_replays(results: str, raw: Path) -> None:
    """`clipbench replay RUN --json --no-params` of each recorded GRPO run into raw/<lag>_<seed>.jsonl
    (token level: every rule's loss, cells and gradient on the recorded log-probs; kept where done)."""
    import subprocess  # noqa: PLC0415 - only here

    raw.mkdir(parents=True, exist_ok=True)
    for lag, seed, path in replay_runs(results):
        dest = raw / f"{lag}_{seed}.jsonl"
        if dest.is_file() and dest.stat().st_size:
            continue
        cmd = [sys.executable, "-m", "clipbench", "replay", str(path), "--rules", REPLAY_RULES, "--json", "--no-params"]
        with open(dest.with_suffix(".tmp"), "w") as f:
            subprocess.run(cmd, stdout=f, check=True)
        dest.with_suffix(".tmp").replace(dest)


def replay_summary(raw: Path) -> dict:
    """Per lag and rule, summed over the replayed runs' optimizer steps: each quadrant's share of tokens
    whose gradient the rule zeroes (of that quadrant's tokens), the out-of-band share, and the mean
    token-level gradient cosine with GRPO's and norm ratio (a counterfactual on identical batches)."""
    acc: dict = {}
    for f in sorted(raw.glob("*.jsonl")):
        lag = int(f.stem.split("_")[0])
        for line in f.read_text().splitlines():
            d = json.loads(line)
            a = acc.setdefault((lag, d["rule"]), {"steps": 0, "cos": 0.0, "norm": 0.0, "runs": set()})
            a["steps"] += 1
            a["cos"] += d["grad_cosine"]
            a["norm"] += d["grad_norm_ratio"]
            a["runs"].add(f.stem)
            for q in ("q1", "q2", "q3", "q4"):
                for k in ("tokens", "zero_grad", "out_of_band"):
                    a[f"{q}/{k}"] = a.get(f"{q}/{k}", 0.0) + d[f"{q}/{k}"]
    out = {}
    for (lag, rule), a in sorted(acc.items()):
        toks = sum(a[f"{q}/tokens"] for q in ("q1", "q2", "q3", "q4"))
        out.setdefault(str(lag), {})[rule] = {
            "runs": len(a["runs"]),
            "steps": a["steps"],
            "grad_cosine": a["cos"] / a["steps"],
            "grad_norm_ratio": a["norm"] / a["steps"],
            "zero_grad": {q: 100 * a[f"{q}/zero_grad"] / max(a[f"{q}/tokens"], 1) for q in ("q1", "q2", "q3", "q4")},
            "zero_grad_all": 100 * sum(a[f"{q}/zero_grad"] for q in ("q1", "q2", "q3", "q4")) / max(toks, 1),
            "out_of_band": 100 * sum(a[f"{q}/out_of_band"] for q in ("q1", "q2", "q3", "q4")) / max(toks, 1),
        }
    return out


def replay_page(summary: dict) -> str:
    lines = [
        "# Every rule on GRPO's stale batches: the replay",
        "",
        "Generated by `scripts/offpolicy_study.py replay`. GRPO's runs at each lag (seeds 100-104) recorded every",
        "10th rollout step; each rule below recomputed its loss, its clip cells and its gradient with respect to",
        "the log-probs on exactly those batches (`clipbench replay --no-params`). A counterfactual on identical",
        "inputs: what each rule would have done to GRPO's own updates, not where it would have led. Shares of",
        "the tokens with A != 0; zeroed: the rule's gradient on the token is exactly 0.",
        "",
        "| lag | rule | runs | opt. steps | tokens out of its band % | zeroed % (all) | zeroed % Q1 / Q2 / Q3 / Q4 | grad cosine with GRPO | grad norm / GRPO's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lag in sorted(summary, key=int):
        for rule in REPLAY_RULES.split(","):
            v = summary[lag].get(rule)
            if v is None:
                continue
            z = " / ".join(f"{v['zero_grad'][q]:.2f}" for q in ("q1", "q2", "q3", "q4"))
            lines.append(
                f"| {lag} | {rule} | {v['runs']} | {v['steps']} | {v['out_of_band']:.2f} | {v['zero_grad_all']:.2f} "
                f"| {z} | {v['grad_cosine']:.4f} | {v['grad_norm_ratio']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("pilot", "gate", "replay"))
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--sweep", default="offpolicy_pilot")
    ap.add_argument("--out", default="docs/studies/offpolicy_pilot")
    ap.add_argument("--from-csv", action="store_true", help="gate: rederive the page from OUT/per_seed.csv alone")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.what == "replay":
        raw = Path(args.results_dir) / "offpolicy_replay"
        run_replays(args.results_dir, raw)
        summary = replay_summary(raw)
        (out / "replay").mkdir(parents=True, exist_ok=True)
        (out / "replay" / "replay.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "replay" / "replay.md").write_text(replay_page(summary))
        print((out / "replay" / "replay.md").read_text())
        return 0
    if args.what == "gate":
        out.mkdir(parents=True, exist_ok=True)
        if args.from_csv:
            rows, counts = read_per_seed(out / "per_seed.csv"), json.loads((out / "counts.json").read_text())
        else:
            rows, full, counts = study_rows(args.results_dir)
            if not rows:
                print(f"offpolicy_study: no finished runs of the study in {args.results_dir}", file=sys.stderr)
                return 2
            write_per_seed(rows, out / "per_seed.csv")
            (out / "counts.json").write_text(json.dumps(counts, indent=1) + "\n")
            figures(full, out / "plots")
        (out / "gate.md").write_text(gate_page(rows, counts))
        print((out / "gate.md").read_text())
        return 0
    rows, total = load_rows(args.results_dir, args.sweep)
    if not rows:
        print(f"offpolicy_study: no finished runs in sweep {args.sweep}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "pilot.md").write_text(pilot_page(rows, total, args.sweep))
    (out / "pilot.json").write_text(json.dumps(rows, indent=1, default=float) + "\n")
    print((out / "pilot.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
