"""Which runs a report may compare, and what went wrong in the others: plain dicts, no formatting.

    exclusion_reason(run) -> str | None       why a run stays out of every comparison (None: it is in)
    run_health(run) -> dict                   steps, skipped optimizer steps, collapse flags
    identical_results(runs_by_label) -> list  labels whose final evaluations are exactly the same

Design choices:
- Only a run that finished, with its evaluation at its last step, is compared. A failed or
  interrupted run is listed with the reason, never shown as its method's result (its step-0 score
  is the base model's, not the method's).
- Collapse is judged against the run's own start, with windows and thresholds stated here (and in
  the report's notes): the mean over the last tenth of rollout steps (at least one) against the mean
  over the first tenth. Reward below half its start, entropy below a tenth of its start, or an
  evaluation score (Avg@n, any benchmark) below half its step-0 value is flagged. So is a policy that
  never moved (the ratio is exactly 1 on every off-policy mini-batch: the updates changed nothing)
  and any optimizer step skipped as non-finite.
"""

from __future__ import annotations

import json
import math
from typing import Mapping, Sequence

import numpy as np

from clipbench.report.load import RunRecord

WINDOW = 0.1                 # share of the rollout steps averaged at the start and at the end
REWARD_COLLAPSE = 0.5        # flagged when the end is below this fraction of the start
ENTROPY_COLLAPSE = 0.1
ACCURACY_COLLAPSE = 0.5
FROZEN_TOL = 1e-7            # |ratio - 1| below this on every off-policy mini-batch: the policy never moved

RULES = (f"Flags: reward collapse = mean reward over the last {WINDOW:.0%} of rollout steps (at least one) below "
         f"{REWARD_COLLAPSE:g} x its mean over the first {WINDOW:.0%}; entropy collapse = the same with "
         f"{ENTROPY_COLLAPSE:g} x; accuracy collapse = a benchmark's final Avg@n below {ACCURACY_COLLAPSE:g} x its "
         f"step-0 value; policy frozen = ratio exactly 1 on every off-policy mini-batch; skipped = optimizer "
         f"steps skipped as non-finite (loss or gradient norm).")


def total_steps(run: RunRecord) -> int | None:
    steps = (run.config.get("train") or {}).get("steps")
    return int(steps) if isinstance(steps, int) else None


def steps_done(run: RunRecord) -> int:
    """Rollout steps with metrics in the store."""
    return 1 + max((int(r["step"]) for r in run.metrics if isinstance(r.get("step"), int)), default=-1)


def exclusion_reason(run: RunRecord) -> str | None:
    """None for a run the report compares; else why it is left out (one short sentence)."""
    steps = total_steps(run)
    done = steps_done(run)
    of = f"{done}/{steps}" if steps else str(done)
    if run.state == "failed":
        err = str(run.status.get("error") or "").strip().splitlines()
        return f"failed after {of} steps" + (f": {err[0][:160]}" if err else "")
    if run.state == "preempted":
        return f"preempted after {of} steps (checkpointed: rerun the sweep to resume it)"
    if run.state != "finished":
        return f"not finished ({run.state}, {of} steps: interrupted, or still training)"
    if run.final_step is None:
        return "finished without an evaluation"
    if steps is not None and run.final_step < steps:
        return f"finished, but its last evaluation is at step {run.final_step} of {steps}"
    return None


def _step_series(run: RunRecord, key: str) -> list[float]:
    """Per rollout step, the mean of `key` over that step's rows (finite values only), in step order."""
    acc: dict[int, list[float]] = {}
    for row in run.metrics:
        v, s = row.get(key), row.get("step")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and isinstance(s, int):
            acc.setdefault(s, []).append(float(v))
    return [float(np.mean(acc[s])) for s in sorted(acc)]


def _start_end(series: Sequence[float]) -> tuple[float, float] | None:
    if len(series) < 2:
        return None
    w = max(1, int(len(series) * WINDOW))
    return float(np.mean(series[:w])), float(np.mean(series[-w:]))


def run_health(run: RunRecord) -> dict:
    """{"steps_done", "steps", "opt_steps", "skipped", "skipped_frac", "flags": [str], "reward", "entropy"}."""
    opt_steps = len(run.metrics)
    skipped = max([int(r["skipped_nonfinite"]) for r in run.metrics if isinstance(r.get("skipped_nonfinite"), (int, float))]
                  + [int(run.status.get("skipped_nonfinite") or 0)])
    flags: list[str] = []
    out: dict = {"steps_done": steps_done(run), "steps": total_steps(run), "opt_steps": opt_steps,
                 "skipped": skipped, "skipped_frac": skipped / opt_steps if opt_steps else 0.0}
    if skipped:
        flags.append(f"skipped {skipped} of {opt_steps} optimizer steps (non-finite)")
    for key, name, frac in (("reward/mean", "reward", REWARD_COLLAPSE), ("entropy", "entropy", ENTROPY_COLLAPSE)):
        se = _start_end(_step_series(run, key))
        out[name] = None if se is None else {"start": se[0], "end": se[1]}
        if se is not None and se[0] > 0 and se[1] < frac * se[0]:
            flags.append(f"{name} collapse ({se[0]:.3g} -> {se[1]:.3g})")
    if run.evals and 0 in run.evals and run.final_step not in (None, 0):
        for bench, start in run.evals[0].items():
            end = run.evals[run.final_step].get(bench)
            if end is None:
                continue
            a, b = np.mean(start["correct"]), np.mean(end["correct"])
            if a > 0 and b < ACCURACY_COLLAPSE * a:
                flags.append(f"accuracy collapse on {bench} (Avg@n {100 * a:.1f}% -> {100 * b:.1f}%)")
    off_policy = [r for r in run.metrics if (r.get("mini_batch") or 0) > 0 or (r.get("epoch") or 0) > 0]
    ratios = [(r.get("ratio/min"), r.get("ratio/max")) for r in off_policy]
    ratios = [(lo, hi) for lo, hi in ratios if isinstance(lo, (int, float)) and isinstance(hi, (int, float))]
    if ratios and all(abs(lo - 1) < FROZEN_TOL and abs(hi - 1) < FROZEN_TOL for lo, hi in ratios):
        flags.append("policy frozen (ratio = 1 on every off-policy mini-batch)")
    out["flags"] = flags
    return out


def _eval_fingerprint(runs: Sequence[RunRecord]) -> str | None:
    """The final evaluations of a label's runs (by seed, benchmark), as one canonical string."""
    parts = []
    for r in sorted(runs, key=lambda r: r.seed):
        if r.final_step is None:
            return None
        for bench, p in sorted(r.evals[r.final_step].items()):
            parts.append([r.seed, bench, [str(i) for i in p["problem_ids"]], p["correct"]])
    return json.dumps(parts) if parts else None


def identical_results(runs_by_label: Mapping[str, Sequence[RunRecord]]) -> list[list[str]]:
    """Groups (two labels or more) whose final correctness matrices are equal for every seed and benchmark."""
    groups: dict[str, list[str]] = {}
    for label, runs in runs_by_label.items():
        fp = _eval_fingerprint(runs)
        if fp is not None:
            groups.setdefault(fp, []).append(label)
    return [labels for labels in groups.values() if len(labels) > 1]
