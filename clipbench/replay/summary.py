"""A replay's rows summarised per trained rule: what the report's replay section shows.

    summary = summarize(result)      # {"references": [{"reference": "grpo", "rules": [...], "per_rule": {...},
                                     #   "token_cosine": [[...]], "param_cosine": ..., "identical": [[...]], "tokens": [...]}]}

Per rule, over every replayed optimizer step of the runs that trained the reference rule: the mean
and standard deviation (over optimizer steps) of the token-level cosine with the reference's
gradient, of the norm ratio, of the departure sum|g - g_ref| / sum|g_ref| (in total and per cell),
and the departure pooled over the steps (`pooled/departure*`: each step weighted by sum|g_ref|);
the zero-gradient, out-of-band and rescued shares of each quadrant's tokens (summed counts); the
parameter-level cosine and the lookahead, where the records hold the policy state. Rules whose
token-level gradients coincide with each other on every replayed step (cosine and norm ratio within
1e-6 of 1) are listed as identical on these batches.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

QUADRANTS = QUADS = ("q1", "q2", "q3", "q4")
IDENTICAL = 1e-6
MEANS = (
    "loss",
    "grad_cosine",
    "grad_norm_ratio",
    "departure",
    *(f"departure/{q}" for q in QUADRANTS),
    "param/grad_cosine",
    "param/grad_norm_ratio",
    "lookahead/kl",
    "lookahead/entropy_change",
    "lookahead/dlogp_correct",
    "lookahead/dlogp_incorrect",
    "grad_cosine/std",
)


def _finite(xs) -> list[float]:
    return [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def _mean_sd(xs) -> dict | None:
    xs = _finite(xs)
    if not xs:
        return None
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def _pooled(rows: list[dict], key: str) -> float | None:
    """A departure over all the rows' tokens: sum over steps of sum|g - g_ref| over sum of sum|g_ref|
    (each step's relative departure weighted by the reference's gradient mass)."""
    pairs = [
        (r[key], r.get("ref_l1", 0.0))
        for r in rows
        if isinstance(r.get(key), float) and math.isfinite(r[key]) and r.get("ref_l1", 0.0) > 0
    ]
    w = sum(x[1] for x in pairs)
    return sum(d * m for d, m in pairs) / w if w > 0 else None


def _rule_summary(rows: list[dict]) -> dict:
    out = {key: _mean_sd(r.get(key) for r in rows) for key in MEANS}
    for key in ("departure", *(f"departure/{q}" for q in QUADS)):
        out[f"pooled/{key}"] = _pooled(rows, key)
    for q in QUADRANTS:
        tokens = sum(r.get(f"{q}/tokens", 0) for r in rows)
        for count in ("zero_grad", "out_of_band", "rescued"):
            out[f"{count}/{q}"] = sum(r.get(f"{q}/{count}", 0) for r in rows) / tokens if tokens else None
        out[f"tokens/{q}"] = tokens
    out["steps"] = len(rows)
    return out


def _mean_matrix(mats: list[list[list[float]]]) -> list[list[float]] | None:
    if not mats:
        return None
    n = len(mats[0])
    return [[statistics.fmean(m[i][j] for m in mats) for j in range(n)] for i in range(n)]


def _identical(matrices: list[dict], labels: list[str]) -> list[list[str]]:
    """Groups of rules whose token-level gradients coincide on every replayed optimizer step."""
    same = {(a, b): True for a in labels for b in labels}
    for m in matrices:
        pos = {k: i for i, k in enumerate(m["rules"])}
        for a in labels:
            for b in labels:
                if a in pos and b in pos:
                    i, j = pos[a], pos[b]
                    na, nb = m["norms"][i], m["norms"][j]
                    close = abs(na - nb) <= IDENTICAL * max(na, nb, 1e-30) and (
                        na == nb == 0 or m["token"][i][j] >= 1 - IDENTICAL
                    )
                    same[a, b] = same[a, b] and close
    groups, seen = [], set()
    for a in labels:
        if a in seen:
            continue
        g = [b for b in labels if b not in seen and same[a, b]]
        seen.update(g)
        if len(g) > 1:
            groups.append(g)
    return groups


def summarize(result, top_tokens: int = 3) -> dict:
    """The summary of a ReplayResult (replay/run.py), one entry per trained rule."""
    by_ref: dict[str, list[dict]] = defaultdict(list)
    for r in result.rows:
        if "skipped" not in r:
            by_ref[r["trained_rule"]].append(r)
    refs = []
    for ref, rows in by_ref.items():
        labels = list(dict.fromkeys(r["rule"] for r in rows))
        mats = [m for m in result.matrices if m["trained_rule"] == ref]
        full = [m for m in mats if m["rules"] == labels]
        per_rule = {lb: _rule_summary([r for r in rows if r["rule"] == lb]) for lb in labels}
        tokens = sorted(
            (t for t in result.tokens if t["trained_rule"] == ref), key=lambda t: -abs(t["g"] - t["g_trained"])
        )
        refs.append(
            {
                "reference": ref,
                "runs": sorted({r["run_id"] for r in rows}),
                "opt_steps": len({(r["run_id"], r["opt_step"]) for r in rows}),
                "rules": labels,
                "per_rule": per_rule,
                "token_cosine": _mean_matrix([m["token"] for m in full]),
                "param_cosine": _mean_matrix([m["param"] for m in full if "param" in m]),
                "param_steps": sum("param" in m for m in full),
                "identical": _identical(full, labels),
                "tokens": _top_per_rule(tokens, top_tokens),
            }
        )
    return {
        "references": refs,
        "notes": list(result.notes),
        "partial": list(result.partial),  # recorded steps whose records are gone: a partial replay
        "skipped": sorted({f"{r['rule']}: {r['skipped']}" for r in result.rows if "skipped" in r}),
    }


def _top_per_rule(tokens: list[dict], k: int) -> list[dict]:
    """The k tokens of largest |g - g_ref| for each rule (tokens sorted by it already)."""
    count: dict[str, int] = defaultdict(int)
    out = []
    for t in tokens:
        if count[t["rule"]] < k:
            count[t["rule"]] += 1
            out.append(t)
    return out
