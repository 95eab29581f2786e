"""scripts/pages_recheck.py: issue 37's Holm and non-inferiority re-read of a published study report."""

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
    # the page's one nominal "holds": p 0.037, the 6th smallest p of the 14 tests, so Holm multiplies it
    # by 14 - 6 + 1 = 9: 0.333
    assert gspo["before"] == "holds" and gspo["after"] == "inconclusive at this scale"
    assert gspo["p_holm"] == pytest.approx(0.333, abs=0.01)
    # "trains stably" as non-inferiority against 2 points: -2.94 [-5.01, -0.857] over 10 seeds,
    # se = 2.078 / t(0.975, 9) = 0.9185, t = (-2.94 + 2) / 0.9185 = -1.02: p 0.33, not shown to lose
    nsr = by["nsr(routing_replay=r2, agg=seq-mean-token-mean) - base model (step 0)"]
    assert nsr["kind"] == "non-inferiority" and nsr["p_test"] == pytest.approx(0.333, abs=0.005)
    assert sum(c["after"] == "does not hold" for c in claims) == 5 and not any(c["after"] == "holds" for c in claims)
