"""The report on a hand-checkable fixture results store (tests/fixtures/make_report_fixture.py).

Fixture: grpo / abc / nsr x seeds 0, 1; n = 4 samples; a problem with c correct has the per-problem
values Avg@4 = c/4, Pass@2 = (0, 1/2, 5/6, 1, 1)[c], Pass@4 = (c >= 1). Correct counts (final step):

    arith (4 problems)   grpo s0 [4,2,1,0]  s1 [4,1,1,0]   abc s0 [4,3,2,0]  s1 [4,3,1,1]
    gsm8k (3 problems)   grpo s0 [2,0,0]    s1 [2,1,0]     abc s0 [3,1,0]    s1 [2,1,1]
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from clipbench.commands.report import report_command
from clipbench.errors import UserError
from clipbench.objectives import METHODS
from clipbench.report import stats
from clipbench.report.analysis import analyze, run_quadrants
from clipbench.report.build import build_report
from clipbench.report.load import RunRecord, assign_labels, load_results
from clipbench.report.paper import load_paper
from clipbench.report.render import to_markdown
from clipbench.report.tables import build_tables
from clipbench.tracking.store import list_sweeps


@pytest.fixture(scope="module")
def results(tmp_path_factory, report_fixture) -> Path:
    return report_fixture.build(tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def result(results) -> dict:
    return analyze(load_results(results, "fixture"), "grpo")


@pytest.fixture(scope="module")
def tables(result):
    return {t.key: t for t in build_tables(result, load_paper())}


# ---- Table 3 layout: golden text ---------------------------------------------------------------

# Hand check of the arith rows (percent):
#   grpo Avg@4: seeds 7/16 = 43.75 and 6/16 = 37.5 -> mean 40.625 -> "40.6"; std = 6.25/sqrt(2) = 4.42
#   grpo Pass@2: s0 (1 + 5/6 + 1/2 + 0)/4 = 58.33, s1 (1 + 1/2 + 1/2 + 0)/4 = 50 -> 54.17 +- 5.89
#   abc Avg@4: 9/16 and 9/16 -> 56.25 -> "56.2" (round half to even) +- 0
#   abc Pass@2: s0 (1 + 1 + 5/6 + 0)/4 = 70.83, s1 (1 + 1 + 1/2 + 1/2)/4 = 75 -> 72.92 +- 2.95
#   abc Pass@4: s0 3/4, s1 4/4 -> 87.5 +- 25/sqrt(2) = 17.68
# Gain abc vs grpo (the paper's (m - b) / b * 100):
#   Avg@4 (56.25 - 40.625) / 40.625 = +38.46%;  Pass@2 (72.917 - 54.167) / 54.167 = +34.62%;
#   Pass@4 (87.5 - 75) / 75 = +16.67%
# Average block = unweighted mean over the two benchmarks: grpo Avg@4 (40.625 + 20.833)/2 = 30.73,
#   abc (56.25 + 33.33)/2 = 44.79, Gain 14.06 / 30.73 = +45.76%. grpo's std over seeds of the per-seed
#   averages: s0 (43.75 + 16.67)/2 = 30.21, s1 (37.5 + 25)/2 = 31.25 -> 1.04/sqrt(2) = 0.74.
# base (step 0): arith counts [2,1,0,0] -> Avg 3/16 = 18.75 -> "18.8"; Pass@4 2/4 = 50.
GOLDEN_TABLE3 = """\
### Table 3 layout: builtin:arith-tiny (Avg@4 / Pass@k, %)

