"""The sampler/trainer mismatch and its correction in the report: per label, mean +- std over seeds.

    label_correction(runs) -> dict | None      # analysis.analyze keeps it under result["correction"]
    correction_table(result["correction"], baseline) -> Table | None   # correction_table.py

From each run's metrics rows (docs/metrics.md): the rollout batch's values (`mismatch/*`,
`correction/*`, logged on every row of a rollout step: its first row is read) averaged over the
rollout steps, the raw ratio's extrema over the whole run, and per quadrant of the clip the share of
the quadrant's tokens the correction masked (`correction/<cell>/masked` / `<cell>/tokens`, summed
over the run's optimizer steps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from clipbench.report import stats

QUADRANTS = ("q1", "q2", "q3", "q4")
MEANS = (
    "mismatch/abs_mean",
    "mismatch/rho_mean",
    "correction/weight_mean",
    "correction/truncated_frac",
    "correction/masked_frac",
    "correction/seq_masked_frac",
)


def run_correction(metrics: Sequence[Mapping]) -> dict | None:
    """One run's figures (None when it logged no mismatch)."""
    firsts: dict = {}
    for r in metrics:
        if r.get("mismatch/abs_mean") is not None:
            firsts.setdefault(r.get("step"), r)
    if not firsts:
        return None
    rows = list(firsts.values())
    out = {k: float(np.mean([r[k] for r in rows])) if all(k in r for r in rows) else math.nan for k in MEANS}
    out["rho_min"] = (
        min(r["mismatch/rho_min"] for r in rows) if all("mismatch/rho_min" in r for r in rows) else math.nan
    )
    out["rho_max"] = (
        max(r["mismatch/rho_max"] for r in rows) if all("mismatch/rho_max" in r for r in rows) else math.nan
    )
    for q in QUADRANTS:
        tokens = sum(r.get(f"{q}/tokens", 0.0) for r in metrics)
        masked = sum(r.get(f"correction/{q}/masked", 0.0) for r in metrics)
        out[f"{q}/masked"] = (
            100.0 * masked / tokens if tokens and any(f"correction/{q}/masked" in r for r in metrics) else math.nan
        )
    return out


def label_correction(runs) -> dict | None:
    """Mean and std over seeds of `run_correction` (rho_min: the minimum, rho_max: the maximum)."""
    per_run = [c for c in (run_correction(r.metrics) for r in runs) if c is not None]
    if not per_run:
        return None
    out: dict = {"seeds": len(per_run)}
    for key in per_run[0]:
        values = [c[key] for c in per_run]
        if key == "rho_min":
            out[key] = {"mean": min(values), "std": 0.0}
        elif key == "rho_max":
            out[key] = {"mean": max(values), "std": 0.0}
        else:
            m, s = stats.mean_std(values)
            out[key] = {"mean": m, "std": s}
    return out
