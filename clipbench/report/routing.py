"""Mixture-of-experts routing in the report: per label, mean +- std over seeds.

    label_routing(runs) -> dict | None      # analysis.analyze keeps it under result["routing"]
    routing_table(result["routing"], baseline) -> Table | None   # routing_table.py

From each run's metrics rows (docs/metrics.md: `routing/*`, `experts_moved/<cell>/*`,
`experts_kept/<cell>/*`, logged per optimizer step by a MoE policy on the HF path). Routes can only
move after the first optimizer step of a rollout step (that step's forward is the old forward's), so
the agreement and the clip split are taken over the other, off-policy, steps:
- `moved_first`: the same share at the first optimizer step of each rollout step: 0 by construction
  with none and r2 (that forward is the old one); with r3 the sampler's experts against the trainer's;
- `moved`: % of the valid completion tokens with at least one decoder layer whose experts differ
  from the old forward's (or the sampler's, r3), summed over the off-policy steps
  (sum of `experts_moved/<cell>/tokens` / sum of `<cell>/tokens`);
- `agree`: per layer, % of those tokens whose experts in that layer are the old ones
  (`routing/agree/l<i>`, weighted by each step's tokens);
- `load_maxvio`: the busiest expert's load over the mean load, - 1 (`routing/load_maxvio`: the
  worst layer), the mean over every optimizer step and its maximum;
- `split`: per quadrant (and over all four), % of the quadrant's tokens out of band, for the tokens
  whose experts moved and those whose experts were kept; the token counts are kept too
  (moved + kept = the quadrant's tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from clipbench.report import stats

QUADRANTS = ("q1", "q2", "q3", "q4")
CELLS = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
SPLITS = ("moved", "kept")


def _sum(rows: Sequence[Mapping], key: str) -> float:
    return float(sum(r.get(key) or 0.0 for r in rows))


def _tokens(row: Mapping) -> float:
    return float(sum(row.get(f"{c}/tokens") or 0.0 for c in CELLS))


def off_policy_rows(rows: Sequence[Mapping]) -> list[Mapping]:
    """Every optimizer step's row but the first of each rollout step (rows in optimizer-step order)."""
    seen: set = set()
    out = []
    for r in rows:
        if r.get("step") in seen:
            out.append(r)
        seen.add(r.get("step"))
    return out


def _share(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else math.nan


def run_routing(metrics: Sequence[Mapping]) -> dict | None:
    """One run's figures (module docstring); None when it logged no routing metrics."""
    rows = [r for r in metrics if r.get("routing/changed_frac") is not None]
    if not rows:
        return None
    off = off_policy_rows(rows)
    first = [r for r in rows if not any(r is o for o in off)]
    tokens = sum(_tokens(r) for r in off)
    layers = sorted(int(k.rsplit("/l", 1)[1]) for k in rows[0] if k.startswith("routing/agree/l"))
    split: dict = {}
    for q in (*QUADRANTS, "all"):
        cells = QUADRANTS if q == "all" else (q,)
        for s in SPLITS:
            n = sum(_sum(off, f"experts_{s}/{c}/tokens") for c in cells)
            oob = sum(_sum(off, f"experts_{s}/{c}/out_of_band") for c in cells)
            split[f"{q}/{s}"] = _share(oob, n)
            split[f"{q}/{s}_tokens"] = n
        split[f"{q}/tokens"] = sum(_sum(off, f"{c}/tokens") for c in cells)
    maxvio = [r["routing/load_maxvio"] for r in rows if r.get("routing/load_maxvio") is not None]
    return {
        "steps": len(rows),
        "off_policy_steps": len(off),
        "tokens": tokens,
        "moved": _share(sum(_sum(off, f"experts_moved/{c}/tokens") for c in CELLS), tokens),
        "moved_first": _share(
            sum(_sum(first, f"experts_moved/{c}/tokens") for c in CELLS), sum(_tokens(r) for r in first)
        ),
        "agree": {
            f"l{i}": _share(sum(_tokens(r) * r.get(f"routing/agree/l{i}", math.nan) for r in off), tokens)
            for i in layers
        },
        "load_maxvio": sum(maxvio) / len(maxvio) if maxvio else math.nan,
        "load_maxvio_max": max(maxvio) if maxvio else math.nan,
        "split": split,
    }


def _ms(values: Sequence[float]) -> dict:
    m, s = stats.mean_std(values)
    return {"mean": m, "std": s}


def label_routing(runs) -> dict | None:
    """Mean and std over seeds of `run_routing` (load_maxvio_max: the maximum; token counts: summed)."""
    per_run = [r for r in (run_routing(run.metrics) for run in runs) if r is not None]
    if not per_run:
        return None
    first = per_run[0]
    return {
        "seeds": len(per_run),
        "tokens": sum(r["tokens"] for r in per_run),
        "moved": _ms([r["moved"] for r in per_run]),
        "moved_first": _ms([r["moved_first"] for r in per_run]),
        "agree": {k: _ms([r["agree"].get(k, math.nan) for r in per_run]) for k in first["agree"]},
        "load_maxvio": _ms([r["load_maxvio"] for r in per_run]),
        "load_maxvio_max": {"mean": max(r["load_maxvio_max"] for r in per_run), "std": 0.0},
        "split": {
            k: (
                {"mean": sum(r["split"][k] for r in per_run), "std": 0.0}
                if k.endswith("tokens")
                else _ms([r["split"][k] for r in per_run])
            )
            for k in first["split"]
        },
    }


def reading(by_block: Mapping[str, Mapping[str, dict]]) -> str | None:
    """One sentence: were the moved tokens out of band more often than the kept ones, arm by arm (the
    four quadrants together, mean over seeds)? None when no arm has both kinds of token."""
    parts, signs = [], []
    for labels in by_block.values():
        for lb, e in labels.items():
            moved, kept = e["split"]["all/moved"]["mean"], e["split"]["all/kept"]["mean"]
            if math.isnan(moved) or math.isnan(kept):
                continue
            parts.append(f"{lb} {moved:.1f}% vs {kept:.1f}%")
            signs.append((moved > kept) - (moved < kept))
    if not parts:
        return None
    verdict = (
        "more often than"
        if all(s > 0 for s in signs)
        else "less often than"
        if all(s < 0 for s in signs)
        else "as often as"
        if all(s == 0 for s in signs)
        else "sometimes more, sometimes less often than"
    )
    return (
        f"Reading: on the off-policy steps the clip's band excluded tokens whose experts moved {verdict} tokens "
        f"whose experts were kept (out of band, moved vs kept, Q1-Q4: {'; '.join(parts)}); a description of "
        "these runs, not a test."
    )