| Benchmark | Method | Seeds | Avg@4 | Pass@2 | Pass@4 |
|:---|:---|---:|---:|---:|---:|
| GSM8K (P=3) | base (step 0) | 2 | 8.3 ± 0.0 | 16.7 ± 0.0 | 33.3 ± 0.0 |
|  | grpo | 2 | 20.8 ± 5.9 | 36.1 ± 11.8 | 50.0 ± 23.6 |
|  | abc | 2 | 33.3 ± 0.0 | 55.6 ± 7.9 | 83.3 ± 23.6 |
|  | nsr | 2 | 12.5 ± 5.9 | 22.2 ± 7.9 | 33.3 ± 0.0 |
|  | **Gain: abc vs grpo** |  | +60.0% | +53.8% | +66.7% |
|  | **Gain: nsr vs grpo** |  | -40.0% | -38.5% | -33.3% |
| arith (P=4) | base (step 0) | 2 | 18.8 ± 0.0 | 33.3 ± 0.0 | 50.0 ± 0.0 |
|  | grpo | 2 | 40.6 ± 4.4 | 54.2 ± 5.9 | 75.0 ± 0.0 |
|  | abc | 2 | 56.2 ± 0.0 | 72.9 ± 2.9 | 87.5 ± 17.7 |
|  | nsr | 2 | 40.6 ± 4.4 | 56.2 ± 14.7 | 62.5 ± 17.7 |
|  | **Gain: abc vs grpo** |  | +38.5% | +34.6% | +16.7% |
|  | **Gain: nsr vs grpo** |  | +0.0% | +3.8% | -16.7% |
| Average (2 benchmarks, P=7) | base (step 0) | 2 | 13.5 ± 0.0 | 25.0 ± 0.0 | 41.7 ± 0.0 |
|  | grpo | 2 | 30.7 ± 0.7 | 45.1 ± 2.9 | 62.5 ± 11.8 |
|  | abc | 2 | 44.8 ± 0.0 | 64.2 ± 5.4 | 85.4 ± 20.6 |
|  | nsr | 2 | 26.6 ± 5.2 | 39.2 ± 11.3 | 47.9 ± 8.8 |
|  | **Gain: abc vs grpo** |  | +45.8% | +42.3% | +36.7% |
|  | **Gain: nsr vs grpo** |  | -13.6% | -13.1% | -23.3% |
"""


def test_table3_markdown_golden(tables):
    text = to_markdown(tables["table3"])
    assert text.startswith(GOLDEN_TABLE3)
    assert "n = 4 samples per problem" in text and "Baseline: grpo" in text


def test_gain_row_arithmetic(result):
    block = result["blocks"][0]
    gain = block["gain"]["abc"]
    assert gain["arith"]["avg"] == pytest.approx((0.5625 - 0.40625) / 0.40625 * 100)  # 38.4615...
    assert gain["arith"]["pass@2"] == pytest.approx((35 / 48 - 13 / 24) / (13 / 24) * 100)  # 34.615...
    assert gain["arith"]["pass@4"] == pytest.approx((0.875 - 0.75) / 0.75 * 100)
    grpo_avg = (0.40625 + 5 / 24) / 2
    abc_avg = (0.5625 + 1 / 3) / 2
    assert gain["average"]["avg"] == pytest.approx((abc_avg - grpo_avg) / grpo_avg * 100)  # 45.76...
    assert stats.gain_percent(1.0, 0.0) is None  # blank when the baseline is 0


def test_seed_mean_and_std(result):
    cell = result["blocks"][0]["benchmarks"]["arith"]["rows"]["grpo"]["metrics"]["avg"]
    assert cell["per_seed"] == pytest.approx([7 / 16, 6 / 16])
    assert cell["mean"] == pytest.approx(0.40625)
    assert cell["std"] == pytest.approx(0.0625 / math.sqrt(2))  # ddof=1 over 2 seeds


# ---- confidence intervals ------------------------------------------------------------------------


def test_t_interval_arithmetic(result):
    # grpo arith Avg@4, per problem averaged over seeds: [(4+4)/8, (2+1)/8, (1+1)/8, 0] = [1, .375, .25, 0]
    # mean .40625; squared deviations .3525390625 + .0009765625 + .0244140625 + .1650390625 = .54296875;
    # s = sqrt(.54296875 / 3) = .4254287; se = s / 2 = .2127144; t_{.975, 3} = 3.1824463;
    # half-width = .6769520 -> [-.2707020, 1.0832020]
    lo, hi = result["blocks"][0]["benchmarks"]["arith"]["rows"]["grpo"]["metrics"]["avg"]["ci"]
    half = 3.182446305284263 * math.sqrt(0.54296875 / 3) / 2
    assert (lo, hi) == pytest.approx((0.40625 - half, 0.40625 + half), abs=1e-9)
    assert half == pytest.approx(0.6769520, abs=1e-6)


def test_ci_display_is_clipped_to_unit_interval(tables):
    rows = {(r[0] or None, r[1]): r for r in tables["significance"].rows}
    assert any(r[3] == "40.6 [0.0, 100.0]" for r in tables["significance"].rows)  # grpo arith, clipped both sides
    assert rows[("GSM8K", "grpo")][3] == "20.8 [0.0, 85.5]"


@pytest.mark.parametrize("sizes,sds", [((12,), (1.0,)), ((5, 9), (1.0, 3.0))])
def test_t_intervals_cover_95_percent(sizes, sds):
    """Monte Carlo: 3000 normal data sets; coverage of the true mean 0.95 +- 0.015 (3.8 sigma)."""
    rng = np.random.default_rng(123)
    hits = 0
    reps = 3000
    for _ in range(reps):
        groups = [rng.normal(0.0, sd, size=p) for p, sd in zip(sizes, sds)]
        lo, hi = stats.t_interval(groups[0]) if len(groups) == 1 else stats.combined_t_interval(groups)
        hits += lo <= 0.0 <= hi
    assert abs(hits / reps - 0.95) < 0.015


# ---- paired bootstrap ----------------------------------------------------------------------------


def _exact_bootstrap_p(d: np.ndarray) -> float:
    """P(|mean(d*) - mean(d)| >= |mean(d)|) over all P^P equally likely resamples (brute force)."""
    obs = d.mean()
    hits = [
        abs(d[list(idx)].mean() - obs) >= abs(obs) - 1e-12 for idx in itertools.product(range(d.size), repeat=d.size)
    ]
    return float(np.mean(hits))


def test_bootstrap_p_golden_and_exact(result):
    cell = result["blocks"][0]["benchmarks"]["arith"]["rows"]["abc"]["metrics"]["avg"]
    # per-problem differences abc - grpo (seed-averaged): [1-1, .75-.375, .375-.25, .125-0] = [0, .375, .125, .125]
    d = np.array([0.0, 0.375, 0.125, 0.125])
    assert cell["delta"] == pytest.approx(d.mean())
    # p_problems (within-seed sampling noise only; report.json): golden, default_rng(0), 2000 resamples -> 69 extreme + 1
    assert cell["p_problems"] == pytest.approx(70 / 2001)
    exact = _exact_bootstrap_p(d)  # 4^4 = 256 resamples
    assert abs(cell["p_problems"] - exact) < 4 * math.sqrt(exact * (1 - exact) / 2000) + 1 / 2001


def test_significance_is_a_paired_t_over_seeds_with_holm(result, tables):
    # issue 37: the seed is the unit. abc - grpo on arith, each seed's Avg@4: s0 9/16 - 7/16 = 0.125,
    # s1 9/16 - 6/16 = 0.1875: mean 0.15625, sd 0.0625 / sqrt(2) = 0.0441942, se 0.03125, t = 5.0 (df 1):
    # p = 2 * (1 - T_1(5)) = 0.125666; 95% CI 0.15625 -+ 12.7062 * 0.03125 = [-0.2408, +0.5533]
    rows = result["blocks"][0]["benchmarks"]["arith"]["rows"]
    abc, nsr = rows["abc"]["metrics"]["avg"], rows["nsr"]["metrics"]["avg"]
    assert abc["p"] == pytest.approx(0.1256659, abs=1e-6) and abc["paired_seeds"] == 2
    assert abc["delta_ci"] == pytest.approx([0.15625 - 0.3970697, 0.15625 + 0.3970697], abs=1e-6)
    # nsr - grpo: s0 7/16 - 7/16 = 0, s1 6/16 - 6/16 = 0 -> p 1.0; Holm over {abc, nsr}: abc 2 x 0.1257, nsr 1.0
    assert nsr["p"] == 1.0 and nsr["family"] == 2
    assert abc["p_holm"] == pytest.approx(2 * 0.1256659, abs=1e-6) and nsr["p_holm"] == 1.0
    row = [r for r in tables["significance"].rows if r[1] == "abc"][1]  # GSM8K, arith, Average
    assert row[4:7] == ["+15.6 [-24.1, +55.3]", "0.126", "0.251"]
    assert "within-seed sampling noise only" in tables["significance"].notes[0]


def test_bootstrap_monte_carlo_matches_enumeration():
    d = np.array([0.1, -0.05, 0.3, 0.0, 0.2])  # 5^5 = 3125 resamples
    exact = _exact_bootstrap_p(d)
    p = stats.paired_bootstrap_p([d], resamples=20000, seed=7)
    assert abs(p - exact) < 4 * math.sqrt(exact * (1 - exact) / 20000) + 1e-4


def test_bootstrap_edge_cases():
    assert stats.paired_bootstrap_p([np.zeros(6)]) == 1.0  # no difference at all
    # every problem improved by the same amount: no resample reaches 0 -> the smallest p, 1/(B+1)
    assert stats.paired_bootstrap_p([np.full(5, 0.2)], resamples=999) == pytest.approx(1 / 1000)
    # fixed seed: the same p twice; the sign of the difference does not matter (two-sided)
    d = np.array([0.3, -0.1, 0.2, 0.0, 0.25, -0.05])
    assert stats.paired_bootstrap_p([d]) == stats.paired_bootstrap_p([d]) == stats.paired_bootstrap_p([-d])


def test_paired_by_problem_id(results, tmp_path, report_fixture):
    """Shuffling a run's problem order in its payload changes nothing (pairs are by id, not position)."""
    import shutil

    root = tmp_path / "r"
    shutil.copytree(results / "fixture", root / "fixture")
    p = root / "fixture" / report_fixture.run_id("abc", 0) / "eval" / "step_000002" / "arith.json"
    payload = json.loads(p.read_text())
    order = [2, 0, 3, 1]
    payload["problem_ids"] = [payload["problem_ids"][i] for i in order]
    payload["correct"] = [payload["correct"][i] for i in order]
    p.write_text(json.dumps(payload))
    a = analyze(load_results(results, "fixture"), "grpo")["blocks"][0]["benchmarks"]["arith"]["rows"]["abc"]
    b = analyze(load_results(root, "fixture"), "grpo")["blocks"][0]["benchmarks"]["arith"]["rows"]["abc"]
    for m in a["metrics"]:
        assert a["metrics"][m]["mean"] == pytest.approx(b["metrics"][m]["mean"])
        assert a["metrics"][m]["p"] == pytest.approx(b["metrics"][m]["p"])


