"""The claims a report tests on a sweep: each claim is a figure, its interval, a paired test and a
verdict ("holds", "does not hold", "inconclusive at this scale"), one Holm-corrected family per report.

    claims = evaluate_claims(sweep, compared)     # the sweep's preregistered family, else the papers' claims

The package, one module per seam:

    verdicts.py     ClaimResult, the verdict at level ALPHA of each kind (difference, non-inferiority,
                    equivalence), Holm over the family (correct_family)
    comparisons.py  how two arms are compared: the paired tests over seeds (or problems, with one
                    seed) and what two arms must share (the setting)
    endpoints.py    the per-run numbers compared, each registered once: value, unit, figure, wording,
                    per_seed.csv column
    papers.py       the papers' claims, one row each (ABC-GRPO, DAPO, NSR, GSPO's routing replay, the
                    stability claims at the learning-rate cliff)
    family.py       a preregistered family (`claims:` in the sweep file, config/claims.py) tested

A sweep whose file declares a preregistered family (frozen in its manifest) is tested on exactly that
family; any other on the papers' claims that apply to its arms. Whether a verdict is consistent over
the halves of the seeds, or replicates on a second sweep, is replication.py's. The machines a claim's
runs ran on are kept (`machines`): one claim over several machines is said next to its verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from clipbench.config.claims import ClaimFamily
from clipbench.report.claims.comparisons import blocks
from clipbench.report.claims.family import family_claims
from clipbench.report.claims.papers import BASE_CLAIM, STABLE_MARGIN, cliffs, paper_claims
from clipbench.report.claims.verdicts import ClaimResult, correct_family, verdict
from clipbench.report.load import RunRecord, Sweep

__all__ = ["BASE_CLAIM", "STABLE_MARGIN", "ClaimResult", "as_dicts", "cliffs", "evaluate_claims", "verdict"]


def evaluate_claims(
    sweep: Sweep | None,
    compared: Sequence[RunRecord],
    cliff_rates: dict[str, set[float]] | None = None,
    family: ClaimFamily | None = None,
) -> list[ClaimResult]:
    """Every claim that applies to the compared runs of a sweep, block by block (base model): the
    preregistered `family` when there is one (default: the sweep's own), else the papers' claims.
    `cliff_rates`: the cliff per block (default: `cliffs(compared)`)."""
    family = family if family is not None else (sweep.claims if sweep is not None else None)
    if family is None and cliff_rates is None:
        cliff_rates = cliffs(compared)
    out: list[ClaimResult] = []
    for model, runs in blocks(compared).items():
        if family is not None:
            found = family_claims(family, runs)
        else:
            found = paper_claims(runs, cliff_rates.get(model, set()))
        for res in found:
            res.model = model
        out += found
    correct_family(out)
    return out


def as_dicts(results: Sequence[ClaimResult]) -> list[dict]:
    return [asdict(r) for r in results]
