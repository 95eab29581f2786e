"""The names verl and TRL users look for, logged to the mirrors (MLflow, W&B, TensorBoard) beside
clipbench's own; the results store keeps clipbench's names only. docs/metrics.md has the map.

    aliases({"q1/out_of_band": 3, "q3/out_of_band": 1, "q1/tokens": 40, ...})
        -> {"actor/pg_clipfrac": 0.04, "clip_ratio/region_mean": 0.04, "clip_ratio/high_mean": 0.03, ...}

Each alias is the same quantity under the other library's name, computed from the row alone:
- the clip fractions: the share of valid tokens (every cell's `tokens`) where the clip binds, i.e.
  tokens out of the reference band on the side the clip acts (A > 0 and r > 1 + eps_high: q1's
  `out_of_band`; A < 0 and r < 1 - eps_low: q3's). verl's `actor/pg_clipfrac` and TRL's
  `clip_ratio/region_mean` are both; TRL's `clip_ratio/high_mean` is q1's alone, `clip_ratio/low_mean`
  q3's. (Both libraries average per micro-batch shares; clipbench's is exact over the optimizer step.)
- renamed values: verl's `actor/entropy`, `actor/grad_norm`, `actor/lr`; TRL's `reward`, `reward_std`,
  `frac_reward_zero_std`, `completions/mean_length`, `completions/clipped_ratio`.
- an evaluation's Avg@n is verl's validation metric `val-core/<benchmark>/reward/mean@<n>` (the mean
  reward over n samples per problem: with a 0/1 reward, the accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from clipbench.objectives.diagnostics import CELLS

RENAMED = {  # clipbench's key -> the names verl and TRL log the same value under
    "entropy": ("actor/entropy",),
    "grad_norm": ("actor/grad_norm",),
    "lr": ("actor/lr",),
    "reward/mean": ("reward",),
    "reward/std": ("reward_std",),
    "zero_var_groups_frac": ("frac_reward_zero_std",),
    "response_length/mean": ("completions/mean_length",),
    "truncated_frac": ("completions/clipped_ratio",),
}
CLIP_FRACTIONS = {  # name -> the cells whose out-of-band tokens it counts
    "actor/pg_clipfrac": ("q1", "q3"),
    "clip_ratio/region_mean": ("q1", "q3"),
    "clip_ratio/high_mean": ("q1",),
    "clip_ratio/low_mean": ("q3",),
}
EVAL = "eval/"


def _number(v: Any) -> float | None:
    """A number; None where the store wrote NaN (as `null`) is NaN, as the trainer sent it live."""
    if v is None:
        return math.nan
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def aliases(metrics: Mapping[str, Any]) -> dict[str, float]:
    """{the other libraries' name: value} of one training row or one evaluation's metrics (see the
    module docstring); names whose inputs the row lacks are left out."""
    out: dict[str, float] = {}
    for key, names in RENAMED.items():
        value = _number(metrics[key]) if key in metrics else None
        if value is not None:
            out.update(dict.fromkeys(names, value))
    tokens = [_number(metrics[f"{c}/tokens"]) for c in CELLS if f"{c}/tokens" in metrics]
    if all(f"{q}/tokens" in metrics for q in ("q1", "q2", "q3", "q4")) and not sum(tokens) <= 0:
        for name, cells in CLIP_FRACTIONS.items():
            if all(f"{c}/out_of_band" in metrics for c in cells):
                out[name] = sum(_number(metrics[f"{c}/out_of_band"]) for c in cells) / sum(tokens)
    for key, v in metrics.items():  # eval/<benchmark>/avg@<n>
        head, _, stat = str(key).rpartition("/")
        if head.startswith(EVAL) and stat.startswith("avg@") and stat[4:].isdigit() and _number(v) is not None:
            out[f"val-core/{head[len(EVAL) :]}/reward/mean@{stat[4:]}"] = float(v)
    return out
