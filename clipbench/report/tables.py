"""Display tables (strings) from the numbers of ``analysis.analyze``; every renderer reads these.

Tables of a report, per block (base model):
- ``table3``: the paper's Table 3 layout: per benchmark one row per method, Avg@n and Pass@k
  (k = 2, 4, ..., n), mean +- std over seeds in %, an Average block and Gain rows (% vs the
  baseline), the paper's reference rows inline when model and benchmark are the paper's;
- ``significance``: Avg@n and Pass@n with 95% CIs over problems (within-seed sampling noise only),
  the difference from the baseline (percentage points) with its interval and p over seeds (a paired t,
  the seed the unit) and the Holm-adjusted p over the methods compared;
and once: ``quadrants`` (share of clip events per quadrant, like the paper's Figure 4f), ``dynamics``
(entropy and sampled accuracy early vs late, the off-policy out-of-band share), ``runs`` (every run:
state, skipped steps, collapse flags, why it is not compared) and, for a grpo-vs-abc sweep on other
models, ``paper_reference`` (the paper's Table 3 as printed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from clipbench.report import health
from clipbench.report import paper as paper_ref
from clipbench.report.analysis import BASE_LABEL, QUADRANTS

BENCH_ORDER = ("aime24", "aime25", "amc23", "math500", "gsm8k", "arith", "arith-val")
BENCH_TITLES = {
    "aime24": "AIME24",
    "aime25": "AIME25",
    "amc23": "AMC23",
    "math500": "MATH500",
    "gsm8k": "GSM8K",
    "arith": "arith",
    "arith-val": "arith (validation)",
}
QUADRANT_TITLES = {"q1": "Q1 (A>0, r>1)", "q2": "Q2 (A>0, r<1)", "q3": "Q3 (A<0, r<1)", "q4": "Q4 (A<0, r>1)"}


@dataclass
class Table:
    key: str  # table3 | significance | quadrants | runs | paper_reference
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    styles: list[str] = field(default_factory=list)  # per row: "" | base | ref | gain | refgain | excluded | flagged
    notes: list[str] = field(default_factory=list)
    beside: str | None = None  # key of a table to show next to this one (html)
    sections: bool = True  # a non-empty first cell starts a new section (a rule above it)

    def add(self, cells: list[str], style: str = "") -> None:
        assert len(cells) == len(self.columns), (cells, self.columns)
        self.rows.append([str(c) for c in cells])
        self.styles.append(style)


# ---- formatting -------------------------------------------------------------------------------


def pct(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def mean_std_cell(cell: dict, seeds: int) -> str:
    s = pct(cell["mean"])
    return f"{s} ± {100 * cell['std']:.1f}" if seeds > 1 and s else s


def gain_cell(g: float | None) -> str:
    return "" if g is None else f"{g:+.1f}%"


def p_cell(p: float | None) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return ""
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def ci_cell(cell: dict) -> str:
    """'mean [lo, hi]' in %, the interval clipped to [0, 100] (a t interval of a proportion can leave it)."""
    lo, hi = cell["ci"]
    return f"{pct(cell['mean'])} [{pct(max(lo, 0.0))}, {pct(min(hi, 1.0))}]"


def metric_title(metric: str, n: int) -> str:
    return f"Avg@{n}" if metric == "avg" else "Pass@" + metric.split("@")[1]


def ordered_benchmarks(benches) -> list[str]:
    known = [b for b in BENCH_ORDER if b in benches]
    return known + sorted(b for b in benches if b not in BENCH_ORDER)


def model_title(model: str) -> str:
    return model.rstrip("/").rsplit("/", 1)[-1]


def ordered_labels(block: dict, baseline: str | None) -> list[str]:
    labels = list(block["labels"])
    return ([baseline] if baseline in labels else []) + [lb for lb in labels if lb != baseline]


# ---- Table 3 layout ---------------------------------------------------------------------------


def table3(block: dict, baseline: str | None, paper: dict | None) -> Table:
    n, metrics = block["n"], block["metrics"]
    cols = ["Benchmark", "Method", "Seeds"] + [metric_title(m, n) for m in metrics]
    t = Table("table3", f"Table 3 layout: {model_title(block['model'])} (Avg@{n} / Pass@k, %)", cols)
    paper_key = paper_ref.paper_model_key(block["model"], paper) if paper else None
    labels = ordered_labels(block, baseline)

    def section(bench_title: str, entry: dict, gains: dict, bench_key: str) -> None:
        first = [True]

        def row(method: str, seeds: str, values: list[str], style: str = "") -> None:
            t.add([bench_title if first[0] else "", method, seeds, *values], style)
            first[0] = False

        paper_benches = set(paper["models"][paper_key]["rows"]) - {"average"} if paper_key else set()
        comparable = bench_key in paper_benches or (
            bench_key == "average" and set(block["average"]["benchmarks"]) == paper_benches
        )
        if paper_key is not None and comparable:
            titles = paper["models"][paper_key]["row_titles"]
            for m in paper_ref.PAPER_METHODS:
                vals = [paper_ref.paper_value(paper, paper_key, bench_key, m, metric) for metric in metrics]
                row(f"paper: {titles[m]}", "", ["" if v is None else f"{v:.1f}" for v in vals], "ref")
            vals = [paper_ref.paper_value(paper, paper_key, bench_key, "gain", metric) for metric in metrics]
            row("paper: Gain (ABC-GRPO vs GRPO)", "", [gain_cell(v) for v in vals], "refgain")
        if entry.get("base"):
            b = entry["base"]
            row(BASE_LABEL, str(b["seeds"]), [mean_std_cell(b["metrics"][m], b["seeds"]) for m in metrics], "base")
        for lb in labels:
            r = entry["rows"].get(lb)
            if r is not None:
                row(
                    lb,
                    str(r["seeds"]),
                    [mean_std_cell(r["metrics"][m], r["seeds"]) for m in metrics],
                    "baseline" if lb == baseline else "",
                )
        for lb in labels:
            g = gains.get(lb, {}).get(bench_key)
            if g is not None:
                row(f"Gain: {lb} vs {baseline}", "", [gain_cell(g.get(m)) for m in metrics], "gain")

    for bench in ordered_benchmarks(block["benchmarks"]):
        entry = block["benchmarks"][bench]
        title = f"{BENCH_TITLES.get(bench, bench)} (P={entry['problems']})"
        section(title, entry, block["gain"], bench)
    avg = block["average"]
    if len(block["benchmarks"]) > 1 and avg["rows"]:
        problems = sum(block["benchmarks"][b]["problems"] for b in avg["benchmarks"])
        section(f"Average ({len(avg['benchmarks'])} benchmarks, P={problems})", avg, block["gain"], "average")
    t.notes = [
        f"Each cell: mean ± std over seeds (Seeds column; no ± with one seed) of the mean over the "
        f"benchmark's problems (P in the Benchmark column), in %; n = {n} samples per problem, "
        f"Pass@k is the unbiased estimator; the final evaluation (largest step) of every run.",
    ]
    if baseline:
        t.notes.append(
            f"Gain = (method - baseline) / baseline x 100 on the unrounded means, as the paper's "
            f"Gain row; blank when the baseline is 0. Baseline: {baseline}."
        )
    if any(block["benchmarks"][b].get("base") for b in block["benchmarks"]):
        t.notes.append(f"'{BASE_LABEL}': the evaluation before training of the baseline runs (the base model).")
    if paper_key is not None:
        t.notes.append(
            "'paper:' rows: ABC-GRPO paper (arXiv 2601.03895) Table 3 as printed (Avg@64, Pass@k, "
            "n = 64); blank where the paper leaves it blank or has no such column."
        )
    return t


# ---- significance -----------------------------------------------------------------------------


def delta_cell(c: dict) -> str:
    """'+3.1 [-0.4, +6.6]': method - baseline in points, the mean over paired seeds and its t interval."""
    delta = c.get("delta")
    if delta is None or not math.isfinite(delta):
        return ""
    lo, hi = c.get("delta_ci") or (math.nan, math.nan)
    ci = f" [{100 * lo:+.1f}, {100 * hi:+.1f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"{100 * delta:+.1f}{ci}"


def significance(block: dict, baseline: str | None, resamples: int, seed: int, prereg: int | None = None) -> Table:
    """`prereg`: the size of the preregistered family the report tests; its comparisons are then the
    report's only tests, so this table adjusts none of its own (no Holm over its methods: that would
    be a second family, and a second adjusted p for the same comparison)."""
    n, metrics = block["n"], block["metrics"]
    headline = [metrics[0]] + ([metrics[-1]] if len(metrics) > 1 else [])
    cols = ["Benchmark", "Method", "Seeds x problems"]
    for m in headline:
        cols += [f"{metric_title(m, n)} [95% CI, problems]", "Δ (pp) [95% CI, seeds]", "p (seeds)"]
        cols += [] if prereg else ["p Holm"]
    t = Table("significance", f"Significance vs {baseline or '(no baseline)'}: {model_title(block['model'])}", cols)
    entries = [(b, block["benchmarks"][b]) for b in ordered_benchmarks(block["benchmarks"])]
    if len(entries) > 1 and block["average"]["rows"]:
        entries.append(("average", block["average"]))
    family = 0
    for bench, entry in entries:
        first = True
        for lb in ordered_labels(block, baseline):
            r = entry["rows"].get(lb)
            if r is None:
                continue
            title = "Average" if bench == "average" else BENCH_TITLES.get(bench, bench)
            cells = [title if first else "", lb, f"{r['seeds']} x {r['problems']}"]
            for m in headline:
                c = r["metrics"][m]
                family = max(family, c.get("family") or 0)
                cells += [ci_cell(c), delta_cell(c), p_cell(c.get("p"))]
                cells += [] if prereg else [p_cell(c.get("p_holm"))]
            t.add(cells, "baseline" if lb == baseline else "")
            first = False
    t.notes = [
        "[95% CI, problems]: Student t interval over problems of the per-problem values (each problem's value "
        "averaged over seeds first), clipped to [0, 100]; for Average, the benchmarks' standard errors combined "
        "(Welch-Satterthwaite df). It shows within-seed sampling noise only (the problems drawn), not how much "
        "another seed's run would differ.",
        "Δ: method - baseline in percentage points, each seed's mean over its problems paired by seed; its "
        "95% CI and p (two-sided): a paired t over the seeds' differences (scipy.stats.ttest_1samp; the seed is "
        "the unit; blank with fewer than 2 paired seeds). "
        + (
            f"p (seeds) is each comparison's own test, uncorrected and not a verdict: the report tests the "
            f"preregistered family of {prereg} claims (the claims table, Holm over the {prereg})."
            if prereg
            else f"p Holm: Holm's correction over the {family} method(s) compared with the baseline on that row's "
            "benchmark and metric (statsmodels multipletests); a difference is significant at 0.05 only when "
            "p Holm < 0.05."
        ),
        f"report.json keeps p_problems: the paired bootstrap over problems ({resamples} resamples, "
        f"default_rng({seed})), within-seed sampling noise only (it speaks for these trained models, not for a rerun).",
    ]
    return t


def aggregates_table(block: dict, baseline: str | None) -> Table | None:
    """rliable's aggregates per label (analysis.aggregates): IQM, probability of improvement over the
    baseline, the share of runs above the base model."""
    agg = block.get("aggregates") or {}
    if not agg:
        return None
    n = block["n"]
    cols = ["Method", "Runs x tasks", f"IQM Avg@{n} [95% CI]", f"P(> {baseline or 'baseline'}) [95% CI]", "Above base"]
    t = Table("aggregates", f"Aggregates over runs (rliable): {model_title(block['model'])}", cols, sections=False)
    for lb in ordered_labels(block, baseline):
        e = agg.get(lb)
        if e is None:
            continue
        lo, hi = e["iqm_ci"]
        iqm = f"{100 * e['iqm']:.1f}" + (f" [{100 * lo:.1f}, {100 * hi:.1f}]" if math.isfinite(lo) else "")
        poi = ""
        if e.get("poi") is not None:
            plo, phi = e["poi_ci"]
            poi = f"{e['poi']:.2f}" + (f" [{plo:.2f}, {phi:.2f}]" if math.isfinite(plo) else "")
        above = "" if e.get("above_base") is None else f"{100 * e['above_base']:.0f}%"
        t.add(
            [lb, f"{e['runs'] // max(e['tasks'], 1)} x {e['tasks']}", iqm, poi, above],
            "baseline" if lb == baseline else "",
        )
    tasks = block.get("aggregate_tasks")
    t.notes = [
        f"Tasks: {', '.join(tasks)}." if tasks is not None and tasks != list(block["benchmarks"]) else "",
        "One score per run and benchmark (its final Avg@n; the benchmarks are the tasks). IQM: the interquartile "
        "mean over all run x task scores (rliable.metrics.aggregate_iqm), robust to a collapsed run and less "
        "noisy than the median. P(> baseline): the probability of improvement, the mean over tasks of "
        "P(X > Y) + P(X = Y) / 2 between a run of the method and one of the baseline (rliable.metrics). 95% "
        "CIs: percentile stratified bootstrap (each task's runs resampled on their own; scipy.stats.bootstrap). "
        "Above base: the share of run x task scores above the base model's mean (one point of the performance "
        "profile, kept in full in report.json). Agarwal et al., 'Deep RL at the edge of the statistical "
        "precipice' (2021).",
    ]
    t.notes = [x for x in t.notes if x]
    return t


# ---- clip quadrants ---------------------------------------------------------------------------


def quadrants(q_by_block: dict, baseline: str | None, paper: dict | None, show_paper: bool) -> Table | None:
    cols = (
        ["Method", "Seeds", "Clip events"]
        + [QUADRANT_TITLES[q] for q in QUADRANTS]
        + ["Out of band (% tok)", "Zero-grad (% tok)", "Rescued (% tok)"]
    )
    t = Table("quadrants", "Clip events by quadrant (% of out-of-band tokens, summed over steps)", cols, sections=False)
    multi = len(q_by_block) > 1
    for model, q in q_by_block.items():
        labels = ([baseline] if baseline in q else []) + [lb for lb in q if lb != baseline]
        for lb in labels:
            e = q[lb]
            s = e["seeds"]

            def ms(d):
                if d["mean"] is None or math.isnan(d["mean"]):
                    return ""
                return f"{d['mean']:.1f} ± {d['std']:.1f}" if s > 1 else f"{d['mean']:.1f}"

            name = f"{model_title(model)}: {lb}" if multi else lb
            t.add(
                [name, str(s), f"{int(e['events']):,}"]
                + [ms(e["share"][k]) for k in QUADRANTS]
                + [ms(e["out_of_band"]), ms(e["zero_grad"]), ms(e["rescued"])]
            )
    if not t.rows:
        return None
    if show_paper and paper:
        f = paper["figure4f"]
        shares = f["share_of_clip_events_percent"]
        t.add(
            [f"paper: GRPO, {model_title(f['model'])} (Fig. 4f)", "", ""]
            + [f"{shares[k]:.1f}" for k in QUADRANTS]
            + ["", "", ""],
            "ref",
        )
    t.notes = [
        "A clip event is a token outside the run's reference band [1 - eps_low, 1 + eps_high] (0.2/0.2 for "
        "methods without eps). Quadrant shares: each quadrant's events / all Q1-Q4 events over all optimizer "
        "steps of a run, then mean ± std over seeds (they sum to 100% per run).",
        "Out of band / zero-grad / rescued: tokens of all cells (incl. zero advantage) / all tokens.",
    ]
    if show_paper and paper:
        t.notes.append(
            "paper row: the ABC-GRPO paper's Section 5.4 / Figure 4f as printed (its four shares sum to 88.4%)."
        )
    return t


# ---- where the gradient flows ----------------------------------------------------------------


def gradient_mass(q_by_block: dict, baseline: str | None) -> Table | None:
    """Shares of gradient magnitude per quadrant: what the clip counts alone do not say (a rule may
    clip many Q4 tokens that carried little gradient, or rescue few tokens that carry much)."""
    cols = ["Method", "Seeds"] + [QUADRANT_TITLES[q] for q in QUADRANTS] + ["Rescued (% of |g|)"]
    t = Table(
        "gradient_mass",
        "Gradient magnitude by quadrant (% of the sum of |g| over Q1-Q4, summed over steps)",
        cols,
        sections=False,
    )
    multi = len(q_by_block) > 1
    for model, q in q_by_block.items():
        for lb in ([baseline] if baseline in q else []) + [lb for lb in q if lb != baseline]:
            e, s = q[lb], q[lb]["seeds"]
            if "grad_share" not in e or all(math.isnan(e["grad_share"][k]["mean"] or math.nan) for k in QUADRANTS):
                continue

            def ms(d):
                if d["mean"] is None or math.isnan(d["mean"]):
                    return ""
                return f"{d['mean']:.1f} ± {d['std']:.1f}" if s > 1 else f"{d['mean']:.1f}"

            name = f"{model_title(model)}: {lb}" if multi else lb
            t.add([name, str(s)] + [ms(e["grad_share"][k]) for k in QUADRANTS] + [ms(e["rescued_grad"])])
    if not t.rows:
        return None
    t.notes = [
        "g = d loss_t / d logp_t per token, the rule's own gradient before aggregation (docs/metrics.md). "
        "Quadrant shares: each quadrant's sum of |g| / the sum over Q1-Q4, per run, then mean ± std over "
        "seeds. Rescued: |g| of tokens past the clip bound that kept the unclipped gradient / all |g|."
    ]
    return t


# ---- every run: state, steps, skipped steps, flags ----------------------------------------------


def runs_table(result: dict) -> Table:
    """One row per run of the sweep (compared or not): what a careful reader checks before the numbers."""
    cols = ["Method", "Seed", "Run", "State", "Steps", "Skipped steps", "Flags"]
    t = Table("runs", "Runs: state, skipped optimizer steps and collapse flags", cols, sections=False)
    excluded = {e["run_id"]: e["reason"] for e in result["runs"]["excluded"]}
    for rid, h in sorted(result["health"].items(), key=lambda kv: (kv[1]["label"], kv[1]["seed"], kv[0])):
        steps = f"{h['steps_done']}/{h['steps']}" if h["steps"] else str(h["steps_done"])
        skipped = f"{h['skipped']} ({100 * h['skipped_frac']:.1f}%)" if h["skipped"] else "0"
        flags = ([f"not compared: {excluded[rid]}"] if rid in excluded else []) + [
            f for f in h["flags"] if not f.startswith("skipped ")
        ]
        t.add(
            [h["label"], str(h["seed"]), rid, h["state"], steps, skipped, "; ".join(flags) or "ok"],
            "excluded" if rid in excluded else ("flagged" if flags or h["skipped"] else ""),
        )
    t.notes = [
        "Compared: runs that finished with their evaluation at the last step; the others are listed here and "
        "left out of every other table (a failed run's step-0 score is the base model's, not its method's).",
        health.RULES,
    ]
    return t


# ---- training dynamics --------------------------------------------------------------------------


def collapse_text(flagged: int, runs: int, kinds: dict[str, int]) -> str:
    """'3/10: reward collapse 3, accuracy collapse 3': runs flagged with a kind of collapse, per kind."""
    return f"{flagged}/{runs}" + (": " + ", ".join(f"{k} {n}" for k, n in kinds.items()) if flagged else "")


def collapse_counts(result: dict) -> dict[tuple[str, str], str]:
    """{(model, label): collapse_text} over each label's compared runs (health kinds, health.KINDS order)."""
    health_of = result.get("health") or {}
    out = {}
    for block in result["blocks"]:
        for lb, info in block["labels"].items():
            kinds_per_run = [(health_of.get(rid) or {}).get("kinds") or [] for rid in info["run_ids"]]
            counts = {k: sum(k in ks for ks in kinds_per_run) for k in health.KINDS}
            out[(block["model"], lb)] = collapse_text(
                sum(bool(ks) for ks in kinds_per_run), len(kinds_per_run), {k: n for k, n in counts.items() if n}
            )
    return out


