"""The report's figures of where training ended: Pass@k against k, and each rule's clip events by quadrant.

    passk_figure(result, styles)   # the base model and each rule, Pass@k against k on a log-2 axis
    quadrant_figure(result)        # one stacked bar per rule: its clip events' shares by quadrant, counted

Pass@k against k is the figure RLVR papers show first (does RL sharpen the distribution, or widen what
the model can solve?): per benchmark (and their average when there are several), the base model at step
0 (black, dashed) and each arm at its final evaluation, k = 1 (Avg@n), 2, 4, ..., n; the mean over seeds
of the unbiased Pass@k, with its 95% Student t interval over the seeds shaded (within 0-100%).

The quadrant bars are ABC-GRPO's figure of where the clip events fall: per rule, the share of its
out-of-band tokens in each quadrant (Q1 A>0 r>1, Q2 A>0 r<1, Q3 A<0 r<1, Q4 A<0 r>1; the mean over seeds
of each run's shares over all its steps, as the Clip quadrants table), with the events counted beside
the bar.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from clipbench.report import stats
from clipbench.report.analysis import QUADRANTS
from clipbench.report.plots_style import DPI, finish, series_styles
from clipbench.report.tables import BENCH_TITLES, model_title, ordered_benchmarks

BASE = "base model (step 0)"
BASE_STYLE = {"color": "black", "linestyle": "--"}
QUADRANT_COLORS = {"q1": "#4c72b0", "q2": "#8fb6e0", "q3": "#dd8452", "q4": "#c44e52"}


def _panels(result: dict) -> list[tuple[dict, str, dict]]:
    """(block, title, rows) of each benchmark of each block, and the benchmarks' average where several."""
    multi = len(result["blocks"]) > 1
    out = []
    for block in result["blocks"]:
        if not block.get("ks"):
            continue
        where = f"{model_title(block['model'])}: " if multi else ""
        entries = [(BENCH_TITLES.get(b, b), block["benchmarks"][b]) for b in ordered_benchmarks(block["benchmarks"])]
        if len(entries) > 1 and block["average"]["rows"]:
            entries.append(("benchmarks averaged", block["average"]))
        out += [(block, where + title, entry) for title, entry in entries if entry["rows"]]
    return out


def _curve(row: dict, metrics: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) in % over the metrics: the mean over seeds and its 95% t interval."""
    cells = [row["metrics"][m] for m in metrics]
    mean = np.array([100.0 * c["mean"] for c in cells])
    ci = np.array([stats.t_interval(c.get("per_seed") or [c["mean"]]) for c in cells]) * 100.0
    return mean, np.clip(ci[:, 0], 0.0, 100.0), np.clip(ci[:, 1], 0.0, 100.0)  # a share: drawn within 0-100%


def passk_figure(result: dict, styles: Mapping[str, Mapping] | None = None) -> Figure | None:
    """Pass@k against k per benchmark, the base model and each arm (module docstring); None without
    a final evaluation of more than one sample."""
    panels = _panels(result)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.7 * rows + 0.8), dpi=DPI, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    drawn = []
    for ax, (block, title, entry) in zip(axes.flat, panels):
        ks, metrics = [1, *block["ks"]], stats.metric_names(block["ks"])
        labels = sorted(entry["rows"], key=lambda lb: lb != result.get("baseline"))  # the baseline first
        own = styles if styles is not None and all(lb in styles for lb in labels) else series_styles(labels)
        series = [(BASE, entry.get("base"), BASE_STYLE)] + [(lb, entry["rows"][lb], own[lb]) for lb in labels]
        for name, row, style in series:
            if row is None:
                continue
            mean, lo, hi = _curve(row, metrics)
            ax.plot(ks, mean, marker="o", markersize=3.5, linewidth=1.6, label=name, **style)
            if np.any(hi > lo):
                ax.fill_between(ks, lo, hi, color=style["color"], alpha=0.15, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks)
        ax.set_xticklabels([str(k) for k in ks], fontsize=8)
        ax.minorticks_off()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("k")
        ax.set_ylabel("Pass@k (%)")
        ax.grid(alpha=0.3)
        drawn.append({})
    n = max(block["n"] for block, _, _ in panels)
    return finish(fig, axes, f"Pass@k against k (n = {n}; final evaluation; mean over seeds, band: 95% t CI)", drawn)


def quadrant_figure(result: dict) -> Figure | None:
    """Each rule's clip events by quadrant: a 100% stacked bar per rule with its count of events (module
    docstring); one panel per base model; None when no run logged a clip event."""
    blocks = {m: q for m, q in (result.get("quadrants") or {}).items() if any(v.get("events") for v in q.values())}
    if not blocks:
        return None
    height = sum(len(q) for q in blocks.values())
    fig, axes = plt.subplots(
        len(blocks), 1, figsize=(9, 0.45 * height + 1.2 * len(blocks) + 0.8), dpi=DPI, squeeze=False
    )
    baseline = result.get("baseline")
    for ax, (model, by_label) in zip(axes[:, 0], blocks.items()):
        labels = sorted(by_label, key=lambda lb: lb != baseline)  # the baseline on top, as in the tables
        left = np.zeros(len(labels))
        for q in QUADRANTS:
            share = np.array([by_label[lb]["share"][q]["mean"] for lb in labels], dtype=float)
            share = np.nan_to_num(share)
            ax.barh(labels, share, left=left, color=QUADRANT_COLORS[q], label=q.upper(), height=0.7)
            for y, (x0, w) in enumerate(zip(left, share)):
                if w >= 7:
                    ax.text(x0 + w / 2, y, f"{w:.0f}%", ha="center", va="center", fontsize=8, color="white")
            left += share
        for y, lb in enumerate(labels):
            info = by_label[lb]
            ax.text(101, y, f"{info['events']:,.0f} events, {info['seeds']} seeds", va="center", fontsize=8)
        ax.set_xlim(0, 100)
        ax.invert_yaxis()
        ax.set_xlabel("share of the rule's clip events (%)")
        if len(blocks) > 1:
            ax.set_title(model_title(model), fontsize=10)
    return finish(
        fig,
        axes,
        "Clip events by quadrant (Q1 A>0 r>1, Q2 A>0 r<1, Q3 A<0 r<1, Q4 A<0 r>1; mean over seeds of each run's "
        "shares)",
    )
