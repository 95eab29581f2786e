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
- Each flag names its kind of collapse (``run_health(...)["kinds"]``), from the dynamics the store
  has per step, with the same windows: entropy collapse (below a tenth of its start) or blow-up
  (above twice its start); length collapse (mean completion length below half its start) or blow-up
  (above 1.5 x its start); ratio explosion (the largest token ratio, mean over the last window, above
  10); no learning signal (gradient norm below a tenth of its start: every group's rewards equal, so
  every advantage is 0); reward collapse; accuracy collapse (below half of step 0); accuracy below
  base (the 95% t interval over problems of the final-minus-step-0 Avg@n lies below 0).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from clipbench.config.stored import recorded
from clipbench.report.load import RunRecord
from clipbench.report.stats import t_interval
from clipbench.tracking.store import RunState

WINDOW = 0.1  # share of the rollout steps averaged at the start and at the end
REWARD_COLLAPSE = 0.5  # flagged when the end is below this fraction of the start
ENTROPY_COLLAPSE = 0.1
ACCURACY_COLLAPSE = 0.5
FROZEN_TOL = 1e-7  # |ratio - 1| below this on every off-policy mini-batch: the policy never moved
ENTROPY_BLOWUP = 2.0  # flagged when the end is above this multiple of the start
LENGTH_COLLAPSE = 0.5
LENGTH_BLOWUP = 1.5
RATIO_EXPLOSION = 10.0  # mean of ratio/max over the last window above this
SIGNAL_LOST = 0.1  # grad_norm's end below this fraction of its start

# The kinds of collapse a run's flags name (run_health(...)["kinds"]), in the order they are checked.
KINDS = (
    "entropy collapse",
    "entropy blow-up",
    "length collapse",
    "length blow-up",
    "ratio explosion",
    "no learning signal",
    "reward collapse",
    "accuracy collapse",
    "accuracy below base",
)

RULES = (
    f"Flags: reward collapse = mean reward over the last {WINDOW:.0%} of rollout steps (at least one) below "
    f"{REWARD_COLLAPSE:g} x its mean over the first {WINDOW:.0%}; entropy collapse = the same with "
    f"{ENTROPY_COLLAPSE:g} x; accuracy collapse = a benchmark's final Avg@n below {ACCURACY_COLLAPSE:g} x its "
    f"step-0 value; policy frozen = ratio exactly 1 on every off-policy mini-batch; skipped = optimizer "
    f"steps skipped as non-finite (loss or gradient norm); entropy blow-up = entropy's end above "
    f"{ENTROPY_BLOWUP:g} x its start; length collapse / blow-up = mean completion length's end below "
    f"{LENGTH_COLLAPSE:g} x / above {LENGTH_BLOWUP:g} x its start; ratio explosion = the largest token ratio "
    f"(ratio/max), mean over the last {WINDOW:.0%} of rollout steps, above {RATIO_EXPLOSION:g}; no learning "
    f"signal = gradient norm's end below {SIGNAL_LOST:g} x its start (all advantages 0); accuracy below base = "
    f"the 95% t interval over problems of a benchmark's final minus step-0 Avg@n lies below 0."
)


def total_steps(run: RunRecord) -> int | None:
    steps = recorded(run.config, "train.steps")  # None: a partial config, the total unknown
    return int(steps) if isinstance(steps, int) else None


def steps_done(run: RunRecord) -> int:
    """Rollout steps with metrics in the store."""
    return 1 + max((int(r["step"]) for r in run.metrics if isinstance(r.get("step"), int)), default=-1)


def exclusion_reason(run: RunRecord) -> str | None:
    """None for a run the report compares; else why it is left out (one short sentence)."""
    steps = total_steps(run)
    done = steps_done(run)
    of = f"{done}/{steps}" if steps else str(done)
    if run.state == RunState.FAILED:
        err = str(run.status.get("error") or "").strip().splitlines()
        return f"failed after {of} steps" + (f": {err[0][:160]}" if err else "")
    if run.state == RunState.PREEMPTED:
        return f"preempted after {of} steps (checkpointed: rerun the sweep to resume it)"
    if run.state != RunState.FINISHED:
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


def _ratio_check(
    series: Sequence[float], kind: str, low: float | None, high: float | None
) -> tuple[str, dict | None] | None:
    """(flag, start/end) when a series' end leaves [low x start, high x start]; None when it stays."""
    se = _start_end(series)
    if se is None or not se[0] > 0:
        return None
    start, end = se
    if low is not None and end < low * start:
        return f"{kind} collapse ({start:.3g} -> {end:.3g})", {"start": start, "end": end}
    if high is not None and end > high * start:
        return f"{kind} blow-up ({start:.3g} -> {end:.3g})", {"start": start, "end": end}
    return None


