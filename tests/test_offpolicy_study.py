"""scripts/offpolicy_study.py: the off-policy study's gate, family and replication from per-seed values
with known truth, and per_seed.csv read back as written."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def study():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))  # it imports organism_gate beside it
    try:
        spec = importlib.util.spec_from_file_location("offpolicy_study", ROOT / "scripts" / "offpolicy_study.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "scripts"))


# small per-seed noise, the same for every arm at a seed plus a known per-arm offset
NOISE = [0.3, -0.2, 0.1, -0.4, 0.25, 0.0, -0.1, 0.35, -0.3, 0.05]
SPREAD = [0.2, -0.1, 0.15, -0.2, 0.05, -0.05, 0.1, -0.15, 0.0, 0.1]


def row(arm, lag, seed, avg_end, *, build="shipped", collapsed=0, entropy_last=0.1):
    return {
        "arm": arm,
        "lag": lag,
        "seed": seed,
        "build": build,
        "run_id": f"{arm}-{lag}-{seed}",
        "test_avg_start": 28.0,
        "test_avg_end": avg_end,
        "test_pass_start": 95.0,
        "test_pass_end": 94.0,
        "val_avg_end": avg_end - 1,
        "entropy_first": 0.2,
        "entropy_last": entropy_last,
        "collapsed": collapsed,
        "clip": 1.0,
        "oob": 2.0,
        "kl": 0.01,
        "ess": 0.9,
        "ess_seq": 0.5,
    }


def world(top=32, unclipped_top=-12.0, dapo_offset=0.0):
    rows = []
    for i, seed in enumerate(range(100, 110)):
        for lag in (0, top):
            base = 50.0 + NOISE[i]
            rows.append(row("grpo", lag, seed, base, entropy_last=0.09 + SPREAD[i] / 100))
            rows.append(row("dapo", lag, seed, base + dapo_offset + SPREAD[i], entropy_last=0.1 + SPREAD[i] / 100))
            rows.append(row("unclipped", lag, seed, base + (unclipped_top if lag else 0.0) + SPREAD[i]))
            rows.append(row("grpo_aa", lag, seed + 10, 50.0 + NOISE[::-1][i]))
    return rows


def test_g6_holds_when_the_surrogate_ties_at_zero_and_loses_at_the_top(study):
    g = study.g6(world(), 32)
    # lag 0: differences = SPREAD, mean 0.01, sd 0.13: the 90% interval lies well inside +-3
    assert g["equivalent_at_0"]["pass"] and g["equivalent_at_0"]["p_tost"] < 1e-9
    assert g["loss_at_top"]["estimate"] == pytest.approx(-12.0 + 0.01)
    assert g["loss_at_top"]["pass"] and g["pass"]
    # a loss of 3 points is not the axis: G6 fails, and no collapse rescues it
    assert not study.g6(world(unclipped_top=-3.0), 32)["pass"]


def test_g6_counts_collapses_at_the_top(study):
    rows = world(unclipped_top=-1.0)
    for r in rows:
        if r["arm"] == "unclipped" and r["lag"] == 32 and r["seed"] < 105:
            r["collapsed"] = 1
    g = study.g6(rows, 32)
    assert g["collapsed_at_top"] == {"n": 5, "of": 10, "pass": True} and g["pass"]


def test_the_family_finds_the_effect_it_was_given_and_nothing_else(study):
    fam = study.family(world(dapo_offset=4.0), [0, 32], ["dapo", "unclipped"])
    by = {(c["arm"], c["lag"], c["kind"]): c for c in fam["primary"]}
    assert len(fam["primary"]) == 8  # 2 arms x 2 lags x (difference, equivalence)
    assert by[("dapo", 0, "difference")]["verdict"] == "higher"  # +4.01, sd 0.13 over 10 seeds
    assert by[("dapo", 0, "equivalence")]["verdict"] == "inconclusive"  # +4 lies outside +-3
    assert by[("unclipped", 0, "equivalence")]["verdict"] == "equivalent"
    assert by[("unclipped", 32, "difference")]["verdict"] == "lower"
    # Holm over the primary family: every adjusted p at least the raw one
    assert all(c["p_holm"] >= c["p_test"] for c in fam["primary"])
    ent = [c for c in fam["secondary"] if c["endpoint"] == "entropy, last fifth"]
    # dapo's entropy is 0.01 nats above grpo's on every seed: the exact signed-rank p of 10 positive
    # differences is 2 / 2^10 = 0.00195
    assert next(c for c in ent if c["arm"] == "dapo" and c["lag"] == 0)["p_test"] == pytest.approx(2 / 1024)


def test_replication_reads_verdicts_and_signs(study):
    primary = study.family(world(dapo_offset=4.0), [32], ["dapo", "unclipped"])["primary"]
    again = study.family(world(dapo_offset=-4.0), [32], ["dapo", "unclipped"])["primary"]
    rep = study.replication(primary, again)
    status = {(c["arm"], c["kind"]): c["status"] for c in rep["claims"]}
    assert status[("dapo", "difference")] == "contradicted"  # higher, then lower
    assert status[("unclipped", "difference")] == "replicates"  # lower both times
    assert rep["verdicts"] == 2 and rep["verdicts_replicated"] == 1 and rep["contradicted"] == 1


def test_per_seed_csv_reads_back_what_was_written(study, tmp_path):
    rows = world()
    rows[0]["val_avg_end"] = math.nan
    study.write_per_seed(rows, tmp_path / "per_seed.csv")
    back = study.read_per_seed(tmp_path / "per_seed.csv")
    key = lambda r: (r["build"], r["arm"], r["lag"], r["seed"])  # noqa: E731
    assert len(back) == len(rows)
    for a, b in zip(sorted(rows, key=key), sorted(back, key=key)):
        assert a.keys() == b.keys()
        assert all(a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def test_the_follow_up_places_each_rule_between_grpo_and_the_unclipped_surrogate(study):
    rows = world(unclipped_top=+6.0)  # at lag 32 (the top here) the surrogate ends 6 points above grpo
    for i, seed in enumerate(range(100, 110)):
        base = 50.0 + NOISE[i]
        rows.append(row("cispo", 32, seed, base + 6.0 - SPREAD[i]))  # where the surrogate ends
        rows.append(row("m2po", 32, seed, base + SPREAD[i]))  # where grpo ends
    for i, seed in enumerate(range(100, 105)):
        rows.append(row("grpo", 32, seed, 40.0 + NOISE[i], build="build2"))
        rows.append(row("unclipped", 32, seed, 46.0 + NOISE[i] + SPREAD[i], build="build2"))
    claims = study.followup(rows, lag=32)
    by = {(c["a"], c["b"], c["build"], c["kind"]): c["verdict"] for c in claims}
    assert len(claims) == 7  # 2 of the 5 arms ran: 3 claims each, and the second build's
    assert by[("cispo", "grpo", "shipped", "difference")] == "higher"
    assert by[("cispo", "unclipped", "shipped", "equivalence")] == "equivalent"
    assert by[("m2po", "unclipped", "shipped", "difference")] == "lower"
    assert by[("m2po", "grpo", "shipped", "difference")] == "inconclusive"  # mean 0.01
    assert by[("unclipped", "grpo", "build2", "difference")] == "higher"


def test_g5_tests_the_four_preregistered_endpoints(study):
    """offpolicy_prereg.md's G5: Welch t on 4 endpoints, Holm over the 4 (validation Avg@64 is not one)."""
    g5 = study.gate(world(), 0)["G5"]
    assert list(g5["family"]) == ["test Avg@64 gain", "test Avg@64 end", "test Pass@64 end", "entropy, last fifth"]
    # grpo (50 + NOISE) against grpo_aa (50 + NOISE reversed): the same values in another order, a mean
    # difference of 0 and Welch p = 1; but world() gives grpo_aa an entropy of 0.1 on every seed against
    # grpo's 0.09 + SPREAD/100 (mean 0.0901): a difference the A/A draw must flag, and G5 fails on it
    fam = g5["family"]
    assert fam["test Avg@64 end"]["diff"] == pytest.approx(0.0, abs=1e-12) and fam["test Avg@64 end"]["p"] == 1.0
    assert fam["entropy, last fifth"]["diff"] == pytest.approx(-0.0099) and fam["entropy, last fifth"]["p_holm"] < 0.05
    assert not g5["pass"]