# ---- clip quadrants ------------------------------------------------------------------------------


def test_quadrant_shares(result, tables):
    q = result["quadrants"]["builtin:arith-tiny"]
    for lb, entry in q.items():
        assert sum(entry["share"][k]["mean"] for k in ("q1", "q2", "q3", "q4")) == pytest.approx(100.0), lb
    # grpo: (2, 1, 3, 4) events per row -> 20 / 10 / 30 / 40 %
    assert [q["grpo"]["share"][k]["mean"] for k in ("q1", "q2", "q3", "q4")] == pytest.approx([20, 10, 30, 40])
    # nsr: seed 0 (2, 2, 2, 4) -> Q4 40 %, seed 1 (1, 1, 1, 1) -> 25 %: mean 32.5, std 15/sqrt(2) = 10.61
    assert q["nsr"]["share"]["q4"]["mean"] == pytest.approx(32.5)
    assert q["nsr"]["share"]["q4"]["std"] == pytest.approx(15 / math.sqrt(2))
    # tokens per row: 4 x 10 quadrant + 20 zero-advantage = 60; grpo zero-grad = q1 2 + q3 3 + 20 = 25
    assert q["grpo"]["zero_grad"]["mean"] == pytest.approx(100 * 25 / 60)
    assert q["nsr"]["rescued"]["mean"] == pytest.approx(100 * 1 / 60)
    assert q["grpo"]["events"] == 2 * 4 * 10  # 2 seeds x 4 rows x 10 events
    text = to_markdown(tables["quadrants"])
    assert (
        "| grpo | 2 | 80 | 20.0 ± 0.0 | 10.0 ± 0.0 | 30.0 ± 0.0 | 40.0 ± 0.0 | 16.7 ± 0.0 | 41.7 ± 0.0 | 0.0 ± 0.0 |"
        in text
    )
    assert "| paper: GRPO, Qwen3-4B-Base (Fig. 4f) |  |  | 16.8 | 7.3 | 22.9 | 41.4 |" in text


