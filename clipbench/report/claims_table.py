"""The claims table and the provenance table (display strings), from ``result["claims"]`` and
``result["provenance"]``; `add_claim_tables` puts them before the runs table of `tables.build_tables`.

- ``claims``: per claim its figure, 95% CI, test, n, p, verdict (an inconclusive one with what would
  detect its estimate), the smallest effect the design detects at 80% power, and whether the verdict
  replicates (report/replication.py);
- ``provenance``: one row per (base model, weights sha256, machine) with its runs (report/machines.py).
"""

from __future__ import annotations

import math

from clipbench.report.replication import HALVES, MIN_PER_HALF, seed_ranges
from clipbench.report.tables import Table, model_title

# ---- the papers' claims -------------------------------------------------------------------------


def _p_text(p: float | None) -> str:
    return "" if p is None or not math.isfinite(p) else (f"{p:.3f}" if p >= 0.001 else "<0.001")


def claim_verdict_cell(c: dict) -> str:
    """The verdict; an inconclusive one says what would detect its observed difference; runs from
    several base-model checksums are said."""
    text = c["verdict"]
    need = c.get("needed")
    if need and need["unit"] == "seeds":
        text += f"; {c['estimate']:+.3g} needs {need['n']} paired seeds at 80% power (has {c['n']})"
    elif need:
        text += (
            f"; {c['estimate']:+.3g} needs ~{need['factor']:.1f}x the problems ({need['n']:,}) at 80% power "
            f"(or fewer with more samples per problem)"
        )
    machines = c.get("machines") or []
    if len(machines) > 1:
        text += f" [runs from {len(machines)} machines: the same run ids give different numbers on each]"
    known = [x for x in c.get("checksums", []) if x]
    if len(known) > 1:
        text += f" [runs from {len(known)} different base models: weights sha256 {', '.join(x[:8] for x in known)}]"
    return text


def _ci_text(ci) -> str:
    """' [-0.6, +1.1]'; '' without a finite interval (or a replication part written before parts kept it)."""
    if not ci or not all(math.isfinite(x) for x in ci):
        return ""
    return f" [{ci[0]:+.3g}, {ci[1]:+.3g}]"


def _holm_text(p_holm) -> str:
    """', p Holm 0.017' (the part's verdict is read at it); '' where the part has no family."""
    return f", p Holm {text}" if (text := _p_text(p_holm)) else ""


def replication_cell(c: dict) -> str:
    rep = c.get("replication")
    if not rep:
        return ""
    if rep["status"] == "not tested":
        return f"not tested: {rep['reason']}"
    short = {"inconclusive at this scale": "inconclusive"}
    parts = "; ".join(
        f"{x['name']}: {short.get(x['verdict'], x['verdict'])} {x['estimate']:+.3g}{_ci_text(x.get('ci'))}, "
        f"p {_p_text(x['p'])}{_holm_text(x.get('p_holm'))}"
        for x in rep["parts"]
    )
    mine = set(c.get("machines") or [])
    other = {m for x in rep["parts"] for m in x.get("machines") or []}
    where = " [on another machine: the same run ids need not give the same numbers]" if mine and other - mine else ""
    return f"{rep['status']} ({parts}){where}"


def consistency_title(rows: list[dict]) -> str:
    """'Split-half consistency' for the halves of one sweep's seeds, 'Replication' against another sweep."""
    by = next(((c.get("replication") or {}).get("by") for c in rows if c.get("replication")), None)
    return "Split-half consistency" if by == HALVES else "Replication"


