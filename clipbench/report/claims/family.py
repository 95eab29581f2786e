"""A preregistered family (config/claims.py, frozen in the sweep's manifest) tested on one block's
runs: each comparison a - b of two rules, each at its one setting (its own tuned rate, say), on each
of its endpoints (endpoints.py: Avg@n or Pass@n at the last evaluation on the family's benchmark, or
the last fifth's entropy), a difference claim with the claimed sign + ("a beats b"), and for the
equivalence endpoints an equivalence claim within the declared margin; Holm over all of them
(`evaluate_claims`).
"""

from __future__ import annotations

from collections.abc import Sequence

from clipbench.config.claims import ClaimFamily
from clipbench.errors import UserError
from clipbench.report.claims.comparisons import paired_seeds, seed_test
from clipbench.report.claims.endpoints import ENDPOINTS, per_seed
from clipbench.report.claims.verdicts import EQUIVALENCE, ClaimResult
from clipbench.report.load import RunRecord

SAME = "{a} and {b} do not differ in {what} (within +-{m:g} {unit})"  # an equivalence endpoint's claim


def family_claims(family: ClaimFamily, runs: Sequence[RunRecord]) -> list[ClaimResult]:
    """The preregistered family on one block's runs (module docstring), uncorrected; a comparison whose
    rule has no run here is left out (the report lists the family's size as declared and as tested)."""
    by_rule: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_rule.setdefault(r.method, []).append(r)
    for rule, rs in by_rule.items():
        if rule in family.rules() and len({r.label for r in rs}) > 1:
            raise UserError(
                f"the preregistered claims compare rule {rule!r}, which has runs at several settings here "
                f"({', '.join(sorted({r.label for r in rs}))}): a compared arm is one setting"
            )
    out: list[ClaimResult] = []
    bench = family.benchmark
    for c in family.comparisons:
        a, b = by_rule.get(c.a), by_rule.get(c.b)
        if not a or not b:
            continue
        source = c.source or "preregistered"
        for name in c.endpoints:
            e = ENDPOINTS[name]
            value = lambda r, e=e: e.value(r, bench)  # noqa: E731
            va, vb = per_seed(a, value), per_seed(b, value)
            diffs = paired_seeds(va, vb)
            if diffs.size == 0:
                continue
            seeds = sorted(set(va) & set(vb))
            figure, label = e.figure([*a, *b], bench), f"{c.a} - {c.b}"
            reads = [[a[0].label, [e.column_of(bench)], 1], [b[0].label, [e.column_of(bench)], -1]]
            found = [seed_test(e.claim.format(a=c.a, b=c.b), source, label, figure, diffs, seeds, [*a, *b])]
            if name in family.equivalence:
                m = family.margins[name]
                what = e.measures.split(" at ")[0]
                claim = SAME.format(a=c.a, b=c.b, what=what, m=m, unit=e.unit)
                found.append(seed_test(claim, source, label, figure, diffs, seeds, [*a, *b], EQUIVALENCE, m))
            for res in found:
                res.reads = reads
            out += found
    return out