OFFPOLICY = ROOT / "docs" / "studies" / "offpolicy"


@pytest.mark.skipif(not (OFFPOLICY / "per_seed.csv").is_file(), reason="the study's results are not published")
def test_the_published_gate_is_rederived_from_its_per_seed_csv(study):
    """docs/studies/offpolicy/gate.md is what the script writes from per_seed.csv and counts.json alone,
    and its headline numbers are those the results page cites."""
    import json

    rows = study.read_per_seed(OFFPOLICY / "per_seed.csv")
    counts = json.loads((OFFPOLICY / "counts.json").read_text())
    assert study.gate_page(rows, counts) == (OFFPOLICY / "gate.md").read_text()
    d = study.paired(rows, "unclipped", "grpo", 128, "test_avg_end")
    assert len(d) == 10 and round(sum(d) / len(d), 1) == 5.1  # the clip's cost at lag 128, 10 seeds
    g = study.select(rows, "grpo", 0)
    assert round(sum(r["test_avg_end"] for r in g.values()) / len(g), 1) == 52.5
    summary = json.loads((OFFPOLICY / "replay" / "replay.json").read_text())
    assert study.replay_page(summary) == (OFFPOLICY / "replay" / "replay.md").read_text()


def test_a_partial_follow_up_is_adjusted_over_the_whole_preregistered_family(study):
    """With only the second build's claim run, its p is multiplied by 16 (Holm's first step over the
    preregistered family), not by 1."""
    rows = []
    for i, seed in enumerate(range(100, 105)):
        rows.append(row("grpo", 32, seed, 40.0 + NOISE[i], build="build2"))
        rows.append(row("unclipped", 32, seed, 41.0 + NOISE[i] + SPREAD[i], build="build2"))
    (c,) = study.followup(rows, lag=32)
    assert study.FOLLOWUP_FAMILY == 16 and c["p_holm"] == pytest.approx(min(1.0, 16 * c["p_test"]))