def dynamics(
    dyn_by_block: dict, baseline: str | None, collapsed: dict[tuple[str, str], str] | None = None
) -> Table | None:
    cols = [
        "Method",
        "Seeds",
        "Entropy first → last (nats)",
        "Sampled accuracy first → last (%)",
        "Out of band, off-policy (% tok)",
        "Completion (tok)",
        "Collapsed (runs: kinds)",
    ]
    t = Table(
        "dynamics", "Training dynamics (first → last fifth of training, mean ± std over seeds)", cols, sections=False
    )
    multi = len(dyn_by_block) > 1
    for model, dyn in dyn_by_block.items():
        for lb in ([baseline] if baseline in dyn else []) + [lb for lb in dyn if lb != baseline]:
            e, s = dyn[lb], dyn[lb]["seeds"]

            def ms(d, fmt, scale=1.0):
                if d["mean"] is None or math.isnan(d["mean"]):
                    return ""
                v = format(scale * d["mean"], fmt)
                return f"{v} ± {format(scale * d['std'], fmt)}" if s > 1 else v

            name = f"{model_title(model)}: {lb}" if multi else lb
            t.add(
                [
                    name,
                    str(s),
                    f"{ms(e['entropy']['first'], '.3f')} → {ms(e['entropy']['last'], '.3f')}",
                    f"{ms(e['accuracy']['first'], '.1f', 100)} → {ms(e['accuracy']['last'], '.1f', 100)}",
                    ms(e["off_policy_out_of_band"], ".1f"),
                    ms(e["completion_tokens"], ".1f"),
                    (collapsed or {}).get((model, lb), ""),
                ]
            )
    if not t.rows:
        return None
    t.notes = [
        "Entropy: token entropy of the policy on its own rollouts, mean of the first / last fifth of the "
        "optimizer steps. Sampled accuracy: the rollouts' accuracy, first / last fifth of the rollout "
        "steps. Out of band, off-policy: tokens with A != 0 outside the run's reference band / all tokens "
        "with A != 0, over the optimizer steps after the first of each rollout step (the first is "
        "on-policy, every ratio is 1). Collapsed: the method's compared runs whose health flags name a kind "
        "of collapse, counted per kind (a run may have several; thresholds in the Runs table's notes)."
    ]
    return t