def _accuracy_flags(run: RunRecord) -> list[str]:
    """Accuracy collapse (final below half of step 0) and accuracy below base (the t interval over
    problems of final - step-0 per-problem Avg@n below 0), per benchmark."""

    flags: list[str] = []
    if not (run.evals and 0 in run.evals and run.final_step not in (None, 0)):
        return flags
    for bench, start in run.evals[0].items():
        end = run.evals[run.final_step].get(bench)
        if end is None:
            continue
        a, b = np.mean(start["correct"]), np.mean(end["correct"])
        if a > 0 and b < ACCURACY_COLLAPSE * a:
            flags.append(f"accuracy collapse on {bench} (Avg@n {100 * a:.1f}% -> {100 * b:.1f}%)")
            continue
        before = dict(zip(map(str, start["problem_ids"]), np.mean(start["correct"], axis=1)))
        diffs = [
            v - before[p] for p, v in zip(map(str, end["problem_ids"]), np.mean(end["correct"], axis=1)) if p in before
        ]
        if len(diffs) >= 2 and t_interval(diffs)[1] < 0:
            flags.append(f"accuracy below base on {bench} (Avg@n {100 * a:.1f}% -> {100 * b:.1f}%)")
    return flags


def flag_kind(flag: str) -> str | None:
    """The kind of collapse a flag names (one of KINDS), None for other flags (skipped steps, frozen)."""
    return next((k for k in KINDS if flag.startswith(k)), None)


def run_health(run: RunRecord) -> dict:
    """{"steps_done", "steps", "opt_steps", "skipped", "skipped_frac", "flags": [str], "kinds": [str],
    "reward", "entropy"}: kinds are the kinds of collapse the flags name (KINDS)."""
    opt_steps = len(run.metrics)
    skipped = max(
        [int(r["skipped_nonfinite"]) for r in run.metrics if isinstance(r.get("skipped_nonfinite"), (int, float))]
        + [int(run.status.get("skipped_nonfinite") or 0)]
    )
    flags: list[str] = list(run.lost)  # training rows the store lost (report/load.py)
    out: dict = {
        "steps_done": steps_done(run),
        "steps": total_steps(run),
        "opt_steps": opt_steps,
        "skipped": skipped,
        "skipped_frac": skipped / opt_steps if opt_steps else 0.0,
    }
    if skipped:
        flags.append(f"skipped {skipped} of {opt_steps} optimizer steps (non-finite)")
    for key, name, frac in (("reward/mean", "reward", REWARD_COLLAPSE), ("entropy", "entropy", None)):
        se = _start_end(_step_series(run, key))
        out[name] = None if se is None else {"start": se[0], "end": se[1]}
        if frac is not None and se is not None and se[0] > 0 and se[1] < frac * se[0]:
            flags.append(f"{name} collapse ({se[0]:.3g} -> {se[1]:.3g})")
    checks = (
        ("entropy", "entropy", ENTROPY_COLLAPSE, ENTROPY_BLOWUP),
        ("response_length/mean", "length", LENGTH_COLLAPSE, LENGTH_BLOWUP),
    )
    for key, kind, low, high in checks:
        got = _ratio_check(_step_series(run, key), kind, low, high)
        flags += [got[0]] if got else []
    ratio = _step_series(run, "ratio/max")
    if len(ratio) >= 2:
        end = float(np.mean(ratio[-max(1, int(len(ratio) * WINDOW)) :]))
        if end > RATIO_EXPLOSION:
            flags.append(f"ratio explosion (largest ratio {end:.3g} over the last steps)")
    grad = _start_end(_step_series(run, "grad_norm"))
    if grad is not None and grad[0] > 0 and grad[1] < SIGNAL_LOST * grad[0]:
        flags.append(f"no learning signal (gradient norm {grad[0]:.3g} -> {grad[1]:.3g})")
    flags += _accuracy_flags(run)
    off_policy = [r for r in run.metrics if (r.get("mini_batch") or 0) > 0 or (r.get("epoch") or 0) > 0]
    ratios = [(r.get("ratio/min"), r.get("ratio/max")) for r in off_policy]
    ratios = [(lo, hi) for lo, hi in ratios if isinstance(lo, (int, float)) and isinstance(hi, (int, float))]
    if ratios and all(abs(lo - 1) < FROZEN_TOL and abs(hi - 1) < FROZEN_TOL for lo, hi in ratios):
        flags.append("policy frozen (ratio = 1 on every off-policy mini-batch)")
    out["flags"] = flags
    out["kinds"] = [k for k in (flag_kind(f) for f in flags) if k is not None]
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
