"""The report's first line: one sentence saying what the sweep found and which claims hold.

    finding_line(result) -> str | None

From numbers the report already has: each arm's gain over the base model (the Average row's Avg@n
minus the base model's, per block; the line names the benchmarks it averages), the critical learning rates when the sweep has a learning-rate
axis (report/stability.py; with --tune-on, each rule's best rate first), and the claims' verdicts (report/claims.py) with whether they replicate.
"""

from __future__ import annotations

import math

from clipbench.report.stability_table import best_text, critical_text, fit_text, ratio_text
from clipbench.report.tables import BENCH_TITLES, model_title

SHOWN = 4  # claims named per verdict; the rest are counted


def _gains(block: dict) -> dict[str, float]:
    """{label: Avg@n gain over the base model, points} of one block (benchmarks averaged)."""
    avg = block["average"] if block["average"]["rows"] else next(iter(block["benchmarks"].values()), None)
    if not avg or not avg.get("base"):
        return {}
    base = avg["base"]["metrics"]["avg"]["mean"]
    return {
        lb: 100.0 * (row["metrics"]["avg"]["mean"] - base)
        for lb, row in avg["rows"].items()
        if math.isfinite(row["metrics"]["avg"]["mean"])
    }


def _metric_text(block: dict) -> str:
    """'Avg@8', or 'Avg@64 averaged over arith and arith (validation)' when the gains average several
    benchmarks (a test and a validation split, say): the line says what it averages."""
    averaged = block["average"].get("benchmarks") if block["average"]["rows"] else None
    if not averaged or len(averaged) < 2:
        return f"Avg@{block['n']}"
    names = [BENCH_TITLES.get(b, b) for b in averaged]
    return f"Avg@{block['n']} averaged over {', '.join(names[:-1])} and {names[-1]}"


def _outcome(result: dict) -> list[str]:
    parts = []
    multi = len(result["blocks"]) > 1
    for block in result["blocks"]:
        gains = _gains(block)
        if not gains:
            continue
        seeds = sorted({len(info["seeds"]) for info in block["labels"].values()})
        seeds_text = (f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}") + (
            " seed" if seeds[-1] == 1 else " seeds"
        )
        where = f" on {model_title(block['model'])}" if multi else ""
        best, worst = max(gains, key=gains.get), min(gains, key=gains.get)
        if best == worst:
            parts.append(
                f"{best} ends {gains[best]:+.1f} points over the base model{where} ({_metric_text(block)}, "
                f"mean of {seeds_text})"
            )
        else:
            parts.append(
                f"the gain over the base model{where} runs from {gains[best]:+.1f} points ({best}) to "
                f"{gains[worst]:+.1f} ({worst}) ({_metric_text(block)}, mean of {seeds_text} per arm)"
            )
    for model, block in (result.get("stability") or {}).items():
        where = " on " + model_title(model) if multi else ""
        if block.get("bench"):  # a tuning sweep (--tune-on): the rates it chose come first
            best = "; ".join(f"{rule} {best_text(info['best'])}" for rule, info in block["rules"].items())
            parts.append(f"best rates{where} by the gain on {block['bench']}: {best}")
        crit = "; ".join(_critical(rule, info, block.get("reference")) for rule, info in block["rules"].items())
        parts.append(f"critical learning rates{where}: {crit}")
    return parts


def _critical(rule: str, info: dict, reference: str | None) -> str:
    """'grpo 0.0002 (fit [95% CI over seeds]: ...; ladder [lower, upper))'."""
    fit = fit_text(info.get("fit"))
    ratio = ratio_text(info.get("fit")) if reference and rule != reference else ""
    said = f"fit {fit}" + (f", {ratio} x {reference}'s" if ratio else "") + "; " if fit else ""
    return f"{rule} {said}ladder {critical_text(info['critical'])}"


def _claim_name(c: dict) -> str:
    rep = (c.get("replication") or {}).get("status")
    tag = (
        f", {rep}"
        if rep in ("replicates", "fragile")
        else (f", split halves {rep}" if rep in ("consistent", "inconsistent") else "")
    )
    return f"{c['claim']} ({c['comparison']}, {c['estimate']:+.3g}{tag})"


def _claims(claims: list[dict]) -> str | None:
    if not claims:
        return None
    said = []
    for verdict in ("holds", "does not hold"):
        hits = [c for c in claims if c["verdict"] == verdict]
        if hits:
            names = "; ".join(_claim_name(c) for c in hits[:SHOWN])
            more = f"; and {len(hits) - SHOWN} more" if len(hits) > SHOWN else ""
            verb = {
                ("holds", True): "holds",
                ("holds", False): "hold",
                ("does not hold", True): "does not hold",
                ("does not hold", False): "do not hold",
            }[(verdict, len(hits) == 1)]
            said.append(f"{len(hits)} {verb}: {names}{more}")
    rest = sum(c["verdict"].startswith("inconclusive") for c in claims)
    if rest:
        said.append(f"{rest} inconclusive at this scale")
    family = max((c.get("family") or 0 for c in claims), default=0)
    return f"of {len(claims)} claims (one family, Holm over {family}), " + ", ".join(said)


def finding_line(result: dict) -> str | None:
    """'Finding: ...; of N claims, H hold: ...' or None when there is nothing to say."""
    parts = _outcome(result)
    claims = _claims(result.get("claims", []))
    if claims:
        parts.append(claims)
    if not parts:
        return None
    return f"Finding: {'; '.join(parts)}."
