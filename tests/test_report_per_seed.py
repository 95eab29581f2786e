"""per_seed.csv (clipbench/report/per_seed.py): `clipbench report --out DIR` writes each compared run's
claim endpoints beside the page, and the claims table is tested again from that file alone."""

from __future__ import annotations

import json
import math

import pytest

from clipbench.commands.report import report_command
from clipbench.errors import UserError
from clipbench.report.per_seed import claims_from_per_seed, read_per_seed


@pytest.fixture(scope="module")
def written(tmp_path_factory, report_fixture):
    root = report_fixture.build(tmp_path_factory.mktemp("per_seed") / "results")
    out = tmp_path_factory.mktemp("page")
    report_command("fixture", baseline="grpo", fmt="markdown", results_dir=root, out=out)
    return out


def test_the_page_has_each_runs_endpoints_beside_it(written):
    rows = read_per_seed(written / "per_seed.csv")
    assert [(r["label"], r["seed"]) for r in rows] == [(m, s) for m in ("abc", "grpo", "nsr") for s in (0, 1)]
    grpo0 = next(r for r in rows if r["label"] == "grpo" and r["seed"] == 0)
    assert grpo0["sweep"] == "fixture" and grpo0["run_id"] == "grpo-s000000"
    # arith, 4 problems x 4 samples: step 0 has (2, 1, 0, 0) right, 3 of 16 = 18.75; the final step
    # (4, 2, 1, 0), 7 of 16 = 43.75, and 3 of the 4 problems solved at least once: Pass@4 75
    assert grpo0["avg_start:arith"] == 18.75 and grpo0["avg_end:arith"] == 43.75 and grpo0["pass_end:arith"] == 75.0
    # gsm8k, 3 problems: (2, 0, 0) right of 4 at the end, 2 of 12; one problem solved
    assert grpo0["avg_end:gsm8k"] == pytest.approx(100 * 2 / 12) and grpo0["pass_end:gsm8k"] == pytest.approx(100 / 3)
    # clip events (2, 1, 3, 4) on every row: Q4 40% against Q3's 30%, a lead of +10 points
    assert grpo0["q4_lead"] == pytest.approx(10.0)
    report = json.loads((written / "report.json").read_text())
    assert report["per_seed"][0]["label"] == "abc"  # the same rows in report.json


def test_the_claims_table_is_rederived_from_the_file_alone(written):
    report = json.loads((written / "report.json").read_text())
    claims = report["claims"]
    assert len(claims) == 4 and all(c["reads"] for c in claims)
    again = claims_from_per_seed(read_per_seed(written / "per_seed.csv"), claims)
    for c, r in zip(claims, again):
        assert (r.claim, r.comparison, r.n, r.seeds) == (c["claim"], c["comparison"], c["n"], c["seeds"])
        assert r.estimate == pytest.approx(c["estimate"], rel=1e-9, abs=1e-12)
        assert list(r.ci) == pytest.approx(c["ci"], rel=1e-9, abs=1e-12) or math.isnan(c["ci"][0])
        assert r.p == pytest.approx(c["p"], rel=1e-9) and r.p_holm == pytest.approx(c["p_holm"], rel=1e-9)
        assert (r.verdict, r.family) == (c["verdict"], c["family"])
    one_seed = {**claims[0], "reads": None}  # a claim tested over problems has no per-seed values
    with pytest.raises(UserError, match="tested over problems"):
        claims_from_per_seed(read_per_seed(written / "per_seed.csv"), [one_seed])
