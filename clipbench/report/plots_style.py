"""How the report's figures draw: one style per series (distinct for up to 60 rules), seed bands as 95%
confidence intervals, the legend and the notes placed off the axes, PNG bytes.

    style = series_styles(["grpo", "dapo", ...])["dapo"]   # {"color": ..., "linestyle": ...}
    draw_band(ax, seed_frame(runs, extract), "dapo", style)  # mean over seeds, its 95% t interval shaded
    finish(fig, axes, "Token entropy", panels)              # legend below (<= 8 series) or to the right

Series keep their style across every figure of a report (the baseline first, then label order):
matplotlib's ten tab10 colours up to ten series, tab20's twenty up to twenty, then those twenty with
dashed, dotted and dash-dot lines. A band is the 95% Student t interval of the mean over the seeds that
have a value at that x (at least two); series that coincide exactly (one would hide the other) are named
in a note under the title, never over the legend.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from clipbench.report.load import RunRecord  # noqa: E402

DPI = 100
SPARSE_POINTS = 30
BELOW = 8  # at most this many series: the legend under the axes; more: to their right
LINESTYLES = ("-", "--", ":", "-.")


def series_styles(names: Sequence[str]) -> dict[str, dict]:
    """{name: {"color", "linestyle"}}: distinct for every name (see the module docstring)."""
    n = len(names)
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    size = 10 if n <= 10 else 20
    return {
        name: {"color": matplotlib.colors.to_hex(cmap(i % size)), "linestyle": LINESTYLES[(i // size) % 4]}
        for i, name in enumerate(names)
    }


def seed_frame(runs: Sequence[RunRecord], extract: Callable[[RunRecord], Mapping[float, float]]) -> pd.DataFrame:
    """Index x, one column per run (seed): values from ``extract(run) -> {x: y}``; NaN where missing."""
    cols = {r.run_id: pd.Series(dict(extract(r)), dtype=float) for r in runs}
    cols = {k: v for k, v in cols.items() if len(v)}
    if not cols:
        return pd.DataFrame()
    return pd.DataFrame(cols).sort_index()


def _is_sparse(y: np.ndarray) -> bool:
    """At most SPARSE_POINTS finite points, or a finite point whose neighbours are both missing."""
    ok = np.isfinite(y)
    if ok.sum() <= SPARSE_POINTS:
        return True
    left = np.r_[False, ok[:-1]]
    right = np.r_[ok[1:], False]
    return bool((ok & ~left & ~right).any())


def t_band(frame: pd.DataFrame, level: float = 0.95) -> tuple[pd.Series, pd.Series, pd.Series]:
    """(mean, low, high) per x over the seeds (columns): the Student t interval of the mean, NaN where
    fewer than two seeds have a value."""
    from scipy import stats as sps  # noqa: PLC0415 - scipy is heavy

    mean, count = frame.mean(axis=1), frame.notna().sum(axis=1)
    sem = frame.std(axis=1, ddof=1) / np.sqrt(count)
    q = pd.Series(sps.t.ppf(0.5 + level / 2, np.maximum(count - 1, 1)), index=frame.index).where(count >= 2)
    return mean, mean - q * sem, mean + q * sem


def draw_band(ax, frame: pd.DataFrame, label: str, style: Mapping | str) -> pd.Series | None:
    """Mean line over seeds (markers when sparse) and its 95% t interval over seeds, shaded where at
    least two seeds have a value. `style`: {"color", "linestyle"} (or a colour). Returns the plotted
    mean (None when there is nothing to draw)."""
    if frame.empty:
        return None
    style = {"color": style} if isinstance(style, str) else dict(style)
    mean, lo, hi = t_band(frame)
    marker = dict(marker="o", markersize=3.5) if _is_sparse(mean.to_numpy(dtype=float)) else {}
    ax.plot(frame.index.values, mean.values, label=label, linewidth=1.6, **style, **marker)
    if lo.notna().any():
        ax.fill_between(frame.index.values, lo.values, hi.values, color=style["color"], alpha=0.18, linewidth=0)
    return mean


def identical_series(panels: Sequence[Mapping[str, pd.Series | None]]) -> list[list[str]]:
    """Groups of series names whose plotted means are exactly equal in every panel where any of them
    has data (so one line hides the other)."""
    names = list(dict.fromkeys(n for panel in panels for n, m in panel.items() if m is not None))

    def same(a: str, b: str) -> bool:
        seen = False
        for panel in panels:
            x, y = panel.get(a), panel.get(b)
            if x is None and y is None:
                continue
            if x is None or y is None or not x.index.equals(y.index):
                return False
            if not np.array_equal(x.to_numpy(dtype=float), y.to_numpy(dtype=float), equal_nan=True):
                return False
            seen = True
        return seen

    groups: list[list[str]] = []
    for n in names:
        for g in groups:
            if same(g[0], n):
                g.append(n)
                break
        else:
            groups.append([n])
    return [g for g in groups if len(g) > 1]


def finish(fig: Figure, axes, title: str, panels: Sequence[Mapping[str, pd.Series | None]] = ()) -> Figure:
    """The title, under it the note naming identical curves, and one legend for every panel: under
    the axes for at most BELOW series, else to the right of them (the PNG grows to hold it; it never
    covers an axis)."""
    handles, labels = [], []
    for ax in np.ravel(axes):
        for h, lb in zip(*ax.get_legend_handles_labels()):
            if lb not in labels:
                handles.append(h)
                labels.append(lb)
    same = identical_series(panels)
    note = "Identical curves (drawn on top of each other): " + "; ".join(" = ".join(g) for g in same) if same else ""
    fig.suptitle(title, y=0.995)
    top = 0.95
    if note:
        fig.text(0.5, 0.955, note, ha="center", va="top", fontsize=8, color="#b45309", wrap=True)
        top = 0.91
    bottom = 0.0
    if handles and len(labels) <= BELOW:
        ncol = min(4, len(labels))
        rows = -(-len(labels) // ncol)
        fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False)
        bottom = min(0.45, 0.03 + 0.06 * rows)
    elif handles:
        fig.legend(
            handles,
            labels,
            loc="upper left",
            bbox_to_anchor=(1.0, top),
            ncol=math.ceil(len(labels) / 24),
            frameon=False,
            fontsize=8,
        )
    fig.tight_layout(rect=(0, bottom, 1, top))
    return fig


def png(fig: Figure) -> bytes:
    """The figure as PNG, its bounding box grown to the legend beside or under the axes (long labels included)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def close_figures(figs: Mapping[str, Figure]) -> None:
    for fig in figs.values():
        plt.close(fig)
