"""The report's figures (matplotlib, Agg backend, PNG): one line per method, its seed band shaded.

    figs = make_figures(sweep, result)   # {name: Figure}, Pass@k against k first
    paths = save_figures(figs, out_dir)  # {name: Path to PNG}

Lines are the mean over seeds; the shaded band is its 95% Student t interval over the seeds (where at
least two have a value); every series keeps one style across the figures, distinct for many rules
(plots_style.py). A sparse series (at most `SPARSE_POINTS` points, or a point with no neighbour to draw a
line to) gets markers, so a single point is never invisible; series that coincide exactly (one would
hide the other) are named in a note under the title. Figures: ``passk`` (Pass@k against k, the base
model and each rule, log-2 axis; plots_final.py), ``stability`` (for a sweep with a learning-rate axis:
gain over the base model vs learning rate per rule, t intervals over seeds; report/stability.py),
``entropy`` (token entropy per optimizer step), ``reward`` (mean reward per rollout step), ``eval``
(Avg@n and Pass@n per benchmark over the evaluation steps), ``quadrants`` (each rule's clip events by
quadrant, a stacked bar with the counts; plots_final.py) and ``log_ratio_hist`` (the distribution of
log r pooled over steps and seeds, split by the sign of A, with the clip bounds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from clipbench.report import stats
from clipbench.report.load import RunRecord, Sweep
from clipbench.report.plots_final import passk_figure, quadrant_figure
from clipbench.report.plots_style import (  # noqa: F401 - _is_sparse, png, close_figures: the report's and tests' names
    DPI,
    _is_sparse,
    close_figures,
    draw_band,
    finish,
    png,
    seed_frame,
    series_styles,
)
from clipbench.report.tables import BENCH_TITLES, metric_title, model_title, ordered_benchmarks

DODGE = 1.02  # the stability figure's rules are drawn this factor apart on the (log) rate axis
Styles = Mapping[str, Mapping]


def _styles(styles: Styles | None, names: Sequence[str]) -> Styles:
    """The report's styles of these series, or their own when a name has none."""
    return styles if styles is not None and all(n in styles for n in names) else series_styles(list(names))


def series_key(run: RunRecord, multi_block: bool) -> str:
    return f"{model_title(run.model)}: {run.label}" if multi_block else run.label


def group_runs(
    sweep: Sweep, baseline: str | None = None, exclude: frozenset[str] = frozenset()
) -> dict[str, list[RunRecord]]:
    """{series name: runs (seeds)}: the baseline's series first, then in label order; runs whose id
    is in `exclude` (not compared: failed, unfinished) are left out."""
    multi = len(sweep.blocks()) > 1
    runs = sorted((r for r in sweep.runs if r.run_id not in exclude), key=lambda r: r.label != baseline)
    out: dict[str, list[RunRecord]] = {}
    for r in runs:
        out.setdefault(series_key(r, multi), []).append(r)
    return out


