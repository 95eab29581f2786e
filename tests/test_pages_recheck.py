"""scripts/pages_recheck.py: the Holm and non-inferiority re-read of a published study report, and the
committed reports it rewrote carrying exactly the verdicts it computes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def recheck():
    spec = importlib.util.spec_from_file_location("pages_recheck", ROOT / "scripts" / "pages_recheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_moe_page_under_holm(recheck):
    family, claims = recheck.recheck(ROOT / "docs" / "studies" / "moe" / "report.md")
    assert family == len(claims) == 14
    by = {c["comparison"]: c for c in claims}
    gspo = by["gspo(routing_replay=r2, agg=seq-mean-token-mean) - grpo(routing_replay=r2, agg=token-mean)"]
    # the page's one nominal "holds" before Holm: p 0.037, the 6th smallest p of the 14 tests, so Holm
    # multiplies it by 14 - 6 + 1 = 9: 0.333, inconclusive (the page now prints that verdict)
    assert gspo["after"] == "inconclusive at this scale" == gspo["before"]
    assert gspo["p_holm"] == pytest.approx(0.333, abs=0.01)
    # "trains stably" as non-inferiority against 2 points: -2.94 [-5.01, -0.857] over 10 seeds,
    # se = 2.078 / t(0.975, 9) = 0.9185, t = (-2.94 + 2) / 0.9185 = -1.02: p 0.33, not shown to lose
    nsr = by["nsr(routing_replay=r2, agg=seq-mean-token-mean) - base model (step 0)"]
    assert nsr["kind"] == "non-inferiority" and nsr["p_test"] == pytest.approx(0.333, abs=0.005)
    assert sum(c["after"] == "does not hold" for c in claims) == 5 and not any(c["after"] == "holds" for c in claims)


@pytest.mark.parametrize(
    "study", ["clip_rules", "corrections", "moe", "rescue", "stability", "stability_ladder", "stability_replay"]
)
def test_a_rewritten_report_prints_the_verdicts_and_holm_p_the_recheck_computes(recheck, study):
    text = (ROOT / "docs" / "studies" / study / "report.md").read_text()
    _, claims = recheck.recheck(ROOT / "docs" / "studies" / study / "report.md")
    assert [c["before"] for c in claims] == [c["after"] for c in claims]
    printed = [row["p Holm"] for row in recheck.claims_rows(text)]
    for c, cell in zip(claims, printed):  # "<0.001", "0.174", or "≤0.012" (from a printed <0.001: a bound)
        if cell:
            value = 0.001 if cell == "<0.001" else float(cell.lstrip("≤"))
            assert c["p_holm"] == pytest.approx(value, abs=0.0006) or (cell == "<0.001" and c["p_holm"] < 0.001)
    assert "Generated before" not in text and "bootstrap vs the baseline" not in text