def claims(rows: list[dict]) -> Table | None:
    """One row per claim that applies to the sweep (clipbench.report.claims): figure, CI, test, verdict,
    the smallest effect the design detects, and whether the verdict replicates (report/replication.py)."""
    if not rows:
        return None
    cols = [
        "Claim (source)",
        "Comparison",
        "Figure",
        "Estimate [95% CI]",
        "Test",
        "n",
        "p",
        "p Holm",
        "Verdict",
        "Detectable (80% power)",
        consistency_title(rows),
    ]
    t = Table("claims", "The papers' claims at this scale", cols, sections=False)
    for c in rows:
        mde = c.get("mde", math.nan)
        flagged = (
            c["verdict"] == "does not hold"
            or (c.get("replication") or {}).get("status") in ("fragile", "inconsistent")
            or len([x for x in c.get("checksums", []) if x]) > 1
            or len(c.get("machines") or []) > 1
        )
        t.add(
            [
                f"{c['claim']} ({c['source']})",
                c["comparison"],
                c["figure"],
                f"{c['estimate']:+.3g}{_ci_text(c['ci'])}",
                c["test"],
                str(c["n"]),
                _p_text(c["p"]),
                _p_text(c.get("p_holm")),
                claim_verdict_cell(c),
                f"±{mde:.3g}" if math.isfinite(mde) else "",
                replication_cell(c),
            ],
            "flagged" if flagged else "",
        )
    by = next(((c.get("replication") or {}).get("by") for c in rows if c.get("replication")), None)
    family = max((c.get("family") or 0 for c in rows), default=0)
    t.notes = [
        f"The {len(rows)} claims are one family: p is each claim's own test, p Holm that p adjusted by Holm's "
        f"method over the family ({family} tested; statsmodels multipletests). Verdicts are read at p Holm: holds: "
        "the claimed sign and p Holm < 0.05; does not hold: the opposite sign and p Holm < 0.05; else "
        "inconclusive at this scale. 'does not lose' claims are non-inferiority tests against their declared "
        "margin (the estimate against -margin; holds when the 95% interval's lower end lies above -margin, "
        "after correction), 'no difference' claims equivalence tests (TOST within +-margin). Training figures "
        "are paired by seed; accuracy too from 2 seeds on (each seed's Avg@n), by problem with one seed (the "
        "bootstrap: within-seed noise only, it speaks for that trained model, not for another seed). "
        "See clipbench/report/claims/ and docs/reports.md.",
        "Detectable: the smallest difference this design detects with 80% power at p < 0.05 (two-sided), "
        "(t(0.975, df) + t(0.80, df)) x se, se from the observed spread: of the seed differences for a "
        "paired t (df = seeds - 1), of the per-problem differences for the bootstrap (df = problems - 1; "
        "Welch for several benchmarks). An inconclusive verdict says what would detect its estimate.",
        (
            f"Split-half consistency: the claim's seeds sorted, first half and second half, each computed alone "
            f"(its own family, Holm); consistent when each half reaches the whole's verdict with its sign (for an "
            f"inconclusive verdict: each half inconclusive too, same sign), inconsistent otherwise; not tested "
            f"below {MIN_PER_HALF} seeds per half. Both halves share the sweep's build, machine and code: this is "
            f"consistency, not replication (`clipbench report --replicate` checks another sweep)."
            if by == HALVES
            else f"Replication ({by or 'against another sweep'}): replicates when the other sweep reaches this "
            "verdict with its sign (for an inconclusive verdict: inconclusive too, same sign); fragile otherwise."
        ),
    ]
    return t


def provenance(summary: dict | None) -> Table | None:
    """Where the compared runs ran and from which base-model bytes (report/machines.py)."""
    if not summary or len(summary["unrecorded"]) == sum(len(r["runs"]) for r in summary["rows"]):
        return None  # nothing recorded (a store written before provenance was): the header says so
    cols = ["Base model", "Weights sha256", "Machine", "Runs", "Methods (seeds)"]
    t = Table("provenance", "Where the runs ran and what they started from", cols, sections=False)
    for row in summary["rows"]:
        who = "; ".join(f"{lb} ({seed_ranges(seeds)})" for lb, seeds in row["labels"].items())
        t.add(
            [model_title(row["model"]), row["weights_sha256"][:16], row["machine"], str(len(row["runs"])), who],
            "flagged" if row["model"] in summary["mixed"] else "",
        )
    t.notes = [
        "From each run's provenance.json (one record per start or resume; a run resumed elsewhere is on "
        "each machine's row). Weights sha256: the base model's weight files (first 16 hex digits; unknown "
        "for runs written before it was recorded or hub ids not in the local cache). The same numbers are "
        "expected only on the same machine, thread count and world size; flagged rows: one base model "
        "name, several checksums."
    ]
    return t


def add_claim_tables(tables: list[Table], result: dict) -> list[Table]:
    """`tables` with the claims and provenance tables inserted before the runs table (else at the end)."""
    extra = [t for t in (claims(result.get("claims", [])), provenance(result.get("provenance"))) if t is not None]
    at = next((i for i, t in enumerate(tables) if t.key == "runs"), len(tables))
    return tables[:at] + extra + tables[at:]
