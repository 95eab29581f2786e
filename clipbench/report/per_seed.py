"""Each compared run's claim endpoints, one row per run, and the claims rederived from those rows alone.

    rows = per_seed_rows(runs, "organism_confirm")   # [{sweep, model, label, method, seed, run_id, endpoints...}]
    write_per_seed(path, rows); rows = read_per_seed(path)
    claims = claims_from_per_seed(rows, report["claims"])   # estimates, p, Holm, verdicts again

`clipbench report` writes ``per_seed.csv`` beside ``report.md`` / ``report.html`` (a replication sweep's
runs too, their ``sweep`` column naming it), so a published verdict can be checked, and tested again,
without the results store: one column per endpoint (report/claims/endpoints.py registers each,
with its column: avg_start:<bench>, avg_end:<bench>, pass_end:<bench>, entropy_last_fifth, q4_lead).

Each seed-level claim says what it reads (``ClaimResult.reads``: terms [label, columns, sign], the
columns of a term averaged, the terms summed per seed): ``claims_from_per_seed`` forms those per-seed
values from the rows, then runs the claim's own test (`comparisons.seed_test`: the paired t, or TOST or
non-inferiority against its margin) and Holm over the family (`verdicts.correct_family`). A claim tested
over problems (one seed) has no per-seed values and is refused. Values are per run over all the
problems it evaluated; the report pairs the problems a label's runs share, which is the same set
when every run evaluated the same problems (as a sweep's runs do).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from clipbench.errors import UserError
from clipbench.report.claims.comparisons import seed_test
from clipbench.report.claims.endpoints import ENDPOINTS
from clipbench.report.claims.verdicts import ClaimResult, correct_family
from clipbench.report.load import RunRecord

KEYS = ("sweep", "model", "label", "method", "seed", "run_id")


def _run_row(run: RunRecord, sweep: str) -> dict:
    """The run's keys, then each endpoint's value (per benchmark of its last evaluation, then per run)."""
    row: dict = {"sweep": sweep, "model": run.model, "label": run.label, "method": run.method}
    row.update(seed=run.seed, run_id=run.run_id)
    for bench in sorted((run.evals.get(run.final_step) or {}) if run.final_step is not None else {}):
        row.update({e.column_of(bench): e.value(run, bench) for e in ENDPOINTS.values() if e.per_benchmark})
    row.update({e.column: e.value(run, "") for e in ENDPOINTS.values() if not e.per_benchmark})
    return {k: v for k, v in row.items() if v is not None}


def per_seed_rows(runs: Sequence[RunRecord], sweep: str) -> list[dict]:
    """One row per run (the compared ones: pass those), sorted by label and seed."""
    return [_run_row(r, sweep) for r in sorted(runs, key=lambda r: (r.model, r.label, r.seed))]


def write_per_seed(path: Path, rows: Sequence[Mapping]) -> Path:
    """per_seed.csv: the key columns, then every endpoint any row has (blank where a run has none);
    floats as Python writes them, so they read back bit for bit."""
    cols = list(KEYS) + sorted({k for r in rows for k in r} - set(KEYS))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: repr(v) if isinstance(v, float) else v for k, v in r.items()})
    return path


def read_per_seed(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        row = {k: r[k] for k in KEYS}
        row["seed"] = int(r["seed"])
        row.update({k: float(v) for k, v in r.items() if k not in KEYS and v != ""})
        out.append(row)
    return out


def _value(terms: Sequence, by_label: Mapping[str, Mapping[int, dict]], seed: int) -> float:
    total = None
    for label, cols, sign in terms:
        row = by_label.get(label, {}).get(seed)
        if row is None or any(c not in row for c in cols):
            return math.nan
        v = sign * float(np.mean([row[c] for c in cols]))
        total = v if total is None else total + v
    return math.nan if total is None else total


def claims_from_per_seed(
    rows: Sequence[Mapping], claims: Sequence[Mapping], sweep: str | None = None
) -> list[ClaimResult]:
    """The `claims` (the report's: dicts as report.json keeps them, or ClaimResults) tested again from
    per-seed `rows` alone, one family (Holm over all of them). `sweep`: whose rows (default: the
    first row's, the report's own sweep). UserError for a claim that was not tested over seeds."""
    sweep = sweep if sweep is not None else (rows[0]["sweep"] if rows else "")
    index: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        if r["sweep"] == sweep:
            index.setdefault((r["model"], r["label"]), {})[int(r["seed"])] = r
    out = []
    for c in claims:
        c = c if isinstance(c, Mapping) else c.__dict__
        if not c.get("reads"):
            raise UserError(
                f"claim '{c['claim']}' ({c['comparison']}) was tested over problems (one seed): "
                "per-seed values cannot test it again"
            )
        by_label = {lb: index.get((c["model"], lb), {}) for lb, _, _ in c["reads"]}
        seeds = sorted(set.intersection(*[set(v) for v in by_label.values()]))
        values = {s: _value(c["reads"], by_label, s) for s in seeds}
        seeds = [s for s in seeds if math.isfinite(values[s])]
        diffs = np.array([values[s] for s in seeds])
        res = seed_test(
            c["claim"], c["source"], c["comparison"], c["figure"], diffs, seeds, [], c["kind"], c.get("margin")
        )
        res.model, res.reads = c["model"], c["reads"]
        out.append(res)
    correct_family(out)
    return out
