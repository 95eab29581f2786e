"""The report's multiplicity and non-inferiority procedures applied to a published study page, from its
printed numbers (the stores behind docs/studies/* are not kept in the repository):

    python scripts/pages_recheck.py docs/studies/stability/report.md [...]

For each report's claims table: the family's size, Holm over the printed raw p-values (statsmodels;
a printed "<0.001" is taken as 0.001, so the adjusted p's are upper bounds), and the "does not lose"
claims as non-inferiority against the declared 2-point margin (clipbench.report.claims.STABLE_MARGIN):
the paired t against -2, its standard error recovered from the printed 95% interval (se = half-width /
t(0.975, n - 1)). Prints, per report, the verdicts before and after. The printed numbers carry 3
significant digits: a p near a threshold can move by rounding, which the output flags ("~").
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scipy import stats as sps  # noqa: E402

from clipbench.report import stats  # noqa: E402
from clipbench.report.claims import BASE_CLAIM, STABLE_MARGIN  # noqa: E402

NI_MARK = BASE_CLAIM.split("{name}")[1].split(" at the lr")[0]  # " trains stably: does not lose ..."
NUM = r"([+-]?[0-9.]+(?:e[+-]?\d+)?)"


def claims_rows(text: str) -> list[dict]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("### The papers' claims"))
    head, rows = None, []
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if head is None:
            head = cells
        elif not set(line) <= set("|:- "):
            rows.append(dict(zip(head, cells)))
    return rows


def parse(row: dict) -> dict:
    m = re.match(NUM + r"(?: \[" + NUM + ", " + NUM + r"\])?", row["Estimate [95% CI]"])
    est, lo, hi = (float(x) if x else math.nan for x in m.groups())
    p_text = row["p"]
    p = 0.001 if p_text == "<0.001" else (float(p_text) if p_text else math.nan)
    return {
        "claim": row["Claim (source)"],
        "comparison": row["Comparison"],
        "estimate": est,
        "ci": (lo, hi),
        "n": int(row["n"]),
        "p": p,
        "bound": p_text == "<0.001",
        "test": row["Test"],
        "before": row["Verdict"].split(";")[0].strip(),
    }


def ni_p(c: dict, margin: float) -> float:
    """Two-sided p of the paired t of the difference against -margin, from the printed interval."""
    lo, hi = c["ci"]
    if not (math.isfinite(lo) and math.isfinite(hi)) or not c["test"].startswith("paired t"):
        return math.nan
    df = c["n"] - 1
    se = (hi - lo) / 2 / sps.t.ppf(0.975, df)
    if se == 0:
        return 0.0
    return float(2 * sps.t.sf(abs((c["estimate"] + margin) / se), df))


def recheck(path: Path) -> tuple[int, list[dict]]:
    claims = [parse(r) for r in claims_rows(path.read_text())]
    for c in claims:
        c["kind"] = "non-inferiority" if NI_MARK in c["claim"] else "difference"
        if c["kind"] == "non-inferiority":
            c["p_test"] = ni_p(c, STABLE_MARGIN)
        else:
            c["p_test"] = c["p"]
    adjusted = stats.holm([c["p_test"] for c in claims])
    for c, p in zip(claims, adjusted):
        c["p_holm"] = p
        shift = STABLE_MARGIN if c["kind"] == "non-inferiority" else 0.0
        if not math.isfinite(p) or p >= 0.05:
            c["after"] = "inconclusive at this scale"
        else:
            c["after"] = "holds" if c["estimate"] + shift > 0 else "does not hold"
        c["near"] = math.isfinite(p) and 0.03 < p < 0.08
    return len([c for c in claims if math.isfinite(c["p_test"])]), claims


def main(argv: list[str]) -> int:
    for name in argv:
        family, claims = recheck(Path(name))
        before = {v: sum(c["before"] == v for c in claims) for v in ("holds", "does not hold")}
        after = {v: sum(c["after"] == v for c in claims) for v in ("holds", "does not hold")}
        print(f"## {name}: {len(claims)} claims, family {family} (Holm)")
        print(f"- before: {before['holds']} hold, {before['does not hold']} do not hold")
        print(f"- after:  {after['holds']} hold, {after['does not hold']} do not hold")
        for c in claims:
            if c["before"] != c["after"]:
                flag = " ~" if c["near"] else ""
                print(
                    f"  - {c['comparison']}: {c['before']} -> {c['after']} ({c['kind']}; est {c['estimate']:+.3g}, "
                    f"p {c['p_test']:.3g}, Holm {c['p_holm']:.3g}){flag}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
