"""Whether a claim's verdict holds up: split-half consistency (the same verdict on two disjoint halves
of its seeds) or replication (the same verdict on a second sweep: another build, other seeds or
another machine, `clipbench report A --replicate B`).

    replicate_by_halves(claims, compared)        # in place: each claim's .replication (split-half consistency)
    replicate_against(claims, other, "B")        # the same, against sweep B's claims (replication)

Two halves of one sweep's seeds share its build, machine and code: their agreement is consistency,
not replication, and with the effects of the studies it mostly measures power (two halves of 10 seeds
both reach significance about a third of the time), so it is tested only from MIN_PER_HALF (5) seeds
per half and never called "replicates".

Halves: the claim's seeds (those both of its arms have) sorted, the first half ``seeds[:n // 2]``
and the second ``seeds[n // 2:]`` (10 seeds: 0-4 and 5-9); the claim is computed again, by the
same code (`claims.evaluate_claims`), on each half's runs alone.

- "consistent" (halves) / "replicates" (sweep B): each half (or sweep B) reaches the whole's verdict
  (holds, does not hold or inconclusive at this scale) with the whole's sign; each half's verdict is
  read at Holm over that half's own family of claims, as the whole's.
- "inconsistent" (halves) / "fragile" (sweep B): any other outcome (a verdict only the pooled seeds
  reach; an inconclusive one whose halves point opposite ways or reach significance).
- "not tested": fewer than MIN_PER_HALF seeds in a half (a t-test of 2 or 3 seeds has 1 or 2 degrees
  of freedom; a one-seed claim has no halves), said with the count, never guessed; or the claim has
  no value on one half (or sweep B does not have it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from clipbench.config.claims import ClaimFamily
from clipbench.report.claims import ClaimResult, cliffs, evaluate_claims
from clipbench.report.load import RunRecord

REPLICATES, FRAGILE, NOT_TESTED = "replicates", "fragile", "not tested"
CONSISTENT, INCONSISTENT = "consistent", "inconsistent"
MIN_PER_HALF = 5  # seeds per half from which split-half consistency is tested
HALVES = "split-half consistency (two halves of the seeds)"


def seed_ranges(seeds: Sequence[int]) -> str:
    """[0, 1, 2, 3, 4, 7] -> '0-4, 7'."""
    out: list[str] = []
    s = sorted(seeds)
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ", ".join(out)


def seeds_name(seeds: Sequence[int]) -> str:
    return f"seed{'s' if len(seeds) > 1 else ''} {seed_ranges(seeds)}"


def halves(seeds: Sequence[int]) -> tuple[list[int], list[int]]:
    s = sorted(seeds)
    return s[: len(s) // 2], s[len(s) // 2 :]


def min_per_half(claim: ClaimResult) -> int:
    """Seeds each half needs: MIN_PER_HALF, whatever the test (a one-seed claim has no halves)."""
    return MIN_PER_HALF


def _sign(x: float) -> int:
    return 0 if not math.isfinite(x) or x == 0 else (1 if x > 0 else -1)


def agrees(whole: ClaimResult, part: ClaimResult) -> bool:
    """The part reaches the whole's verdict with the whole's sign."""
    return part.verdict == whole.verdict and _sign(part.estimate) == _sign(whole.estimate)


def part(name: str, c: ClaimResult) -> dict:
    return {
        "name": name,
        "seeds": list(c.seeds),
        "estimate": c.estimate,
        "ci": list(c.ci),
        "p": c.p,
        "p_holm": c.p_holm,  # the verdict is read at it, over the part's own family
        "n": c.n,
        "verdict": c.verdict,
        "checksums": list(c.checksums),
        "machines": list(c.machines),
    }


def _result(status: str, by: str, parts: list[dict], reason: str | None = None) -> dict:
    return {"status": status, "by": by, "parts": parts, "reason": reason}


def replicate_by_halves(
    claims: Sequence[ClaimResult], compared: Sequence[RunRecord], family: ClaimFamily | None = None
) -> None:
    """Set each claim's .replication from its two seed halves (the claims of one seed set share them);
    `family`: the preregistered family the claims are of (config/claims.py), tested again on each half."""
    by = HALVES
    cache: dict[tuple[int, ...], tuple[dict, dict]] = {}
    cliff_rates = cliffs(compared)  # the whole's cliff: each half tests the same claims
    for c in claims:
        h1, h2 = halves(c.seeds)
        need = min_per_half(c)
        if len(h1) < need:
            c.replication = _result(
                NOT_TESTED,
                by,
                [],
                f"too few seeds to split: {len(c.seeds)}, each half needs {need} ({2 * need} in all)",
            )
            continue
        key = tuple(c.seeds)
        if key not in cache:
            cache[key] = tuple(
                {x.key: x for x in evaluate_claims(None, [r for r in compared if r.seed in h], cliff_rates, family)}
                for h in (h1, h2)
            )
        found = [cache[key][i].get(c.key) for i in (0, 1)]
        if any(f is None for f in found):
            missing = seed_ranges(h1 if found[0] is None else h2)
            c.replication = _result(NOT_TESTED, by, [], f"the claim has no value on seeds {missing} alone")
            continue
        parts = [part(seeds_name(h), f) for h, f in zip((h1, h2), found)]
        c.replication = _result(CONSISTENT if all(agrees(c, f) for f in found) else INCONSISTENT, by, parts)


def replicate_against(claims: Sequence[ClaimResult], other: Sequence[ClaimResult], name: str) -> None:
    """Set each claim's .replication from the same claim (model, claim, comparison) in sweep `name`.
    Where each side has one base model and they differ (sweep `name` ran on a second build of it, the
    replication the base model's seed cannot give), the claim and comparison match across them."""
    by = f"against sweep '{name}'"
    index = {c.key: c for c in other}
    models, other_models = {c.model for c in claims}, {c.model for c in other}
    if len(models) == len(other_models) == 1 and models != other_models:
        (model,) = models
        index = {(model, *c.key[1:]): c for c in other}
    for c in claims:
        o = index.get(c.key)
        if o is None:
            c.replication = _result(NOT_TESTED, by, [], f"sweep '{name}' has no such comparison")
            continue
        c.replication = _result(
            REPLICATES if agrees(c, o) else FRAGILE, by, [part(f"{name}: {seeds_name(o.seeds)}", o)]
        )


def summary_line(claims: Sequence[dict]) -> str | None:
    """'Claims (4): 2 replicate, 1 fragile, 1 not tested (...); of the 2 that hold or do not hold, 1
    replicate, 1 fragile' for the report's header (the verdicts apart: an inconclusive claim that stays
    inconclusive counts as replicating, and says little)."""
    if not claims:
        return None
    counts: dict[str, int] = {}
    for c in claims:
        status = (c.get("replication") or {}).get("status", NOT_TESTED)
        counts[status] = counts.get(status, 0) + 1
    by = next(((c.get("replication") or {}).get("by") for c in claims if c.get("replication")), "")
    said = {
        REPLICATES: "replicate",
        FRAGILE: "fragile",
        CONSISTENT: "consistent",
        INCONSISTENT: "inconsistent",
        NOT_TESTED: "not tested",
    }
    order = (REPLICATES, FRAGILE, CONSISTENT, INCONSISTENT, NOT_TESTED)
    text = ", ".join(f"{counts[k]} {said[k]}" for k in order if counts.get(k))
    decided = [c for c in claims if c.get("verdict") in ("holds", "does not hold")]
    if decided and len(decided) < len(claims):  # an inconclusive claim staying inconclusive counts too: say apart
        dcounts: dict[str, int] = {}
        for c in decided:
            status = (c.get("replication") or {}).get("status", NOT_TESTED)
            dcounts[status] = dcounts.get(status, 0) + 1
        text += f"; of the {len(decided)} that hold or do not hold, " + ", ".join(
            f"{dcounts[k]} {said[k]}" for k in order if dcounts.get(k)
        )
    reasons = sorted(
        {
            c["replication"]["reason"]
            for c in claims
            if c.get("replication") and c["replication"]["status"] == NOT_TESTED and c["replication"]["reason"]
        }
    )
    how = f"checked for {by}" if by == HALVES else f"checked {by}"
    return f"Claims ({len(claims)}) {how}: {text}" + (f" ({'; '.join(reasons)})" if reasons else "") + "."