def test_training_dynamics(result, tables):
    """Fixture: entropy = 1 - 0.1 * opt_step (+0.2 abc) + 0.01 * seed over opt steps 1..4 (a fifth of 4
    rows is 1 row); accuracy 0.3, 0.4 over rollout steps 0, 1; the off-policy rows are each step's
    second (of 2), with 40 tokens of A != 0 (4 quadrants x 10) and the method's clip events."""
    dyn = result["dynamics"]["builtin:arith-tiny"]
    grpo = dyn["grpo"]
    assert grpo["seeds"] == 2
    assert grpo["entropy"]["first"]["mean"] == pytest.approx(0.905)  # (0.9 + 0.91) / 2
    assert grpo["entropy"]["last"]["mean"] == pytest.approx(0.605)
    assert grpo["entropy"]["first"]["std"] == pytest.approx(0.01 / 2**0.5)  # sample std of 0.90, 0.91
    assert grpo["accuracy"]["first"]["mean"] == pytest.approx(0.3) and grpo["accuracy"]["last"][
        "mean"
    ] == pytest.approx(0.4)
    assert grpo["off_policy_out_of_band"]["mean"] == pytest.approx(25.0)  # (2+1+3+4) / 40 per row
    assert dyn["abc"]["off_policy_out_of_band"]["mean"] == pytest.approx(10.0)  # 4 / 40
    nsr = dyn["nsr"]["off_policy_out_of_band"]  # seeds: 10/40, 4/40
    assert nsr["mean"] == pytest.approx(17.5) and nsr["std"] == pytest.approx(7.5 * 2**0.5)
    assert math.isnan(grpo["completion_tokens"]["mean"])  # not logged by the fixture
    t = tables["dynamics"]
    assert t.rows[0] == [
        "grpo",
        "2",
        "0.905 ± 0.007 → 0.605 ± 0.007",
        "30.0 ± 0.0 → 40.0 ± 0.0",
        "25.0 ± 0.0",
        "",
        "0/2",
    ]


def test_no_routing_section_without_moe_runs(result):
    from clipbench.report.routing_table import routing_table

    assert result["routing"] == {} and routing_table(result["routing"], "grpo") is None


