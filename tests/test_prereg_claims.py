"""A preregistered claim family (issue 36): declared in the sweep file (`claims:`, config/claims.py),
checked when the sweep is read (one line naming the key, exit 2, nothing written), frozen with the
manifest, and tested by the report as exactly that family: a difference claim per comparison and
endpoint, an equivalence claim per equivalence endpoint, Holm over all of them. Golden numbers with
their arithmetic on a hand-checkable store (tests/fixtures/make_stability_fixture.py); no training."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as sps
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.config.claims import ENDPOINTS, parse_family
from clipbench.errors import ConfigError, UserError
from clipbench.report import stats
from clipbench.report.build import build_report
from clipbench.report.claims.endpoints import family_endpoints
from clipbench.report.per_seed import claims_from_per_seed
from clipbench.sweep import load_spec
from clipbench.sweep.expand import expand
from clipbench.sweep.manifest import merge

FAMILY = {
    "benchmark": "arith",
    "endpoints": ["avg", "pass"],
    "equivalence": ["avg"],
    "margins": {"avg": 3.0},
    "compare": [["cispo", "grpo"]],
}


def test_a_family_reads_and_counts_its_hypotheses():
    fam = parse_family(
        {**FAMILY, "compare": [["dapo", "grpo"], {"a": "nsr", "b": "dapo", "endpoints": ["avg"], "source": "NSR"}]},
        "s.yaml",
    )
    assert [(c.a, c.b, c.endpoints, c.source) for c in fam.comparisons] == [
        ("dapo", "grpo", ("avg", "pass"), ""),
        ("nsr", "dapo", ("avg",), "NSR"),
    ]
    # dapo - grpo: avg and pass, plus avg's equivalence (3); nsr - dapo: avg and its equivalence (2)
    assert fam.size() == 5 and fam.rules() == ["dapo", "grpo", "nsr"]
    assert parse_family(fam.to_dict(), "manifest.json") == fam  # the stored form reads back
    assert family_endpoints() == ENDPOINTS  # the names a sweep file may write are the registered ones


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"benchmrk": "arith"},
            "claims.benchmrk: unknown key (did you mean 'benchmark'?); valid keys: benchmark, endpoints, equivalence, "
            "margins, compare",
        ),
        (
            {"endpoints": ["avgg"]},
            "claims.endpoints: unknown endpoint 'avgg' (did you mean 'avg'?); endpoints: avg, pass, entropy",
        ),
        ({"margins": {}}, "claims.margins.avg: missing: equivalence on 'avg' needs its margin, declared"),
        ({"margins": {"avg": -1}}, "claims.margins.avg: expected a number > 0, got -1"),
        ({"compare": [["grpo", "grpo"]]}, "claims.compare[0]: compares 'grpo' with itself"),
        ({"compare": [["a", "b"], ["b", "a"]]}, "claims.compare[1]: b - a is compared twice"),
        ({"compare": [{"a": "x"}]}, "claims.compare[0].b: missing: the comparison is a - b of two rules"),
        ({"compare": []}, "claims.compare: expected a non-empty list of comparisons, got []"),
    ],
)
def test_a_bad_family_is_one_line_naming_the_key(change, message):
    with pytest.raises(ConfigError) as e:
        parse_family({**FAMILY, **change}, "s.yaml")
    assert str(e.value) == f"s.yaml: {message}"


def _sweep(tmp_path: Path, claims: dict, grid: dict) -> Path:
    path = tmp_path / "prereg.yaml"
    doc = {"name": "prereg", "base": "quickstart", "overrides": {"train.steps": 2}, "grid": grid, "claims": claims}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("grid", "claims", "message"),
    [
        (
            {"objective.name": ["grpo", "cispo"], "seed": [0, 1]},
            {**FAMILY, "compare": [["cispoo", "grpo"]]},
            "claims.compare[0].a: no run of this sweep has objective.name 'cispoo' (did you mean 'cispo'?); "
            "its rules: grpo, cispo",
        ),
        (
            {"objective.name": ["grpo", "cispo"], "train.lr": [1e-4, 2e-4]},
            FAMILY,
            "claims.compare[0].a: rule 'cispo' has 2 settings in this sweep (train.lr=0.0001; train.lr=0.0002): "
            "a compared arm is one setting, its seeds",
        ),
    ],
)
def test_the_sweep_refuses_a_family_its_runs_cannot_test(tmp_path, grid, claims, message):
    path = _sweep(tmp_path, claims, grid)
    res = CliRunner().invoke(app, ["sweep", str(path), "--results-dir", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"error: {path}: {message}"
    assert not (tmp_path / "r").exists()


def test_the_manifest_freezes_the_family(tmp_path):
    # one setting per rule: each rule at its own learning rate (a zip of rule and rate)
    path = tmp_path / "prereg.yaml"
    doc = {
        "name": "prereg",
        "base": "quickstart",
        "grid": {"seed": [0, 1]},
        "zip": {"objective.name": ["grpo", "cispo"], "train.lr": [2e-4, 1e-4]},
        "claims": FAMILY,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    spec = load_spec(path)
    exp = expand(spec)
    first = merge(None, spec, exp)
    assert first.manifest["claims"] == parse_family(FAMILY, "x").to_dict()
    doc["claims"] = {**FAMILY, "margins": {"avg": 5.0}}  # edited after the runs were planned
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    spec2 = load_spec(path)
    again = merge(first.manifest, spec2, expand(spec2))
    assert again.manifest["claims"] == first.manifest["claims"]  # the frozen family is kept
    assert any("the frozen claims are kept" in w for w in again.warnings)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The stability ladder with one setting per rule left: grpo at 1e-4, cispo at 2e-4 (seeds 0-2), the
    family FAMILY frozen in its manifest."""
    path = Path(__file__).parent / "fixtures" / "make_stability_fixture.py"
    spec = importlib.util.spec_from_file_location("make_stability_fixture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = mod.build(tmp_path_factory.mktemp("prereg") / "results")
    sweep_dir = root / mod.SWEEP
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    keep = {mod.run_id("grpo", 1e-4, s) for s in mod.SEEDS} | {mod.run_id("cispo", 2e-4, s) for s in mod.SEEDS}
    for rid in list(manifest["runs"]):
        if rid not in keep:
            shutil.rmtree(sweep_dir / rid)
            del manifest["runs"][rid]
    manifest["claims"] = parse_family(FAMILY, "x").to_dict()
    (sweep_dir / "manifest.json").write_text(json.dumps(manifest))
    return root, mod


def test_the_report_tests_exactly_the_preregistered_family(store):
    root, mod = store
    _, result, tables, header = build_report(root, mod.SWEEP, None)
    claims = {(c["claim"], c["figure"]): c for c in result["claims"]}
    assert result["prereg"]["declared"] == result["prereg"]["tested"] == 3 and len(claims) == 3
    assert all(c["family"] == 3 for c in result["claims"])  # Holm over the family, nothing else
    assert any(
        "preregistered family frozen in the sweep's manifest (3 hypotheses declared, 3 tested" in h for h in header
    )
    # Avg@4: grpo at 1e-4 has (6, 5, 6) of 16 right, cispo at 2e-4 (0, 0, 0): 37.5, 31.25, 37.5 vs 0.
    # cispo - grpo per seed: -37.5, -31.25, -37.5; mean -35.4167, sd 3.6084, t = -35.4167 / (3.6084 / sqrt 3)
    avg = claims[("cispo beats grpo on held-out accuracy", "Avg@4, last eval (pts, arith)")]
    diffs = np.array([-37.5, -31.25, -37.5])
    assert avg["estimate"] == pytest.approx(diffs.mean()) and avg["n"] == 3 and avg["seeds"] == [0, 1, 2]
    assert avg["p"] == pytest.approx(sps.ttest_1samp(diffs, 0.0).pvalue)
    # Holm over three: Pass@4's p (0, below) is the smallest, so this one is the second: x 2 (= 0.0069)
    assert avg["p_holm"] == pytest.approx(2 * avg["p"]) and avg["verdict"] == "does not hold"
    # Pass@4: grpo's problems (3, 2, 1, 0) / (2, 2, 1, 0) right of 4 samples: 3 of 4 pass, 75%; cispo 0:
    # -75 on every seed, no spread: p 0 (the report's rule for a constant nonzero difference)
    passed = claims[("cispo keeps a higher Pass@n than grpo", "Pass@4, last eval (pts, arith)")]
    assert passed["estimate"] == pytest.approx(-75.0) and passed["p"] == 0.0 and passed["verdict"] == "does not hold"
    # equivalence within +-3 points: TOST on the same differences, far outside the margin
    same = claims[("cispo and grpo do not differ in Avg@n (within +-3 pts)", "Avg@4, last eval (pts, arith)")]
    assert same["kind"] == "equivalence" and same["margin"] == 3.0
    assert same["p"] == pytest.approx(stats.tost(diffs, 3.0)["p"])
    assert same["verdict"] in ("does not hold", "inconclusive at this scale") and same["verdict"] != "holds"
    assert any(t.key == "claims" for t in tables)
    assert result["blocks"][0]["aggregate_tasks"] == ["arith"]  # the aggregates read the family's split alone


def test_a_family_over_a_rule_at_several_settings_is_refused(store, tmp_path):
    _, mod = store
    ladder = mod.build(tmp_path / "full")  # every rate: cispo at 1e-4, 2e-4 and 4e-4
    manifest = json.loads((ladder / mod.SWEEP / "manifest.json").read_text())
    manifest["claims"] = parse_family(FAMILY, "x").to_dict()
    (ladder / mod.SWEEP / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"compare rule 'cispo', which has runs at several settings here"):
        build_report(ladder, mod.SWEEP, None)


def test_a_preregistered_report_tests_only_its_family(store):
    root, mod = store
    _, result, tables, _ = build_report(root, mod.SWEEP, "grpo(lr=0.0001)")
    sig = next(t for t in tables if t.key == "significance")
    # no Holm over the table's methods: that would be a second family beside the preregistered one
    assert "p Holm" not in sig.columns and "p (seeds)" in sig.columns
    assert any("the report tests the preregistered family of 3 claims" in n for n in sig.notes)


def test_a_preregistered_family_is_rederived_from_per_seed_values(store):
    root, mod = store
    _, result, _, _ = build_report(root, mod.SWEEP, None)
    # cispo - grpo reads each run's Avg@4 and Pass@4 on arith: the family's columns, not an average
    assert {tuple(c["reads"][0][1]) for c in result["claims"]} == {("avg_end:arith",), ("pass_end:arith",)}
    again = claims_from_per_seed(result["per_seed"], result["claims"])
    assert [(r.claim, r.verdict) for r in again] == [(c["claim"], c["verdict"]) for c in result["claims"]]
    assert [r.p_holm for r in again] == pytest.approx([c["p_holm"] for c in result["claims"]], rel=1e-9)
