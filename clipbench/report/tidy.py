"""The report's numbers as tidy CSV files (one number per column), beside the formatted tables, so that
`pandas.read_csv` needs no parsing of "39.1 ± 6.1":

    results_tidy.csv   one row per base model, benchmark ("average": the benchmarks' unweighted mean),
                       label (and the base model at step 0) and metric (avg = Avg@n, pass@k): the mean
                       over seeds, its sd over seeds, the t interval over problems, and against the
                       baseline the paired seed difference, its interval, p and Holm's p (points)
    claims_tidy.csv    one row per claim: the estimate, its interval, p, Holm's p, verdict, replication

    tidy_tables(result) -> {"results_tidy": [row, ...], "claims_tidy": [...]}

Each run's own values are per_seed.csv's (report/per_seed.py, beside the markdown and HTML reports).

Accuracies are in percent (`*_pct`), differences in points (`*_pts`); a claim's estimate is in its own
figure's unit (its `figure` column).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping
from typing import Any

BASE_LABEL = "base model (step 0)"


def _pct(x: Any) -> float | None:
    return None if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else 100.0 * x


def _num(x: Any) -> float | None:
    return None if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else float(x)


def _entries(block: dict) -> Iterable[tuple[str, dict]]:
    yield from block["benchmarks"].items()
    if block["average"]["rows"]:
        yield "average", block["average"]


def results_rows(result: dict) -> list[dict]:
    rows = []
    baseline = result.get("baseline")
    for block in result["blocks"]:
        for bench, entry in _entries(block):
            labels = [(lb, row) for lb, row in entry["rows"].items()]
            if entry.get("base"):
                labels.append((BASE_LABEL, entry["base"]))
            for lb, row in labels:
                method = block["labels"].get(lb, {}).get("method", "") if lb != BASE_LABEL else ""
                for metric, cell in row["metrics"].items():
                    ci = cell.get("ci") or [None, None]
                    dci = cell.get("delta_ci") or [None, None]
                    rows.append(
                        {
                            "model": block["model"],
                            "benchmark": bench,
                            "label": lb,
                            "method": method,
                            "metric": metric,
                            "k": 1 if metric == "avg" else int(metric.split("@")[1]),
                            "n": block["n"],
                            "seeds": row.get("seeds"),
                            "problems": row.get("problems"),
                            "mean_pct": _pct(cell.get("mean")),
                            "std_pct": _pct(cell.get("std")),
                            "ci_low_pct": _pct(ci[0]),
                            "ci_high_pct": _pct(ci[1]),
                            "baseline": baseline if cell.get("delta") is not None else None,
                            "delta_pts": _pct(cell.get("delta")),
                            "delta_ci_low_pts": _pct(dci[0]),
                            "delta_ci_high_pts": _pct(dci[1]),
                            "paired_seeds": cell.get("paired_seeds"),
                            "p": _num(cell.get("p")),
                            "p_holm": _num(cell.get("p_holm")),
                        }
                    )
    return rows


def claims_rows(result: dict) -> list[dict]:
    keys = ("model", "claim", "source", "comparison", "figure", "kind", "margin", "estimate", "test", "n")
    rows = []
    for c in result.get("claims", []):
        ci = c.get("ci") or [None, None]
        rows.append(
            {
                **{k: c.get(k) for k in keys},
                "ci_low": _num(ci[0]),
                "ci_high": _num(ci[1]),
                "p": _num(c.get("p")),
                "p_holm": _num(c.get("p_holm")),
                "family": c.get("family"),
                "mde": _num(c.get("mde")),
                "verdict": c.get("verdict"),
                "replication": (c.get("replication") or {}).get("status"),
            }
        )
    return rows


def tidy_tables(result: dict) -> dict[str, list[dict]]:
    """The tidy tables that have rows (module docstring)."""
    tables = {"results_tidy": results_rows(result), "claims_tidy": claims_rows(result)}
    return {name: rows for name, rows in tables.items() if rows}


def to_csv(rows: list[Mapping]) -> str:
    """One header line, one line per row; a missing number is an empty cell (pandas reads NaN)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else (f"{v:.10g}" if isinstance(v, float) else v) for k, v in row.items()})
    return buf.getvalue()