def test_run_quadrants_without_metrics():
    assert run_quadrants([]) is None
    no_events = run_quadrants([{"step": 0, "q1/tokens": 5, "q1/zero_grad": 1}])
    assert math.isnan(no_events["share"]["q1"]) and no_events["events"] == 0  # shares undefined, not 0
    assert no_events["zero_grad"] == pytest.approx(20.0)


def test_gradient_mass_shares_per_quadrant_and_rescued():
    # two optimizer steps; |g| sums per quadrant: q1 1+3 = 4, q2 1, q3 2, q4 2+1 = 3 -> total 10
    rows = [
        {
            "q1/tokens": 4,
            "q1/grad_mass": 1.0,
            "q2/grad_mass": 1.0,
            "q3/grad_mass": 2.0,
            "q4/grad_mass": 2.0,
            "q4/rescued_grad_mass": 0.5,
            "zero_adv/grad_mass": 0.0,
        },
        {"q1/tokens": 4, "q1/grad_mass": 3.0, "q4/grad_mass": 1.0, "q1/rescued_grad_mass": 1.5},
    ]
    q = run_quadrants(rows)
    assert q["grad_share"] == pytest.approx({"q1": 40.0, "q2": 10.0, "q3": 20.0, "q4": 30.0})
    assert q["rescued_grad"] == pytest.approx(20.0)  # (0.5 + 1.5) / 10
    assert math.isnan(run_quadrants([{"q1/tokens": 3}])["rescued_grad"])  # logged before grad mass: unknown
    from clipbench.report.tables import gradient_mass

    t = gradient_mass(
        {
            "m": {
                "nsr": {
                    "seeds": 1,
                    **{k: {kk: {"mean": v, "std": 0.0} for kk, v in q["grad_share"].items()} for k in ("grad_share",)},
                    "rescued_grad": {"mean": 20.0, "std": 0.0},
                }
            }
        },
        None,
    )
    assert t.rows[0] == ["nsr", "1", "40.0", "10.0", "20.0", "30.0", "20.0"]


# ---- labels, baseline, errors --------------------------------------------------------------------


def _run(rid: str, method: str, model: str = "m", seed: int = 0, **params) -> RunRecord:
    cfg = {"seed": seed, "model": {"name": model}, "train": {"steps": 10}, "objective": {"method": method, **params}}
    return RunRecord(run_id=rid, path=Path(rid), config=cfg, state="finished")


def test_labels_name_what_varies_within_a_block():
    runs = [
        _run("a", "dapo", eps_high=0.28),
        _run("b", "dapo", eps_high=0.28, seed=1),
        _run("c", "nsr", p=0.5, delta=0.1),
        _run("d", "nsr", p=1.0, delta=0.1),
        _run("e", "grpo", model="big"),
        _run("f", "abc", model="big"),
    ]
    for r in runs[4:]:
        r.config["train"]["steps"] = 99  # differs from block "m", but constant within block "big"
    assign_labels(runs)
    assert [r.label for r in runs] == ["dapo", "dapo", "nsr(p=0.5)", "nsr(p=1)", "grpo", "abc"]
    runs2 = [_run("a", "grpo"), _run("b", "grpo")]
    runs2[1].config["train"]["steps"] = 20
    assign_labels(runs2)
    assert [r.label for r in runs2] == ["grpo(steps=10)", "grpo(steps=20)"]


def test_a_plugin_rule_added_to_a_sweep_labels_by_its_name_alone():
    """A user's rule added to an existing sweep: its runs record `plugins` (an absolute path), the runs
    trained before do not; a path is no setting, so it labels nothing (nor launch, tracking, name)."""
    runs = [_run("a", "grpo"), _run("b", "grpo", seed=1), _run("c", "lower_only"), _run("d", "lower_only", seed=1)]
    for r in runs[2:]:
        r.config["plugins"] = ["/home/me/study/lower_only.py"]
        r.config["launch"] = {"nproc_per_node": 2}
        r.config["tracking"] = {"experiment": "mine"}
        r.config["name"] = "mine"
    assign_labels(runs)
    assert [r.label for r in runs] == ["grpo", "grpo", "lower_only", "lower_only"]


def _with_plugin_rule(report_fixture, root: Path, rule_file: Path) -> None:
    """The fixture store with nsr's runs turned into runs of a user's rule, as `clipbench sweep` writes
    them: the config records the rule and the plugin's absolute path."""
    report_fixture.build(root)
    for seed in (0, 1):
        path = root / "fixture" / report_fixture.run_id("nsr", seed) / "config.yaml"
        cfg = yaml.safe_load(path.read_text())
        cfg["objective"] = {"method": "lower_only", "eps_low": 0.1}
        cfg["plugins"] = [str(rule_file)]
        path.write_text(yaml.safe_dump(cfg))


