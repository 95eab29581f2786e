"""The report's first line: one sentence saying what the sweep found and which claims hold.

    finding_line(result) -> str | None

From numbers the report already has: each arm's gain over the base model (the Average row's Avg@n
minus the base model's, per block; the line names the benchmarks it averages), each arm's difference with the
baseline (its interval, its paired seeds and, when the interval holds 0, the seeds 80% power needs; every
arm when they are few, else the user's own rules), the critical learning rates when the sweep has a learning-rate
axis (report/stability.py; with --tune-on, each rule's best rate first), and the claims' verdicts (report/claims/) with whether they replicate.
"""

from __future__ import annotations

import math

from clipbench.objectives import METHODS
from clipbench.report.stability_table import best_text, critical_text, fit_text, ratio_text
from clipbench.report.stats import seeds_needed
from clipbench.report.tables import BENCH_TITLES, model_title

SHOWN = 4  # claims named per verdict; the rest are counted


def _gains(block: dict) -> dict[str, float]:
    """{label: Avg@n gain over the base model, points} of one block (benchmarks averaged)."""
    avg = _average(block)
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


def _average(block: dict) -> dict | None:
    """The Average rows (benchmarks averaged), or the one benchmark's."""
    return block["average"] if block["average"]["rows"] else next(iter(block["benchmarks"].values()), None)


def _names(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def _over(gain: float) -> str:
    """'1.2 points over the base model' / '1.2 points below' / 'level with'."""
    if round(gain, 1) == 0.0:
        return "level with the base model"
    return f"{abs(gain):.1f} points {'over' if gain > 0 else 'below'} the base model"


def _range(gains: dict[str, float], where: str) -> str:
    """The arms' gains: the best and the worst (every arm that ties with either, as printed)."""
    shown = {lb: round(g, 1) for lb, g in gains.items()}
    top = [lb for lb, g in shown.items() if g == max(shown.values())]
    bottom = [lb for lb, g in shown.items() if g == min(shown.values())]
    if top == bottom:
        verb = "ends" if len(top) == 1 else "each end"
        return f"{_names(top)} {verb} {_over(gains[top[0]])}{where}"
    return (
        f"the gain over the base model{where} runs from {gains[top[0]]:+.1f} points ({_names(top)}) to "
        f"{gains[bottom[0]]:+.1f} ({_names(bottom)})"
    )


def _compared(block: dict, baseline: str | None) -> list[str]:
    """The arms the Finding compares with the baseline: every other arm when they are few (SHOWN),
    else the user's own rules (plugins) alone."""
    others = [lb for lb in block["labels"] if lb != baseline]
    if baseline not in block["labels"] or len(others) <= SHOWN:
        return others if baseline in block["labels"] else []
    return [lb for lb in others if getattr(METHODS.get(block["labels"][lb]["method"]), "origin", None) is not None]


def _versus(block: dict, baseline: str | None) -> str | None:
    """'against grpo: lower_only -0.8 points [-3.1, +1.5] (3 paired seeds; 80% power at this difference
    needs 14 seeds per arm)': each compared arm's Avg@n difference with the baseline, its 95% t interval
    over the paired seeds, and, when the interval holds 0, the seeds a paired t test needs to detect a
    difference of this size with 80% power (stats.seeds_needed)."""
    avg = _average(block)
    parts = []
    for lb in _compared(block, baseline):
        cell = ((avg or {}).get("rows", {}).get(lb) or {}).get("metrics", {}).get("avg", {})
        if cell.get("delta") is None or not math.isfinite(cell["delta"]):
            continue
        d, (lo, hi), n = 100.0 * cell["delta"], cell["delta_ci"], cell["paired_seeds"]
        if n < 2 or not (math.isfinite(lo) and math.isfinite(hi)):
            parts.append(f"{lb} {d:+.1f} points ({n} paired seed{'s' * (n != 1)}: no interval)")
            continue
        if lo > 0 or hi < 0 or lo == hi:
            power = "told apart"
        else:
            need = seeds_needed(100.0 * cell.get("delta_sd", math.nan), d)
            power = (
                f"80% power at this difference needs {need} seeds per arm"
                if need is not None
                else "no number of seeds detects a difference this small"
            )
        parts.append(f"{lb} {d:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}] ({n} paired seeds; {power})")
    return f"against {baseline} ({_metric_text(block)}, 95% t CI over seeds): " + "; ".join(parts) if parts else None


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
        per_arm = "" if len(gains) == 1 else " per arm"
        parts.append(f"{_range(gains, where)} ({_metric_text(block)}, mean of {seeds_text}{per_arm})")
        versus = _versus(block, result.get("baseline"))
        if versus:
            parts.append(versus)
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
