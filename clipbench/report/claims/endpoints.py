"""The per-run numbers the claims compare, each registered once: what it measures, its unit, its
value for one run, the figure a claim on it shows, its per_seed.csv column (report/per_seed.py) and,
for the endpoints a preregistered family may name (config/claims.py), the claim a comparison on it
makes (claimed sign +: "a is higher than b").

    avg_start:<bench>, avg_end:<bench>   Avg@n at the first and the last evaluation, points
    pass_end:<bench>                     Pass@n at the last evaluation, points
    entropy_last_fifth                   mean token entropy over the last fifth of the run (nats)
    q4_lead                              Q4's share of the clip events minus the largest other quadrant's

A new endpoint is one `register(Endpoint(...))` here (a family's: its name in config/claims.py's
ENDPOINTS too, which a sweep file is checked against when it is read) and its line in docs/reports.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from clipbench.eval.passk import pass_at_k_array
from clipbench.registry import Registry
from clipbench.report.analysis import _initial_step, _payload_at, run_dynamics, run_quadrants
from clipbench.report.load import RunRecord

Value = Callable[[RunRecord, str], "float | None"]  # (run, benchmark) -> its value, None without one


@dataclass(frozen=True)
class Endpoint:
    name: str
    measures: str  # in words (docs; a family's equivalence claim names it up to " at ")
    unit: str  # the figure's unit
    column: str  # its per_seed.csv column; "{bench}" in it: one column per benchmark
    value: Value
    figure: Callable[[Sequence[RunRecord], str], str] | None = None  # (runs, benchmark) -> the figure's text
    claim: str | None = None  # a preregistered comparison's claim on it ("{a}", "{b}"); None: not a family's

    @property
    def per_benchmark(self) -> bool:
        return "{bench}" in self.column

    def column_of(self, bench: str = "") -> str:
        return self.column.format(bench=bench)


ENDPOINTS: Registry[Endpoint] = Registry("endpoint")


def register(endpoint: Endpoint) -> Endpoint:
    return ENDPOINTS.register(endpoint.name, endpoint, origin=None)


def per_seed(runs: Sequence[RunRecord], value: Callable[[RunRecord], float | None]) -> dict[int, float]:
    """{seed: value} of the runs whose value is finite."""
    out = {}
    for r in runs:
        v = value(r)
        if v is not None and math.isfinite(v):
            out[r.seed] = float(v)
    return out


def final_correct(run: RunRecord, bench: str) -> np.ndarray | None:
    """(P, n) correctness of the run's last evaluation on `bench`, or None."""
    if run.final_step is None or bench not in (run.evals.get(run.final_step) or {}):
        return None
    correct = run.evals[run.final_step][bench].get("correct")
    return np.asarray(correct, dtype=float) if correct else None


def _initial_avg(run: RunRecord, bench: str) -> float | None:
    p = _payload_at(run, bench, _initial_step(run))
    return None if p is None or not p.get("correct") else 100.0 * float(np.asarray(p["correct"], dtype=float).mean())


def _final_avg(run: RunRecord, bench: str) -> float | None:
    c = final_correct(run, bench)
    return None if c is None else 100.0 * float(c.mean())


def _final_pass(run: RunRecord, bench: str) -> float | None:
    c = final_correct(run, bench)
    if c is None:
        return None
    n = c.shape[1]
    return 100.0 * float(np.mean(pass_at_k_array(n, c.sum(1).astype(int), n)))


def last_entropy(run: RunRecord, bench: str = "") -> float | None:
    d = run_dynamics(run.metrics)
    return None if d is None else d["entropy"][1]  # (first, last) fifth


def q4_lead(run: RunRecord, bench: str = "") -> float | None:
    q = run_quadrants(run.metrics)
    if q is None or not math.isfinite(q["share"]["q4"]):
        return None
    return q["share"]["q4"] - max(q["share"][k] for k in ("q1", "q2", "q3"))


def q4_share(run: RunRecord) -> float | None:
    q = run_quadrants(run.metrics)
    return None if q is None else q["share"]["q4"]


def _samples(runs: Sequence[RunRecord], bench: str) -> int | str:
    """The samples per problem of the runs' last evaluations on `bench` ("n" when they differ)."""
    ns = sorted({c.shape[1] for r in runs if (c := final_correct(r, bench)) is not None})
    return ns[0] if len(ns) == 1 else "n"


def _q4_figure(runs: Sequence[RunRecord], bench: str = "") -> str:
    return f"share of clip events (pts; Q4 {float(np.mean(list(per_seed(runs, q4_share).values()))):.1f}%)"


AVG_START = register(
    Endpoint("avg_start", "Avg@n at the first evaluation (the base model)", "pts", "avg_start:{bench}", _initial_avg)
)
AVG = register(
    Endpoint(
        "avg",
        "Avg@n at the last evaluation",
        "pts",
        "avg_end:{bench}",
        _final_avg,
        lambda runs, bench: f"Avg@{_samples(runs, bench)}, last eval (pts, {bench})",
        "{a} beats {b} on held-out accuracy",
    )
)
PASS = register(
    Endpoint(
        "pass",
        "Pass@n at the last evaluation",
        "pts",
        "pass_end:{bench}",
        _final_pass,
        lambda runs, bench: f"Pass@{_samples(runs, bench)}, last eval (pts, {bench})",
        "{a} keeps a higher Pass@n than {b}",
    )
)
ENTROPY = register(
    Endpoint(
        "entropy",
        "mean token entropy, last fifth of the rollout steps",
        "nats",
        "entropy_last_fifth",
        last_entropy,
        lambda runs, bench: "entropy, last fifth (nats)",
        "{a} keeps entropy higher than {b}",
    )
)
Q4_LEAD = register(
    Endpoint(
        "q4_lead",
        "Q4's share of the clip events minus the largest other quadrant's",
        "pts",
        "q4_lead",
        q4_lead,
        _q4_figure,
    )
)


def family_endpoints() -> tuple[str, ...]:
    """The endpoints a preregistered comparison may name: those with a claim."""
    return tuple(name for name, e in ENDPOINTS.items() if e.claim is not None)


def avg_col(bench: str, start: bool = False) -> str:
    return (AVG_START if start else AVG).column_of(bench)