def test_report_loads_the_plugins_its_runs_recorded(tmp_path, report_fixture):
    """Without --plugin, the report imports the rule file the runs recorded, so the log-ratio figure
    draws the rule's own band (lower_only: [1 - 0.1, ...] for A < 0)."""
    rule_file = tmp_path / "lower_only.py"
    rule_file.write_text((Path(__file__).parent.parent / "examples" / "plugins" / "lower_only.py").read_text())
    _with_plugin_rule(report_fixture, tmp_path / "r", rule_file)
    assert "lower_only" not in METHODS
    sweep = load_results(tmp_path / "r", "fixture")
    assert sweep.notes == [] and METHODS["lower_only"].origin.path == str(rule_file)
    (run,) = [r for r in sweep.runs if r.method == "lower_only" and r.seed == 0]
    assert run.label == "lower_only" and run.ref_bands()["neg"][0] == pytest.approx(0.9)


def test_report_says_in_one_line_when_a_recorded_plugin_cannot_be_loaded(tmp_path, report_fixture):
    _with_plugin_rule(report_fixture, tmp_path / "r", tmp_path / "moved.py")
    sweep = load_results(tmp_path / "r", "fixture")
    assert sweep.notes == [
        f"could not load the plugin the runs of lower_only recorded: {tmp_path / 'moved.py'}: plugin file not found",
        "rule lower_only unknown to this install: the log-ratio figure leaves out its clip band; pass its file "
        "with --plugin FILE",
    ]
    (run,) = [r for r in sweep.runs if r.method == "lower_only" and r.seed == 0]
    assert run.ref_bands() is None
    _, _, _, header = build_report(tmp_path / "r", "fixture", "grpo", replay=False)
    assert f"Note: {sweep.notes[0]}" in header and f"Note: {sweep.notes[1]}" in header


def test_tidy_csvs_hold_one_number_per_column(results, tmp_path):
    """Beside the formatted tables: results_tidy.csv (label x benchmark x metric) and claims_tidy.csv,
    read by pandas with no parsing. arith, Avg@4: abc 9/16 on both seeds = 56.25 (sd 0); grpo 7/16 and
    6/16, so abc - grpo per seed 12.5 and 18.75, mean 15.625 points."""
    import pandas as pd

    written = report_command("fixture", baseline="grpo", fmt="markdown", results_dir=results, out=tmp_path)
    assert {p.name for p in written} >= {"results_tidy.csv", "claims_tidy.csv", "per_seed.csv"}
    res = pd.read_csv(tmp_path / "results_tidy.csv")
    row = res[(res.benchmark == "arith") & (res.label == "abc") & (res.metric == "avg")].iloc[0]
    assert (row.mean_pct, row.std_pct, row.seeds, row.problems, row.k, row.n) == (56.25, 0.0, 2, 4, 1, 4)
    assert row.baseline == "grpo" and row.delta_pts == pytest.approx(15.625) and row.paired_seeds == 2
    assert res[res.label == "base model (step 0)"].baseline.isna().all()
    assert set(res.benchmark) == {"arith", "gsm8k", "average"}
    claims = pd.read_csv(tmp_path / "claims_tidy.csv")
    assert {"estimate", "ci_low", "ci_high", "p", "p_holm", "verdict"} <= set(claims.columns) and len(claims) == 4
    assert all(isinstance(v, float) for v in claims.estimate)


def test_unknown_sweep_lists_existing(results):
    assert list_sweeps(results) == ["fixture"]
    with pytest.raises(
        UserError, match=r"no runs for sweep 'fixtur'.*did you mean 'fixture'.*sweeps with runs: fixture"
    ):
        load_results(results, "fixtur")
    with pytest.raises(UserError, match=r"does not exist"):
        report_command("x", baseline=None, fmt="rich", results_dir=results / "nope", out=None)


def test_bad_baseline_and_format(results):
    with pytest.raises(UserError, match=r"unknown baseline 'grp'.*did you mean 'grpo'"):
        build_report(results, "fixture", "grp")
    with pytest.raises(UserError, match=r"unknown format 'htm'.*did you mean 'html'"):
        report_command("fixture", baseline="grpo", fmt="htm", results_dir=results, out=None)


def test_no_baseline_means_no_gain(results):
    res = analyze(load_results(results, "fixture"), None)  # grpo is picked by default
    assert res["baseline"] == "grpo"
    res = analyze(load_results(results, "fixture"), "abc")
    assert set(res["blocks"][0]["gain"]) == {"grpo", "nsr"}


# ---- files of every format -----------------------------------------------------------------------


