"""The organism's gate: do positive controls show the phenomena the rules exist for?

    python scripts/organism_gate.py --results-dir results --sweep organism_gate --out docs/studies/organism
    python scripts/organism_gate.py --from-json docs/studies/organism/gate.json --out docs/studies/organism

Reads the sweep's runs from the results store (sweeps/organism_gate.yaml: grpo on seeds 0-19, dapo
on seeds 0-9) and writes ``gate.md`` (the gate table, then what is measured and not gated),
``gate.json`` (every number, per seed), ``per_seed.csv`` (each run's gate endpoints, one row per run:
every verdict is rederived from it by `gates(read_per_seed(...))`) and two figures (entropy curves of
grpo and dapo with seed bands; Pass@k against k for the base model and grpo). ``--from-json``
rewrites gate.md and per_seed.csv from a gate.json alone (no store, no figures). The gates
(docs/studies/organism.md):

    G1 RL works           grpo's test Avg@n gain over its own step 0: mean >= +8 points, 95% t
                          interval over seeds (paired) lower end > +4           (seeds 0-9)
    G2 entropy collapse   last fifth's mean token entropy <= 0.5 x the first fifth's on >= 9 of 10 seeds
    G3 clip-higher        dapo - grpo last-fifth entropy, paired over seeds 0-9: > 0 with p < 0.05
    G4 sharpening         grpo's test Pass@n at the end - the base model's: mean <= +1 point, while G1 holds
    G5 A/A draw           grpo seeds 0-9 against grpo seeds 10-19 (two labels, disjoint seeds): Welch t
                          on each endpoint, Holm over the family: nothing significant at 0.05. One
                          draw of an A/A comparison: it shows these two sets of seeds are not told
                          apart; it does not measure the false-positive rate (that takes many draws)

n is the endpoints' samples per problem (eval.n_ends, 64 in the shipped sweep). The seed is the unit
of every test: per-seed values first (each a mean over the benchmark's problems), then the test.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import stats

from clipbench.eval.passk import pass_at_k_array
from clipbench.report import stats as report_stats
from clipbench.report.analysis import NONZERO_ADV_CELLS, run_dynamics, run_quadrants
from clipbench.report.load import RunRecord, load_results

TEST, VAL = "arith", "arith-val"
A_SEEDS, B_SEEDS = range(0, 10), range(10, 20)  # B: the A/A control's second label


def correct_at(run: RunRecord, bench: str, step: int) -> np.ndarray:
    """(P, n) correctness matrix of the evaluation at ``step``, rows in problem-id order."""
    p = run.evals[step][bench]
    order = np.argsort([str(i) for i in p["problem_ids"]])
    return np.asarray(p["correct"], dtype=float)[order]


def pass_k(correct: np.ndarray, k: int) -> float:
    """Unbiased Pass@k (Chen et al.) averaged over problems, in points."""
    n = correct.shape[1]
    return 100.0 * float(np.mean(pass_at_k_array(n, correct.sum(1).astype(int), k)))


def entropy_series(run: RunRecord) -> list[float]:
    """Mean token entropy of each rollout step (the mean of its optimizer steps' rows)."""
    by_step: dict[int, list[float]] = {}
    for r in run.metrics:
        if r.get("entropy") is not None:
            by_step.setdefault(int(r["step"]), []).append(float(r["entropy"]))
    return [float(np.mean(v)) for _, v in sorted(by_step.items())]


def fifths(series: Sequence[float]) -> tuple[float, float]:
    k = max(1, len(series) // 5)
    return float(np.mean(series[:k])), float(np.mean(series[-k:]))


def per_run(run: RunRecord) -> dict:
    first, last = min(run.evals), max(run.evals)
    out: dict = {"seed": run.seed, "method": run.method, "run_id": run.run_id, "final_step": last}
    for bench in (TEST, VAL):
        if bench not in run.evals[last]:
            continue
        c0, c1 = correct_at(run, bench, first), correct_at(run, bench, last)
        n = c1.shape[1]
        out[bench] = {
            "n": n,
            "problems": c1.shape[0],
            "avg_start": 100.0 * c0.mean(),
            "avg_end": 100.0 * c1.mean(),
            "pass_start": pass_k(c0, c0.shape[1]),
            "pass_end": pass_k(c1, n),
            "passk_start": {k: pass_k(c0, k) for k in ks(c0.shape[1])},
            "passk_end": {k: pass_k(c1, k) for k in ks(n)},
        }
    e_first, e_last = run_dynamics(run.metrics)["entropy"]  # the report's own first and last fifth
    out["entropy"] = {
        "series": entropy_series(run),
        "first_fifth": e_first,
        "last_fifth": e_last,
        "ratio": e_last / e_first,
    }
    lengths = {}
    for r in run.metrics:
        if r.get("response_length/mean") is not None:
            lengths.setdefault(int(r["step"]), float(r["response_length/mean"]))
    out["length"] = [lengths[s] for s in sorted(lengths)]
    q = run_quadrants(run.metrics)
    if q is not None:
        acted = sum(sum(float(r.get(f"{c}/tokens", 0) or 0) for c in NONZERO_ADV_CELLS) for r in run.metrics)
        near = sum(sum(float(r.get(f"{c}/in_band_near", 0) or 0) for c in NONZERO_ADV_CELLS) for r in run.metrics)
        rule_band = 100.0 * near / acted if acted else math.nan  # the run's own rule's band (rules with a delta)
        out["clip"] = {
            "out_of_band": q["out_of_band"],
            "share": q["share"],
            "grad_share": q["grad_share"],
            "rescue_band": rule_band if run.method == "nsr" else nsr_band_share(run.hist),
        }
    return out


NSR_BAND = {"pos": (math.log(1.28), math.log(1.38)), "neg": (math.log(0.7), math.log(0.8))}  # nsr's defaults


def nsr_band_share(hist: Sequence[dict]) -> float:
    """% of tokens with A != 0 whose ratio lies in NSR's rescue band at its defaults (eps 0.2 / 0.28,
    delta 0.1: A > 0 with r in (1.28, 1.38], A < 0 with r in [0.7, 0.8)), read from the run's log-ratio
    histograms (the last optimizer step of each rollout step, the most off-policy one; a bin counts
    when its centre lies in the band)."""
    inside = total = 0.0
    for h in hist:
        edges = np.asarray(h["edges"], dtype=float)
        centres = (edges[:-1] + edges[1:]) / 2
        for side, (lo, hi) in NSR_BAND.items():
            counts = np.asarray(h.get(side, []), dtype=float)  # [below the first edge, the bins, above the last]
            if counts.size != centres.size + 2:
                continue
            total += counts.sum()
            inside += counts[1:-1][(centres > lo) & (centres <= hi)].sum()
    return 100.0 * inside / total if total else math.nan


def ks(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out if out[-1] == n else [*out, n]


def t_interval(diffs: Sequence[float]) -> dict:
    """The report's paired t over seeds (`report.stats.seed_test`): mean, 95% interval, two-sided p."""
    t = report_stats.seed_test(diffs)
    return {"mean": t["estimate"], "lo": t["ci"][0], "hi": t["ci"][1], "p": t["p"], "n": t["n"]}


def gates(rows: list[dict]) -> dict:
    grpo = {r["seed"]: r for r in rows if r["method"] == "grpo"}
    dapo = {r["seed"]: r for r in rows if r["method"] == "dapo"}
    a = [grpo[s] for s in A_SEEDS if s in grpo]
    b = [grpo[s] for s in B_SEEDS if s in grpo]
    out: dict = {"seeds": {"grpo": sorted(grpo), "dapo": sorted(dapo)}}

    gain = t_interval([r[TEST]["avg_end"] - r[TEST]["avg_start"] for r in a])
    out["G1"] = {**gain, "pass": gain["mean"] >= 8.0 and gain["lo"] > 4.0}

    ratios = [r["entropy"]["ratio"] for r in a]
    hits = sum(x <= 0.5 for x in ratios)
    out["G2"] = {"ratios": ratios, "hits": hits, "n": len(ratios), "pass": len(ratios) >= 10 and hits >= 9}

    paired = [s for s in A_SEEDS if s in grpo and s in dapo]
    g3 = t_interval([dapo[s]["entropy"]["last_fifth"] - grpo[s]["entropy"]["last_fifth"] for s in paired])
    out["G3"] = {**g3, "pass": g3["mean"] > 0 and g3["p"] < 0.05}

    g4 = t_interval([r[TEST]["pass_end"] - r[TEST]["pass_start"] for r in a])
    out["G4"] = {**g4, "pass": g4["mean"] <= 1.0 and out["G1"]["pass"]}

    endpoints = {
        "test Avg@n gain": lambda r: r[TEST]["avg_end"] - r[TEST]["avg_start"],
        "test Avg@n end": lambda r: r[TEST]["avg_end"],
        "test Pass@n end": lambda r: r[TEST]["pass_end"],
        "val Avg@n end": lambda r: r[VAL]["avg_end"] if VAL in r else math.nan,
        "entropy, last fifth": lambda r: r["entropy"]["last_fifth"],
    }
    fam = {}
    if len(a) >= 2 and len(b) >= 2:
        for name, f in endpoints.items():
            xa, xb = [f(r) for r in a], [f(r) for r in b]
            res = stats.ttest_ind(xa, xb, equal_var=False)
            p = float(res.pvalue)  # nan only when both arms are constant: no evidence of a difference
            fam[name] = {"diff": float(np.mean(xa) - np.mean(xb)), "p": 1.0 if math.isnan(p) else p}
        adjusted = report_stats.holm([v["p"] for v in fam.values()])
        for v, adj in zip(fam.values(), adjusted):
            v["p_holm"] = float(adj)
    out["G5"] = {
        "family": fam,
        "family_size": len(fam),
        "n": [len(a), len(b)],
        "pass": bool(fam) and all(v["p_holm"] >= 0.05 for v in fam.values()),
    }
    return out


def fmt(x: float, nd: int = 1) -> str:
    return f"{x:+.{nd}f}"


def verdict(ok: bool) -> str:
    return "**passes**" if ok else "**fails**"


def render(g: dict, rows: list[dict]) -> str:
    n = rows[0][TEST]["n"] if rows else 0
    lines = [
        "# The organism's gate: positive controls",
        "",
        f"Generated by `scripts/organism_gate.py` from sweep organism_gate (grpo seeds {g['seeds']['grpo'][:1]}.."
        f"{g['seeds']['grpo'][-1:]}, dapo seeds {g['seeds']['dapo'][:1]}..{g['seeds']['dapo'][-1:]}); "
        f"endpoints at n = {n} samples per problem on the held-out test split. The seed is the unit of every test.",
        "",
        "| gate | passes when | value | verdict |",
        "|---|---|---|---|",
    ]
    g1, g2, g3, g4, g5 = (g[k] for k in ("G1", "G2", "G3", "G4", "G5"))
    lines.append(
        f"| G1 RL works | grpo's test Avg@{n} gain over its step 0 >= +8 points, 95% lower end > +4 "
        f"| {fmt(g1['mean'])} [{fmt(g1['lo'])}, {fmt(g1['hi'])}] points, {g1['n']} seeds | {verdict(g1['pass'])} |"
    )
    lines.append(
        f"| G2 entropy collapse | last fifth <= 0.5 x first fifth on >= 9 of 10 seeds | "
        f"{g2['hits']} of {g2['n']} seeds (ratios {min(g2['ratios']):.2f}-{max(g2['ratios']):.2f}, "
        f"median {float(np.median(g2['ratios'])):.2f}) | {verdict(g2['pass'])} |"
    )
    lines.append(
        f"| G3 clip-higher keeps entropy | dapo - grpo last-fifth entropy > 0, paired, p < 0.05 | "
        f"{g3['mean']:+.4f} [{g3['lo']:+.4f}, {g3['hi']:+.4f}] nats, p {g3['p']:.3g}, {g3['n']} pairs | {verdict(g3['pass'])} |"
    )
    lines.append(
        f"| G4 sharpening | grpo's test Pass@{n} end - base <= +1 point while G1 holds | "
        f"{fmt(g4['mean'])} [{fmt(g4['lo'])}, {fmt(g4['hi'])}] points | {verdict(g4['pass'])} |"
    )
    worst = min(g5["family"].values(), key=lambda v: v["p_holm"]) if g5["family"] else None
    lines.append(
        f"| G5 A/A draw (one) | grpo (seeds 0-9) vs grpo (seeds 10-19): nothing significant after Holm over "
        f"{g5['family_size']} endpoints | smallest Holm p "
        f"{worst['p_holm']:.3g} | {verdict(g5['pass'])} |"
        if worst
        else "| G5 A/A draw (one) | ... | not run | **not tested** |"
    )
    lines += [
        "",
        "G5's family (Welch t, grpo seeds 0-9 minus seeds 10-19). One A/A draw: the two sets of seeds are "
        "not told apart on these endpoints; one draw does not measure the false-positive rate.",
        "",
        "| endpoint | difference | p | Holm p |",
    ]
    lines.append("|---|---|---|---|")
    for name, v in g5["family"].items():
        lines.append(f"| {name} | {v['diff']:+.3g} | {v['p']:.3g} | {v['p_holm']:.3g} |")

    lines += ["", "## Measured, not gated (mean ± sd over seeds)", ""]
    lines.append(
        "| arm | seeds | test Avg@n start -> end | test Pass@n start -> end | val Avg@n end | entropy first -> last fifth | out of band | Q1 / Q2 / Q3 / Q4 of clip events | NSR band | length first -> last |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for method, seeds in (("grpo", A_SEEDS), ("dapo", A_SEEDS), ("grpo", B_SEEDS)):
        rs = [r for r in rows if r["method"] == method and r["seed"] in seeds]
        if not rs:
            continue

        def ms(vals, nd=1):
            v = np.asarray(vals, dtype=float)
            return f"{v.mean():.{nd}f} ± {v.std(ddof=1) if len(v) > 1 else 0:.{nd}f}"

        share = " / ".join(f"{np.mean([r['clip']['share'][q] for r in rs]):.0f}" for q in ("q1", "q2", "q3", "q4"))
        lines.append(
            f"| {method} | {min(seeds)}-{max(seeds)} ({len(rs)}) | {ms([r[TEST]['avg_start'] for r in rs])} -> "
            f"{ms([r[TEST]['avg_end'] for r in rs])} | {ms([r[TEST]['pass_start'] for r in rs])} -> "
            f"{ms([r[TEST]['pass_end'] for r in rs])} | {ms([r[VAL]['avg_end'] for r in rs if VAL in r])} | "
            f"{ms([r['entropy']['first_fifth'] for r in rs], 3)} -> {ms([r['entropy']['last_fifth'] for r in rs], 3)} | "
            f"{ms([r['clip']['out_of_band'] for r in rs], 2)}% | {share}% | "
            f"{ms([r['clip']['rescue_band'] for r in rs], 2)}% | "
            f"{ms([fifths(r['length'])[0] for r in rs])} -> {ms([fifths(r['length'])[1] for r in rs])} |"
        )
    lines += [
        "",
        "Out of band: tokens outside [0.8, 1.2] / all tokens the rule saw. Clip-event shares: each quadrant's "
        "out-of-band tokens / all four quadrants' (ABC-GRPO reports Q4 at about 41%). NSR band: tokens with "
        "A != 0 whose ratio lies in the band NSR rescues at its defaults (A > 0: r in (1.28, 1.38]; A < 0: r in "
        "[0.7, 0.8)) / all tokens with A != 0, from the log-ratio histograms of the last optimizer step of each "
        "rollout step (the most off-policy one). Length: completion tokens, "
        "mean of the first and the last fifth of rollout steps.",
        "",
        "![entropy](plots/organism_entropy.png)",
        "",
        "![pass@k](plots/organism_passk.png)",
        "",
    ]
    return "\n".join(lines)


# per_seed.csv: what the gates read of each run (`gates` takes these rows as it takes gate.json's)
PER_SEED = {
    "test_avg_start": (TEST, "avg_start"),
    "test_avg_end": (TEST, "avg_end"),
    "test_pass_start": (TEST, "pass_start"),
    "test_pass_end": (TEST, "pass_end"),
    "val_avg_end": (VAL, "avg_end"),
    "entropy_first_fifth": ("entropy", "first_fifth"),
    "entropy_last_fifth": ("entropy", "last_fifth"),
}


def write_per_seed(path: Path, rows: list[dict]) -> None:
    """One row per run: method, seed, run id and the endpoints the gates read (floats as Python
    writes them, so they read back bit for bit; blank where a run has none)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "seed", "run_id", *PER_SEED])
        for r in sorted(rows, key=lambda r: (r["method"], r["seed"])):
            vals = [repr(float(r[a][b])) if a in r and b in r[a] else "" for a, b in PER_SEED.values()]
            w.writerow([r["method"], r["seed"], r.get("run_id", ""), *vals])


def read_per_seed(path: Path) -> list[dict]:
    """per_seed.csv back as the rows `gates` reads (the entropy ratio is last / first fifth, as per_run
    computes it)."""
    out = []
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            row: dict = {"method": rec["method"], "seed": int(rec["seed"]), "run_id": rec["run_id"]}
            for col, (a, b) in PER_SEED.items():
                if rec[col] != "":
                    row.setdefault(a, {})[b] = float(rec[col])
            e = row["entropy"]
            e["ratio"] = e["last_fifth"] / e["first_fifth"]
            out.append(row)
    return out


def plots(rows: list[dict], out: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only for the figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for method, color in (("grpo", "tab:blue"), ("dapo", "tab:orange")):
        series = [r["entropy"]["series"] for r in rows if r["method"] == method and r["seed"] in A_SEEDS]
        if not series:
            continue
        m = min(map(len, series))
        arr = np.array([s[:m] for s in series])
        mean, sd = arr.mean(0), arr.std(0, ddof=1) if len(arr) > 1 else np.zeros(m)
        x = np.arange(m)
        ax.plot(x, mean, color=color, label=f"{method} ({len(arr)} seeds)")
        ax.fill_between(x, mean - sd, mean + sd, color=color, alpha=0.2)
    ax.set_xlabel("rollout step")
    ax.set_ylabel("mean token entropy (nats)")
    ax.set_title("Entropy over training (mean ± sd over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "organism_entropy.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    a = [r for r in rows if r["method"] == "grpo" and r["seed"] in A_SEEDS]
    if a:
        kk = sorted(a[0][TEST]["passk_end"])
        for key, name, color in (
            ("passk_start", "base model (step 0)", "gray"),
            ("passk_end", "grpo (end)", "tab:blue"),
        ):
            arr = np.array([[r[TEST][key][k] for k in kk] for r in a])
            ax.errorbar(
                kk, arr.mean(0), yerr=arr.std(0, ddof=1) if len(arr) > 1 else None, label=name, color=color, capsize=2
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("Pass@k, test (%)")
        ax.set_title("Pass@k: base model and grpo (mean ± sd over seeds)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "organism_passk.png", dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--sweep", default="organism_gate")
    ap.add_argument("--out", default="docs/studies/organism")
    ap.add_argument("--from-json", help="a gate.json: rewrite gate.md and per_seed.csv from it, without the store")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        out.mkdir(parents=True, exist_ok=True)
        (out / "gate.md").write_text(render(saved["gates"], saved["runs"]))
        write_per_seed(out / "per_seed.csv", saved["runs"])
        return 0
    sweep = load_results(args.results_dir, args.sweep)
    finished = [r for r in sweep.runs if r.state == "finished"]
    if not finished:
        print(f"organism_gate: no finished runs in sweep {args.sweep}", file=sys.stderr)
        return 2
    rows = [per_run(r) for r in finished]
    g = gates(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gate.md").write_text(render(g, rows))
    (out / "gate.json").write_text(json.dumps({"gates": g, "runs": rows}, indent=1, default=float) + "\n")
    write_per_seed(out / "per_seed.csv", rows)
    plots(rows, out / "plots")
    print(
        f"{len(finished)} finished runs of {len(sweep.runs)}; gates: "
        + ", ".join(f"{k} {'pass' if g[k]['pass'] else 'fail'}" for k in ("G1", "G2", "G3", "G4", "G5"))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