def metric_by(run: RunRecord, key: str, x: str) -> dict[float, float]:
    """{x: mean of metric ``key`` over the rows with that x} from metrics.jsonl."""
    acc: dict[float, list[float]] = {}
    for row in run.metrics:
        v = row.get(key)
        if x in row and isinstance(v, (int, float)) and math.isfinite(v):
            acc.setdefault(float(row[x]), []).append(float(v))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def line_figure(
    groups: Mapping[str, list[RunRecord]],
    key: str,
    x: str,
    title: str,
    ylabel: str,
    scale: float = 1.0,
    styles: Styles | None = None,
) -> Figure | None:
    frames = {name: seed_frame(rs, lambda r: metric_by(r, key, x)) * scale for name, rs in groups.items()}
    frames = {k: v for k, v in frames.items() if not v.empty}
    if not frames:
        return None
    styles = _styles(styles, list(groups))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=DPI)
    drawn = {name: draw_band(ax, frame, name, styles[name]) for name, frame in frames.items()}
    ax.set_xlabel("optimizer step" if x == "opt_step" else "rollout step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return finish(fig, ax, f"{title} (mean over seeds; band: 95% t CI)", [drawn])


def _first_key(groups: Mapping[str, list[RunRecord]], candidates: Sequence[str]) -> str | None:
    for key in candidates:
        if any(key in row for rs in groups.values() for r in rs for row in r.metrics[:50]):
            return key
    return None


def eval_figure(groups: Mapping[str, list[RunRecord]], result: dict, styles: Styles | None = None) -> Figure | None:
    """Avg@n and Pass@n (largest k) per benchmark over the evaluation steps."""
    styles = _styles(styles, list(groups))
    benches = ordered_benchmarks({b for blk in result["blocks"] for b in blk["benchmarks"]})
    n = min((blk["n"] for blk in result["blocks"] if blk["n"]), default=0)
    # a curve's points share one n: the smallest of every evaluation drawn (eval.n_ends samples the
    # endpoints more than the steps between)
    n = min([n, *(int(p["n"]) for rs in groups.values() for r in rs for ps in r.evals.values() for p in ps.values())])
    if not benches or not n:
        return None
    metrics = ["avg"] + ([f"pass@{n}"] if n > 1 else [])
    ks = [n] if n > 1 else []

    def extract(run: RunRecord, bench: str, metric: str) -> dict[float, float]:
        out = {}
        for step, payloads in run.evals.items():
            p = payloads.get(bench)
            if p is not None:
                correct = np.asarray(p["correct"], dtype=float)[:, :n]  # (P, n): the common n
                out[float(step)] = 100 * float(stats.per_problem_values(correct, ks)[metric].mean())
        return out

    fig, axes = plt.subplots(
        len(benches), len(metrics), figsize=(11, 3.2 * len(benches) + 0.8), dpi=DPI, squeeze=False
    )  # one row per benchmark: Avg@n | Pass@n
    panels = []
    for i, bench in enumerate(benches):
        for j, metric in enumerate(metrics):
            ax = axes[i][j]
            panels.append(
                {
                    name: draw_band(ax, seed_frame(rs, lambda r: extract(r, bench, metric)), name, styles[name])
                    for name, rs in groups.items()
                }
            )
            ax.set_title(f"{BENCH_TITLES.get(bench, bench)}: {metric_title(metric, n)}", fontsize=10)
            ax.set_xlabel("rollout step")
            ax.set_ylabel("%")
            ax.grid(alpha=0.3)
    return finish(fig, axes, f"Evaluation over training (n = {n}; mean over seeds; band: 95% t CI)", panels)


def _hist_arrays(run: RunRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(bin centres (B,), pos counts (B,), neg counts (B,)) summed over steps; under/overflow dropped."""
    if not run.hist:
        return None
    edges = np.asarray(run.hist[0]["edges"], dtype=float)
    pos = np.zeros(len(edges) + 1)
    neg = np.zeros(len(edges) + 1)
    for row in run.hist:
        p, m = np.asarray(row["pos"], dtype=float), np.asarray(row["neg"], dtype=float)
        if len(p) == len(edges) - 1:  # plain bins: pad with empty under/overflow
            p, m = np.pad(p, 1), np.pad(m, 1)
        pos += p
        neg += m
    centres = (edges[:-1] + edges[1:]) / 2
    return centres, pos[1:-1], neg[1:-1]


def hist_figure(groups: Mapping[str, list[RunRecord]], styles: Styles | None = None) -> Figure | None:
    data = {name: [h for h in (_hist_arrays(r) for r in rs) if h is not None] for name, rs in groups.items()}
    data = {k: v for k, v in data.items() if v}
    if not data:
        return None
    styles = _styles(styles, list(groups))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), dpi=DPI, sharey=True)
    for name, hs in data.items():
        color, linestyle = styles[name]["color"], styles[name]["linestyle"]
        centres = hs[0][0]
        for ax, idx, sign in ((axes[0], 1, "A > 0"), (axes[1], 2, "A < 0")):
            counts = np.sum([h[idx] for h in hs if len(h[idx]) == len(centres)], axis=0)
            total = counts.sum()
            if total > 0:
                ax.step(
                    centres, counts / total, where="mid", label=name, color=color, linestyle=linestyle, linewidth=1.4
                )
            ax.set_title(f"log r, tokens with {sign}", fontsize=10)
        bands = groups[name][0].ref_bands()  # the run's own bounds, per sign of A
        for ax, sign in ((axes[0], "pos"), (axes[1], "neg")):
            for b in bands[sign] if bands else ():
                if b > 0:
                    ax.axvline(math.log(b), color=color, linestyle="--", linewidth=0.8, alpha=0.7)
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel("log r = logp - old_logp")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of tokens (pooled over steps and seeds)")
    return finish(
        fig,
        axes,
        "Log-ratio near the clip bounds (dashed: each method's reference band, log(lo) and log(hi), for its sign of A)",
    )


def stability_figure(stab: Mapping | None) -> Figure | None:
    """Gain over the base model vs learning rate, one line per rule (mean over seeds, 95% t interval
    over seeds as error bars; the rules a few percent apart on the rate axis so their intervals stay
    visible), and the share of runs flagged as collapsed; one row per base model."""
    if not stab:
        return None
    fig, axes = plt.subplots(
        len(stab), 2, figsize=(12, 4.4 * len(stab) + 0.8), dpi=DPI, squeeze=False, gridspec_kw={"width_ratios": [3, 2]}
    )
    for row, (model, block) in enumerate(stab.items()):
        ax, ax_c = axes[row]
        count = len(block["rules"])
        rule_styles = series_styles(list(block["rules"]))
        for i, (rule, info) in enumerate(block["rules"].items()):
            rates = sorted(info["cells"])
            dodge = [r * DODGE ** (i - (count - 1) / 2) for r in rates]  # side by side, so intervals don't hide
            cells = [info["cells"][r] for r in rates]
            mean = np.array([c["mean"] for c in cells], dtype=float)
            lo = np.array([c["ci"][0] for c in cells], dtype=float)
            hi = np.array([c["ci"][1] for c in cells], dtype=float)
            err = np.vstack([np.where(np.isfinite(lo), mean - lo, 0.0), np.where(np.isfinite(hi), hi - mean, 0.0)])
            color = rule_styles[rule]["color"]
            ax.errorbar(
                dodge, mean, yerr=err, label=rule, color=color, marker="o", markersize=4, capsize=3, linewidth=1.5
            )
            ax_c.plot(
                rates,
                [100.0 * c["flagged"] / c["runs"] if c["runs"] else math.nan for c in cells],
                color=color,
                marker="o",
                markersize=4,
                linewidth=1.2,
            )
        for a in (ax, ax_c):
            a.set_xscale("log")
            a.set_xticks(block["rates"])
            a.set_xticklabels([f"{r:.3g}" for r in block["rates"]], fontsize=8)
            a.minorticks_off()
            a.set_xlabel("learning rate (constant)" if row == len(stab) - 1 else "")
            a.grid(alpha=0.3)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_ylabel("gain over the base model (pts)")
        ax.set_title(f"{model_title(model)}: final Avg@n minus step 0 (mean, 95% t CI over seeds)", fontsize=10)
        ax_c.set_ylabel("runs flagged as collapsed (%)")
        ax_c.set_ylim(-5, 105)
        ax_c.set_title("collapse (any kind; see the stability table)", fontsize=10)
    return finish(fig, axes, "Stability: gain over the base model vs learning rate")


def tuning_figure(stab: Mapping | None) -> Figure | None:
    """Each rule's learning-rate curve in its own panel (the first block with a learning-rate axis): the
    gain (mean over seeds, 95% t interval) at every rate, the seeds' own gains as dots, the best rate
    ringed, and lr*, the peak of the fitted quadratic, as a dashed line with its bootstrap interval
    shaded (report/stability.py); the panels share the y axis."""
    if not stab:
        return None
    model, block = next(iter(stab.items()))
    rules = list(block["rules"].items())
    cols = min(5, len(rules))
    rows = math.ceil(len(rules) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows + 0.8), dpi=DPI, squeeze=False, sharey=True)
    for ax in axes.flat[len(rules) :]:
        ax.set_visible(False)
    rule_styles = series_styles([rule for rule, _ in rules])
    for ax, (rule, info) in zip(axes.flat, rules):
        color = rule_styles[rule]["color"]
        rates = sorted(info["cells"])
        cells = [info["cells"][r] for r in rates]
        mean = np.array([c["mean"] for c in cells], dtype=float)
        lo = np.array([c["ci"][0] for c in cells], dtype=float)
        hi = np.array([c["ci"][1] for c in cells], dtype=float)
        err = np.vstack([np.where(np.isfinite(lo), mean - lo, 0.0), np.where(np.isfinite(hi), hi - mean, 0.0)])
        ax.errorbar(rates, mean, yerr=err, color=color, marker="o", markersize=4, capsize=3, linewidth=1.5)
        for r, c in zip(rates, cells):
            ax.plot([r] * len(c["gains"]), c["gains"], linestyle="none", marker=".", color=color, alpha=0.5)
        best = info.get("best") or {}
        if best.get("rate") is not None:
            ax.plot([best["rate"]], [best["mean"]], marker="o", markersize=11, fillstyle="none", color="black")
        peak = info.get("peak")
        if peak and math.isfinite(peak["rate"]):
            ax.axvline(peak["rate"], color="black", linestyle="--", linewidth=0.9)
            if all(math.isfinite(x) for x in peak["ci"]):
                ax.axvspan(*peak["ci"], color="black", alpha=0.08)
        ax.set_xscale("log")
        ax.set_xticks(block["rates"])
        ax.set_xticklabels([f"{r:.2g}" for r in block["rates"]], fontsize=7)
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.set_title(rule, fontsize=10)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"gain (pts, {block.get('bench') or 'benchmarks averaged'})", fontsize=8)
    fig.suptitle(
        f"{model_title(model)}: each rule's gain over the base model vs learning rate (mean, 95% t CI over seeds; "
        "dots: seeds; ring: best rate; dashed: lr*, the fit's peak, and its bootstrap CI)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def profile_figure(result: dict, styles: Styles | None = None) -> Figure | None:
    """The performance profile per base model (Agarwal et al., 2021): for each label, the share of its run x
    task scores (final Avg@n, the aggregates' tasks) above each threshold tau, a step function over tau; one
    panel per block with aggregates."""
    blocks = [b for b in result.get("blocks", []) if b.get("aggregates")]
    if not blocks:
        return None
    fig, axes = plt.subplots(1, len(blocks), figsize=(6.5 * len(blocks), 4.2), dpi=DPI, squeeze=False)
    panels = []
    for ax, block in zip(axes[0], blocks):
        drawn = {}
        agg = block["aggregates"]
        order = sorted(agg, key=lambda lb: lb != result.get("baseline"))  # the baseline first, as elsewhere
        own = _styles(styles, order)
        for lb, e in ((lb, agg[lb]) for lb in order):
            x = np.sort(100.0 * np.asarray(e["scores"], dtype=float))
            y = 1.0 - np.arange(1, x.size + 1) / x.size  # the share strictly above each score
            ax.step(np.r_[x[0], x], np.r_[1.0, y], where="post", label=lb, **own[lb])
            drawn[lb] = pd.Series(y, index=x)
        panels.append(drawn)
        ax.set_xlabel(f"final Avg@{block['n']} (pts, {', '.join(block.get('aggregate_tasks') or [])})")
        ax.set_ylabel("share of runs above")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.set_title(model_title(block["model"]), fontsize=10)
    return finish(fig, axes[0], "Performance profile: the share of runs above each score", panels)


def make_figures(sweep: Sweep, result: dict) -> dict[str, Figure]:
    """Every figure that has data, in display order (Pass@k against k, stability when the sweep has a
    learning-rate axis, then entropy, reward, completion length, ...), each series in one style."""
    excluded = frozenset(e["run_id"] for e in result.get("runs", {}).get("excluded", []))
    groups = group_runs(sweep, result.get("baseline"), excluded)
    styles = series_styles(list(groups))
    figs: dict[str, Figure | None] = {
        "passk": passk_figure(result, styles),
        "stability": stability_figure(result.get("stability")),
        "tuning": tuning_figure(result.get("stability")),
    }
    ent = _first_key(groups, ("entropy", "entropy/mean"))
    figs["entropy"] = (
        line_figure(groups, ent, "opt_step", "Token entropy", "nats / token", styles=styles) if ent else None
    )
    rew = _first_key(groups, ("reward/mean", "reward"))
    figs["reward"] = line_figure(groups, rew, "step", "Mean reward", "reward", styles=styles) if rew else None
    length = _first_key(groups, ("response_length/mean",))
    figs["length"] = (
        line_figure(groups, length, "step", "Completion length", "tokens", styles=styles) if length else None
    )
    figs["eval"] = eval_figure(groups, result, styles)
    figs["profile"] = profile_figure(result, styles)
    figs["quadrants"] = quadrant_figure(result)
    figs["log_ratio_hist"] = hist_figure(groups, styles)
    return {k: v for k, v in figs.items() if v is not None}


def save_figures(figs: Mapping[str, Figure], out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, fig in figs.items():
        path = out / f"{name}.png"
        path.write_bytes(png(fig))
        paths[name] = path
    return paths
