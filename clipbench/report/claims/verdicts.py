"""What a claim's test says: the result of one claim (`ClaimResult`), its verdict at level `ALPHA`,
and Holm over the family of a report's claims.

- Kinds: a difference claim is tested against 0, two-sided: "holds" when the difference has the
  claimed sign and p_holm < 0.05, "does not hold" when it has the opposite sign and p_holm < 0.05, else
  "inconclusive at this scale" (not detected with these seeds: never "no difference"). A "does not
  lose" claim is non-inferiority against its declared margin: the same test against -margin
  (`stats.noninferiority`). A "no difference" claim is equivalence within +-margin by two one-sided
  tests (`stats.tost`).
- The family: the claims of one report (`evaluate_claims`) are one family; `correct_family` adjusts
  their p-values by Holm (`stats.holm`: statsmodels) and every verdict is read at the adjusted p
  (p_holm; the raw p is kept beside it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from clipbench.report import stats

ALPHA = stats.ALPHA
DIFFERENCE, NONINFERIORITY, EQUIVALENCE = "difference", "non-inferiority", "equivalence"
INCONCLUSIVE = "inconclusive at this scale"


@dataclass
class ClaimResult:
    claim: str  # the claim as the paper states it
    source: str  # the paper
    comparison: str  # the arms, e.g. "abc - grpo"
    figure: str  # what is measured
    estimate: float  # the mean difference (or the share), in the figure's unit
    ci: tuple[float, float]
    p: float
    test: str  # the paired test
    n: int  # seeds or problems behind the estimate
    verdict: str
    model: str = ""  # the block (base model name)
    seeds: list[int] = field(default_factory=list)  # the seeds behind it (both arms have them)
    se: float = math.nan  # the test's standard error, in the figure's unit
    df: float = math.nan
    mde: float = math.nan  # smallest effect detectable at 80% power
    needed: dict | None = None  # inconclusive: {"unit": seeds|problems, "n", "factor"}
    checksums: list = field(default_factory=list)  # base-model weights sha256 of its runs (None: unrecorded)
    replication: dict | None = None  # replication.py: consistent/inconsistent (halves) or replicates/fragile
    kind: str = DIFFERENCE  # difference (two-sided, claimed sign) | non-inferiority | equivalence
    margin: float | None = None  # non-inferiority / equivalence: the declared margin, figure's unit
    p_holm: float = math.nan  # Holm-adjusted over the report's claim family (correct_family)
    family: int = 0  # the claims in that family
    p_outside: float = math.nan  # equivalence: two-sided p against the nearer margin (does not hold)
    machines: list = field(default_factory=list)  # the machines its runs ran on (report/machines.py)
    # what its test reads per seed: [label, [per_seed.csv columns (averaged)], sign] terms summed
    # (report/per_seed.py); None: not a seed-level test (one seed: tested over problems)
    reads: list | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        """What names a claim across sweeps and halves (the figure's text carries numbers)."""
        return (self.model, self.claim, self.comparison)


def verdict(estimate: float, p: float, *, claimed_sign: int = 1, margin: float | None = None) -> str:
    """At level ALPHA on `p` (after the family's correction, `correct_family`): "holds" when the
    estimate lies on the claimed side of 0 (non-inferiority: of -margin) and p < ALPHA, "does not
    hold" on the other side, else "inconclusive at this scale"."""
    if not (math.isfinite(estimate) and math.isfinite(p)):
        return INCONCLUSIVE
    shifted = estimate + (margin or 0.0) * claimed_sign
    if p < ALPHA and shifted * claimed_sign > 0:
        return "holds"
    if p < ALPHA and shifted * claimed_sign < 0:
        return "does not hold"
    return INCONCLUSIVE


def decide(c: ClaimResult, p: float, family: int = 1) -> str:
    """The verdict of a claim at its (corrected) p. Equivalence: "holds" when the TOST p < ALPHA; "does
    not hold" when the estimate lies outside +-margin and its two-sided p against the nearer margin,
    Bonferroni over the family (conservative), is < ALPHA; else inconclusive."""
    if c.kind == EQUIVALENCE:
        if math.isfinite(p) and p < ALPHA:
            return "holds"
        if math.isfinite(c.p_outside) and abs(c.estimate) > c.margin and c.p_outside * family < ALPHA:
            return "does not hold"
        return INCONCLUSIVE
    return verdict(c.estimate, p, margin=c.margin if c.kind == NONINFERIORITY else None)


def correct_family(claims: Sequence[ClaimResult]) -> None:
    """Holm over the claims of one report (its family), in place: each claim's p_holm, family and its
    verdict at the adjusted p ("holds" only after the correction)."""
    adjusted = stats.holm([c.p for c in claims])
    family = sum(math.isfinite(c.p) for c in claims)
    for c, p in zip(claims, adjusted):
        c.p_holm, c.family = p, family
        c.verdict = decide(c, p, family)