# ---- the paper's Table 3 as a reference -------------------------------------------------------


def paper_reference(paper: dict) -> Table:
    cols = ["Benchmark", "Method"] + paper["column_titles"]
    t = Table("paper_reference", "Reference: ABC-GRPO paper, Table 3 (Qwen3 base models, n = 64, %)", cols)
    for _key, model in paper["models"].items():
        for bench, rows in model["rows"].items():
            title = f"{model['title']}: {paper['benchmarks'][bench]}"
            for i, m in enumerate(paper_ref.PAPER_METHODS):
                t.add(
                    [title if i == 0 else "", model["row_titles"][m]] + [f"{v:.1f}" for v in rows[m]],
                    "baseline" if m == "grpo" else "",
                )
            t.add(["", "Gain"] + [gain_cell(v) for v in rows["gain"]], "gain")
    t.notes = [
        "Printed for reference only: different models, benchmarks and scale from this sweep. Compare the "
        "shape (which method wins, how the Gain grows with k), not the numbers."
    ]
    return t


def build_tables(result: dict, paper: dict | None) -> list[Table]:
    baseline = result["baseline"]
    methods = {info["method"] for b in result["blocks"] for info in b["labels"].values()}
    show_paper = paper is not None and paper_ref.compares_grpo_abc(methods)
    tables: list[Table] = []
    inline = False
    for block in result["blocks"]:
        if not block["labels"]:
            continue
        t = table3(block, baseline, paper if show_paper else None)
        inline |= any(s == "ref" for s in t.styles)
        tables.append(t)
        if baseline:
            boot = result["bootstrap"]
            prereg = (result.get("prereg") or {}).get("tested")
            tables.append(significance(block, baseline, boot["resamples"], boot["seed"], prereg))
        agg = aggregates_table(block, baseline)
        if agg is not None:
            tables.append(agg)
    if show_paper and not inline:
        ref = paper_reference(paper)
        for t in tables:
            if t.key == "table3":
                t.beside = ref.key
        tables.insert(1 if tables else 0, ref)
    q = quadrants(result["quadrants"], baseline, paper, show_paper)
    if q is not None:
        tables.append(q)
    g = gradient_mass(result["quadrants"], baseline)
    if g is not None:
        tables.append(g)
    d = dynamics(result.get("dynamics", {}), baseline, collapse_counts(result))
    if d is not None:
        tables.append(d)
    if result.get("health"):
        tables.append(runs_table(result))
    return tables