@pytest.mark.slow
def test_report_command_writes_every_format(results, tmp_path, capsys):
    out = tmp_path / "rep"
    for fmt in ("markdown", "latex", "csv", "html", "rich"):
        report_command("fixture", baseline="grpo", fmt=fmt, results_dir=results, out=out)
    printed = capsys.readouterr().out
    assert str(out / "report.html") in printed
    assert "Table 3 layout" in printed  # the rich tables
    md = (out / "report.md").read_text()
    assert GOLDEN_TABLE3.splitlines()[2] in md and "![entropy](plots/entropy.png)" in md
    assert (out / "plots" / "entropy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tex = (out / "report.tex").read_text()
    assert r"\toprule" in tex and r"40.6 $\pm$ 4.4" in tex and r"+38.5\%" in tex
    rows = list(csv.reader(io.StringIO((out / "table3.csv").read_text())))
    assert rows[0] == ["Benchmark", "Method", "Seeds", "Avg@4", "Pass@2", "Pass@4", "kind"]
    assert ["arith (P=4)", "abc", "2", "56.2 ± 0.0", "72.9 ± 2.9", "87.5 ± 17.7", "method"] in rows
    assert {p.name for p in out.glob("*.csv")} == {
        "table3.csv",
        "significance.csv",
        "aggregates.csv",
        "quadrants.csv",
        "dynamics.csv",
        "claims.csv",
        "runs.csv",
        "paper_reference.csv",
        "per_seed.csv",  # one row per run and benchmark (report/per_seed.py)
        "results_tidy.csv",  # the long, tidy forms of table3.csv and claims.csv
        "claims_tidy.csv",
    }
    data = json.loads((out / "report.json").read_text())
    assert data["baseline"] == "grpo" and data["bootstrap"]["resamples"] == 2000
    assert (out / "report.html").stat().st_mode & 0o044  # readable by others


def test_default_out_dir_and_all_sweeps(results, capsys):
    report_command(None, baseline="grpo", fmt="csv", results_dir=results, out=None)
    assert (results / "reports" / "fixture" / "table3.csv").is_file()
    assert list_sweeps(results) == ["fixture"]  # the reports directory is not a sweep


# ---- the paper's numbers -------------------------------------------------------------------------


def test_paper_table3_transcription_is_consistent():
    """Every Gain cell equals (ABC - GRPO) / GRPO on the printed (rounded) entries, to 0.1 (the paper's
    arithmetic); blanks are exactly the ties; Average rows are the mean of the three benchmarks."""
    paper = load_paper()
    assert paper["ks"] == [2, 4, 8, 16, 32, 64] and len(paper["columns"]) == 7
    for model in paper["models"].values():
        rows = model["rows"]
        for bench, r in rows.items():
            for j in range(7):
                g, a, b = r["gain"][j], r["abc"][j], r["grpo"][j]
                if g is None:
                    assert a == b, (bench, j)
                else:
                    assert abs((a - b) / b * 100 - g) <= 0.1 + 1e-9, (bench, j, g)
        for m in ("base", "grpo", "abc"):
            for j in range(7):
                mean = sum(rows[b][m][j] for b in ("aime24", "aime25", "amc23")) / 3
                if (model["title"], m, j) == ("Qwen3-1.7B-Base", "abc", 6):
                    # the paper's one inconsistent cell: (36.7 + 36.7 + 92.5) / 3 = 55.3, printed 53.9
                    assert (round(mean, 1), rows["average"][m][j]) == (55.3, 53.9)
                    continue
                assert abs(mean - rows["average"][m][j]) <= 0.1, (m, j)
    assert paper["models"]["Qwen/Qwen3-4B-Base"]["rows"]["aime24"]["gain"][0] == 27.6  # quoted in Section 5.2
    assert paper["models"]["Qwen/Qwen3-4B-Base"]["rows"]["aime24"]["gain"][-1] == 54.0
    assert sum(paper["figure4f"]["share_of_clip_events_percent"].values()) == pytest.approx(88.4)


def test_paper_rows_inline_when_model_matches(tmp_path):
    """A sweep on Qwen3-4B-Base with the paper's benchmarks and n = 64 gets the paper's rows in its own
    block, Average included; with other benchmarks the Average gets none (not comparable)."""
    root = tmp_path / "r"
    rng = np.random.default_rng(0)
    sizes = {"aime24": 30, "aime25": 30, "amc23": 40}
    for method in ("grpo", "abc"):
        d = root / "paper_like" / f"{method}-run"
        (d / "eval" / "step_000010").mkdir(parents=True)
        cfg = {"seed": 42, "model": {"name": "Qwen/Qwen3-4B-Base"}, "objective": {"method": method}}
        (d / "config.yaml").write_text(json.dumps(cfg))
        (d / "status.json").write_text(json.dumps({"state": "finished"}))
        for bench, size in sizes.items():
            correct = (rng.random((size, 64)) < 0.2).astype(int).tolist()
            (d / "eval" / "step_000010" / f"{bench}.json").write_text(
                json.dumps(
                    {"benchmark": bench, "n": 64, "problem_ids": [str(i) for i in range(size)], "correct": correct}
                )
            )
    _, res, tabs, _ = build_report(root, "paper_like", "grpo")
    t3 = next(t for t in tabs if t.key == "table3")
    assert t3.columns[3:] == ["Avg@64", "Pass@2", "Pass@4", "Pass@8", "Pass@16", "Pass@32", "Pass@64"]
    ref = [r for r, s in zip(t3.rows, t3.styles) if s == "ref"]
    assert len(ref) == 4 * 3  # base / GRPO / ABC-GRPO for AIME24, AIME25, AMC23 and Average
    assert ref[1][0] == "" and ref[0][0] == "AIME24 (P=30)"
    assert ref[1][1:] == ["paper: Qwen3-4B-GRPO", "", "20.3", "23.3", "23.3", "33.3", "33.3", "36.7", "43.3"]
    gains = [r for r, s in zip(t3.rows, t3.styles) if s == "refgain"]
    assert gains[0][3:] == ["+27.6%", "+28.8%", "+28.8%", "+10.2%", "+50.2%", "+54.5%", "+54.0%"]
    assert gains[-1][3:] == ["+11.0%", "+25.7%", "+26.2%", "+15.7%", "+20.0%", "+17.2%", "+18.4%"]  # Average
    assert not any(t.key == "paper_reference" for t in tabs)  # inline, so no separate reference table
    # drop AMC23: the Average (of two benchmarks) is no longer the paper's, so it gets no paper rows
    for method in ("grpo", "abc"):
        (root / "paper_like" / f"{method}-run" / "eval" / "step_000010" / "amc23.json").unlink()
    _, _, tabs, _ = build_report(root, "paper_like", "grpo")
    t3 = next(t for t in tabs if t.key == "table3")
    assert sum(s == "refgain" for s in t3.styles) == 2


def test_bootstrap_with_a_one_problem_benchmark():
    # group 1: one problem (resamples to itself, 0.5); group 2: [0.1, 0.2] -> d = (0.5 + 0.15) / 2 = 0.325;
    # resampled d* in {0.3, 0.325, 0.35}: |d* - d| <= 0.025 < 0.325, so no resample is extreme: p = 1 / (B + 1)
    assert stats.paired_bootstrap_p([[0.5], [0.1, 0.2]]) == pytest.approx(1 / 2001)
    assert stats.paired_bootstrap_p([[0.0]]) == 1.0  # d == 0


def test_rliable_aggregates_golden(result, tables):
    # issue 37 (8): one score per run and task (final Avg@4). abc: arith 9/16, 9/16; gsm8k 4/12, 4/12.
    # IQM (25% cut each side of the 4 pooled scores): mean of 1/3 and 9/16 = 0.447917.
    agg = result["blocks"][0]["aggregates"]
    assert agg["abc"]["iqm"] == pytest.approx((1 / 3 + 9 / 16) / 2) and agg["abc"]["runs"] == 4
    # P(abc > grpo): arith abc 9/16 beats grpo's 7/16 and 6/16 on every pair (1.0); gsm8k abc 4/12 beats
    # 2/12 and 3/12 (1.0): 1.0. nsr: arith 7/16, 6/16 vs 7/16, 6/16: (0.5 + 1 + 0 + 0.5) / 4 = 0.5;
    # gsm8k 2/12, 1/12 vs 2/12, 3/12: (0.5 + 0 + 0 + 0) / 4 = 0.125; mean 0.3125
    assert agg["abc"]["poi"] == 1.0 and agg["nsr"]["poi"] == pytest.approx(0.3125)
    lo, hi = agg["nsr"]["poi_ci"]
    assert 0.0 <= lo <= 0.3125 <= hi <= 1.0
    # the batched statistics the bootstrap uses equal rliable's on the data themselves
    x = [np.array([0.1, 0.5, 0.3]), np.array([0.2, 0.2])]
    y = [np.array([0.3, 0.1, 0.3]), np.array([0.2, 0.4])]
    assert stats.poi_batched(*x, *y) == pytest.approx(
        np.mean([stats.probability_of_improvement(a, b) for a, b in zip(x, y)])
    )
    assert stats.iqm_batched(*x) == pytest.approx(stats.iqm(np.concatenate(x)))
    rows = {r[0]: r for r in tables["aggregates"].rows}
    assert rows["abc"][2:4] == ["44.8 [44.8, 44.8]", "1.00 [1.00, 1.00]"] and rows["nsr"][4] == "75%"
