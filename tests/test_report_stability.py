"""The stability report of a sweep with a learning-rate axis, on a hand-checkable ladder
(tests/fixtures/make_stability_fixture.py): gains over the base model with t intervals over seeds,
the kinds of collapse, each rule's critical learning rate, the cliff's claims and the first line.
Golden numbers with their arithmetic; no training (the real pipeline: test_stability_pipeline)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from clipbench.commands.report import report_command
from clipbench.errors import UserError
from clipbench.report.build import TUNING_NOTE, build_report
from clipbench.report.stability import best_rate, critical_rate, fitted_peak, fitted_root
from clipbench.report.stability_table import critical_text

T975_DF2 = 4.302652729911275  # scipy.stats.t.ppf(0.975, 2)
SD = 6.25 / math.sqrt(3)  # sample sd of (a, a, a +- 6.25): sqrt((2 x (6.25/3)^2 + (12.5/3)^2) / 2) = 3.6084


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    path = Path(__file__).parent / "fixtures" / "make_stability_fixture.py"
    spec = importlib.util.spec_from_file_location("make_stability_fixture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = mod.build(tmp_path_factory.mktemp("stability") / "results")
    return root, build_report(root, "ladder", None)


def test_gain_per_rule_and_rate_with_t_intervals_over_seeds(ladder):
    _, (_, result, _, _) = ladder
    stab = result["stability"]["builtin:arith-tiny"]
    assert stab["rates"] == [1e-4, 2e-4, 4e-4]
    assert list(stab["rules"]) == ["cispo", "grpo"]  # the label without the rate: one line per rule
    grpo = stab["rules"]["grpo"]["cells"]
    # grpo at 1e-4: (6, 5, 6) of 16 correct vs the base's 4: gains 12.5, 6.25, 12.5, mean 10.4167,
    # t interval 10.4167 -+ 4.3027 x 3.6084 / sqrt(3) = [1.4528, 19.3805]
    assert grpo[1e-4]["gains"] == [12.5, 6.25, 12.5] and grpo[1e-4]["seeds"] == [0, 1, 2]
    assert grpo[1e-4]["mean"] == pytest.approx(125 / 12)
    half = T975_DF2 * SD / math.sqrt(3)
    assert grpo[1e-4]["ci"] == pytest.approx([125 / 12 - half, 125 / 12 + half])
    assert grpo[4e-4]["mean"] == pytest.approx(-175 / 12)  # (-12.5 - 12.5 - 18.75) / 3
    cispo = stab["rules"]["cispo"]["cells"]
    assert cispo[2e-4]["gains"] == [-25.0] * 3 and cispo[2e-4]["ci"] == [-25.0, -25.0]  # no spread: a point


def test_collapse_kinds_are_named_and_counted(ladder):
    _, (_, result, tables, _) = ladder
    cells = result["stability"]["builtin:arith-tiny"]["rules"]
    # cispo from 2e-4: entropy 0.2 -> 0.6 (3x > 2x), length 20 -> 45 (2.25x > 1.5x), gradient norm 0.3 -> 0,
    # Avg@4 25% -> 0% (below half): every seed, four kinds
    assert cells["cispo"]["cells"][2e-4]["flagged"] == 3
    assert cells["cispo"]["cells"][2e-4]["kinds"] == {
        "entropy blow-up": 3,
        "length blow-up": 3,
        "no learning signal": 3,
        "accuracy collapse": 3,
    }
    # grpo at 4e-4: the largest ratio 15 on the last step (> 10) on every seed; seed 2 (1 of 16 = 6.25% < 12.5%)
    # also collapsed in accuracy; 2 of 16 (12.5%) is not below half of 25%
    assert cells["grpo"]["cells"][4e-4]["kinds"] == {"ratio explosion": 3, "accuracy collapse": 1}
    assert cells["grpo"]["cells"][1e-4]["flagged"] == 0
    t = next(t for t in tables if t.key == "stability")
    assert t.columns[:5] == ["Rule", "Figure", "lr 0.0001", "lr 0.0002", "lr 0.0004"]  # then the critical rates
    assert (
        t.rows[3]
        == ["", "collapsed: runs, kinds", "0/3", "0/3", "3/3: ratio explosion 3, accuracy collapse 1"] + [""] * 3
    )
    assert t.rows[2][2] == "+10.4 [+1.5, +19.4] (3)"
    # the dynamics table says the same per method label, for any sweep (one rate or many)
    dyn = {row[0]: row[-1] for row in next(t for t in tables if t.key == "dynamics").rows}
    assert (
        dyn["cispo(lr=0.0002)"] == "3/3: entropy blow-up 3, length blow-up 3, no learning signal 3, accuracy collapse 3"
    )
    assert dyn["grpo(lr=0.0001)"] == "0/3"


def test_critical_learning_rate_and_its_interval(ladder):
    _, (_, result, tables, _) = ladder
    rules = result["stability"]["builtin:arith-tiny"]["rules"]
    # grpo: mean gain >= 0 at 1e-4 (+10.4) and 2e-4 (0.0), < 0 at 4e-4: critical 2e-4; 1e-4's interval lies
    # above 0 (shown safe), 4e-4's below (hi = -14.58 + 8.96 < 0, shown to lose): [1e-4, 4e-4)
    assert rules["grpo"]["critical"] == {"rate": 2e-4, "lower": 1e-4, "upper": 4e-4, "rates": [1e-4, 2e-4, 4e-4]}
    # cispo: +2.08 at 1e-4 with an interval across 0 (no rate shown safe), -25 at 2e-4: [< 1e-4, 2e-4)
    assert rules["cispo"]["critical"] == {"rate": 1e-4, "lower": None, "upper": 2e-4, "rates": [1e-4, 2e-4, 4e-4]}
    t = next(t for t in tables if t.key == "stability")
    assert [r[-1] for r in t.rows] == ["0.0001 [< 0.0001, 0.0002)", "", "0.0002 [0.0001, 0.0004)", ""]


def test_critical_rate_edges():
    def cells(*pairs):  # (rate, mean, lo, hi)
        return {r: {"mean": m, "ci": [lo, hi]} for r, m, lo, hi in pairs}

    below = critical_rate(cells((1.0, -1.0, -2.0, -0.5), (2.0, -3.0, -4.0, -2.0)))
    assert below == {"rate": None, "lower": None, "upper": 1.0, "rates": [1.0, 2.0]}
    assert critical_text(below) == "< 1 (below the ladder)"
    never = critical_rate(cells((1.0, 2.0, 1.0, 3.0), (2.0, 1.0, -1.0, 3.0)))
    assert never == {"rate": 2.0, "lower": 1.0, "upper": None, "rates": [1.0, 2.0]}
    assert critical_text(never) == ">= 2 [1, > 2)"
    # a gain back above 0 after a loss does not extend the critical rate ("stays >= 0")
    back = critical_rate(cells((1.0, 1.0, -1.0, 3.0), (2.0, -1.0, -3.0, 1.0), (3.0, 1.0, -1.0, 3.0)))
    assert back["rate"] == 1.0 and back["upper"] is None


def test_cliff_claims_and_the_first_line(ladder):
    _, (_, result, _, header) = ladder
    claims = {(c["claim"], c["comparison"]): c for c in result["claims"]}
    # the cliff: the rates where grpo's mean gain is below 0 -> 4e-4 only (2e-4's mean is exactly 0)
    cispo = claims[
        ("CISPO trains stably: keeps more accuracy than GRPO at the lr cliff", "cispo(lr=0.0004) - grpo(lr=0.0004)")
    ]
    # per seed (0 - 2, 0 - 2, 0 - 1) / 16 x 100 = -12.5, -12.5, -6.25: mean -10.4167, t = -10.4167 / 2.0833 = -5.0,
    # df 2, two-sided p = 1 - 5 / sqrt(27) = 0.03775: against the paper
    assert cispo["estimate"] == pytest.approx(-125 / 12) and cispo["p"] == pytest.approx(1 - 5 / math.sqrt(27))
    # issue 37: read at Holm over the report's 5 claims (p 0, 0.0198, 0.0377, 0.0377, 1.0): the second
    # smallest of the two 0.0377's is 3 x 0.0377 = 0.113 (Holm keeps the running maximum): not held
    assert cispo["p_holm"] == pytest.approx(3 * (1 - 5 / math.sqrt(27))) and cispo["family"] == 5
    assert cispo["verdict"] == "inconclusive at this scale" and cispo["n"] == 3
    assert not any(c["comparison"].startswith("cispo(lr=0.0002)") for c in result["claims"])  # not the cliff
    for c in result["claims"]:  # arms are compared at the same rate only (before: every pair of rates)
        assert (
            len({part.split("(lr=")[1].split(")")[0] for part in c["comparison"].split(" - ") if "(lr=" in part}) == 1
        )
    learns = {c["comparison"]: c["verdict"] for c in result["claims"] if c["claim"].startswith("RL from")}
    # 1e-4: t = 10.4167 / 2.0833 = 5.0 (p 0.0377); 2e-4: mean 0; 4e-4: t = -14.583 / 2.0833 = -7.0 (p 0.0198);
    # Holm over the 5 claims: 0.0198 x 4 = 0.079, 0.0377 x 3 = 0.113: none survives the correction
    assert learns == {
        "grpo(lr=0.0001) - base model (step 0)": "inconclusive at this scale",
        "grpo(lr=0.0002) - base model (step 0)": "inconclusive at this scale",
        "grpo(lr=0.0004) - base model (step 0)": "inconclusive at this scale",
    }
    assert header[0].startswith(
        "Finding: the gain over the base model runs from +10.4 points (grpo(lr=0.0001)) to -25.0 (cispo(lr="
    )
    assert (
        "critical learning rates: cispo fit 0.000104 [0.0001, 0.00011], 0.52 [0.36, 0.71] x grpo's; ladder 0.0001 "
        "[< 0.0001, 0.0002); grpo fit 0.0002 [0.000155, 0.000275]; ladder 0.0002 [0.0001, 0.0004)" in header[0]
    )
    # and cispo against its own base model at the cliff: -25 on every seed (a constant loss: p 0), a
    # non-inferiority claim with its declared 2-point margin: -25 lies below -2, shown (p 0): does not hold
    base = claims[
        (
            "CISPO trains stably: does not lose the base model's held-out accuracy at the lr cliff",
            "cispo(lr=0.0004) - base model (step 0)",
        )
    ]
    assert base["estimate"] == pytest.approx(-25.0) and base["verdict"] == "does not hold"
    assert base["kind"] == "non-inferiority" and base["margin"] == 2.0
    assert "of 5 claims (one family, Holm over 5), 1 does not hold: CISPO trains stably" in header[0]
    assert header[0].endswith("4 inconclusive at this scale.")


def test_markdown_and_html_show_the_table_and_the_figure(ladder, tmp_path):
    root, _ = ladder
    md = report_command("ladder", baseline=None, fmt="markdown", results_dir=root, out=tmp_path / "md")
    text = (tmp_path / "md" / "report.md").read_text()
    assert text.index("### Stability: gain over the base model by learning rate") < text.index("### Runs")
    assert "![stability](plots/stability.png)" in text and any(p.name == "stability.png" for p in md)
    report_command("ladder", baseline=None, fmt="html", results_dir=root, out=tmp_path / "html")
    html = (tmp_path / "html" / "report.html").read_text()
    assert "Stability: gain over the base model by learning rate" in html
    assert "Gain over the base model (final Avg@n minus step 0, points) against the learning rate" in html


def test_a_sweep_without_a_learning_rate_axis_has_no_stability_table(tmp_path, report_fixture):
    root = report_fixture.build(tmp_path / "results")
    _, result, tables, header = build_report(root, "fixture", "grpo")
    assert result["stability"] is None and not any(t.key == "stability" for t in tables)
    # its first line still says what it found. The Average of arith (16 samples) and gsm8k (12): base
    # (3/16 + 1/12) / 2 = 13.542%; abc (9/16 + 4/12) / 2 = 44.792% (both seeds), +31.25 points; nsr seeds
    # (7/16, 6/16) and (2/12, 1/12): (40.625 + 12.5) / 2 = 26.5625%, +13.02 points
    assert header[0].startswith(
        "Finding: the gain over the base model runs from +31.2 points (abc) to +13.0 (nsr) "
        "(Avg@4 averaged over arith and GSM8K, mean of 2 seeds per arm); against grpo (Avg@4 averaged over arith "
        "and GSM8K, 95% t CI over seeds): abc +14.1 points "
    )


@pytest.mark.slow
def test_stability_pipeline(tmp_path):
    """A tiny real ladder through `clipbench sweep` and `clipbench report`: grpo at two constant rates x 2
    seeds, 3 rollout steps of the tiny Table-3 recipe, 32 held-out problems. What the trainer writes is
    what the stability report reads (rates, step-0 and final evaluations, the dynamics the flags use)."""
    from clipbench.commands.sweep import sweep_command

    tiny = Path(__file__).resolve().parent.parent / "recipes" / "abc_grpo_table3" / "tiny.yaml"
    spec = tmp_path / "ladder.yaml"
    spec.write_text(
        f"name: tiny_ladder\nbase: {tiny}\n"
        "overrides: {train.steps: 3, eval.every: 0, eval.n: 4, eval.limit: 32, tracking.mlflow: false}\n"
        "grid: {seed: [0, 1], train.lr: [1.0e-4, 3.0e-3], objective.method: [grpo]}\n"
    )
    results = tmp_path / "results"
    sweep_command(
        spec,
        [],
        dry_run=False,
        json_out=False,
        results_dir=results,
        jobs=2,
        launcher=None,
        retry_failed=False,
        tracking_uri=None,
    )
    _, result, tables, header = build_report(results, "tiny_ladder", None)
    block = result["stability"]["builtin:arith-tiny"]
    assert block["rates"] == [1e-4, 3e-3] and list(block["rules"]) == ["grpo"]
    for c in block["rules"]["grpo"]["cells"].values():
        assert c["seeds"] == [0, 1] and c["runs"] == 2 and all(math.isfinite(g) for g in c["gains"])
        # a gain is the run's own final minus step-0 Avg@4 over the 32 problems: a multiple of 100 / 128
        assert all(abs(g * 1.28 - round(g * 1.28)) < 1e-9 for g in c["gains"])
    assert next(t for t in tables if t.key == "stability").rows[0][0] == "grpo"
    assert header[0].startswith("Finding: ") and "critical learning rates: grpo " in header[0]
    report_command("tiny_ladder", baseline=None, fmt="html", results_dir=results, out=tmp_path / "html")
    assert "Stability: gain over the base model by learning rate" in (tmp_path / "html" / "report.html").read_text()


def test_the_study_sweeps_share_their_cliff_runs():
    """What the headers of sweeps/study_stability_ladder.yaml and study_stability_replay.yaml say: a run
    id is the hash of the resolved config, so the ladder's 2e-4 runs (7 rules x seeds 0-4) and the
    replay sweep's (grpo, gspo, geo_mean, cispo x seeds 0-2) are runs of sweeps/study_stability.yaml;
    so are grpo and cispo at the cliff on seeds 0-2, the quickstart's runs before it moved to the
    organism."""
    from clipbench.sweep.expand import expand
    from clipbench.sweep.spec import load_spec

    sweeps = Path(__file__).resolve().parent.parent / "sweeps"
    study = expand(load_spec(sweeps / "study_stability.yaml")).runs
    ladder = expand(load_spec(sweeps / "study_stability_ladder.yaml")).runs
    replay = expand(load_spec(sweeps / "study_stability_replay.yaml")).runs
    # 27 x 10; 7 x 4 x 5 + (cispo, gppo) x 5 at 6e-5; 4 x 3
    assert (len(study), len(ladder), len(replay)) == (270, 150, 12)
    shared = set(study) & set(ladder)
    assert len(shared) == 35 and {ladder[r]["train"]["lr"] for r in shared} == {2e-4}
    assert set(replay) <= set(study)  # recording is outside the run id
    # grpo and cispo on seeds 0-2 at the cliff: the quickstart's run ids before it moved to the organism
    assert {"85af8993c01a", "295a99417fe5", "ed122294be0d", "1b3720ea9e19", "90e63aeb9699", "def95b891b74"} <= set(
        study
    )


def test_fitted_critical_rate_and_its_ratio_to_grpo(ladder):
    # issue 37 (6): gain against t = log2(lr / 1e-4), pooled over seeds; 3 rates, 3 seeds each, so the
    # least-squares quadratic passes through the rates' mean gains.
    # grpo: means +10.417, 0, -14.583 at t = 0, 1, 2: the fit is 0 at t = 1 exactly, falling: 2e-4.
    # cispo: means +2.083, -25, -25: f(t) = 13.542 t^2 - 40.625 t + 2.083, falling root
    # t = (40.625 - sqrt(40.625^2 - 4 x 13.542 x 2.083)) / (2 x 13.542) = 0.05218: 1e-4 x 2^0.05218 = 1.0368e-4;
    # ratio to grpo's 1.0368e-4 / 2e-4 = 0.5184. Intervals: percentile bootstrap over seeds (default_rng(0)).
    _, (_, result, tables, _) = ladder
    rules = next(iter(result["stability"].values()))["rules"]
    grpo, cispo = rules["grpo"]["fit"], rules["cispo"]["fit"]
    assert grpo["rate"] == pytest.approx(2e-4, rel=1e-9) and grpo["censored"] is None and grpo["ratio"] == 1.0
    assert cispo["rate"] == pytest.approx(1.0368e-4, rel=1e-4) and cispo["ratio"] == pytest.approx(0.5184, rel=1e-3)
    lo, hi = cispo["ratio_ci"]
    assert lo < cispo["ratio"] < hi < 1.0  # cispo's critical rate is below grpo's, seeds resampled together
    t = next(t for t in tables if t.key == "stability")
    assert t.columns[-3:] == ["Critical lr, fit [95% CI, seeds]", "x grpo [95% CI]", "Critical lr [ladder]"]


def test_fitted_root_is_censored_at_the_ladder_ends():
    x = np.log([1e-4, 2e-4, 4e-4])
    assert fitted_root(x, np.array([-1.0, -2.0, -3.0])) == (x[0], "below")  # loses at the lowest rate
    assert fitted_root(x, np.array([3.0, 2.0, 1.0])) == (x[-1], "above")  # never loses on the ladder
    root, censored = fitted_root(x[:2], np.array([1.0, -1.0]))  # a line: 0 halfway in log(lr)
    assert censored is None and math.exp(root) == pytest.approx(math.sqrt(2) * 1e-4)


def test_fitted_peak_is_the_vertex_inside_the_ladder_and_censored_outside():
    # issue 36: lr*, the peak of the same quadratic. In t = log2(lr / 1e-4), gains 0, 10, 4 at t = 0, 1, 2:
    # c = (4 - 2 x 10 + 0) / 2 = -8, b = 10 - 0 - c = 18, vertex t = -b / 2c = 1.125: lr* = 1e-4 x 2^1.125.
    x = np.log([1e-4, 2e-4, 4e-4])
    peak, censored = fitted_peak(x, np.array([0.0, 10.0, 4.0]))
    assert censored is None and math.exp(peak) == pytest.approx(1e-4 * 2**1.125, rel=1e-9)
    assert fitted_peak(x, np.array([3.0, 2.0, 1.0])) == (x[0], "below")  # falls on the whole ladder
    assert fitted_peak(x, np.array([1.0, 2.0, 3.0])) == (x[-1], "above")  # rises on the whole ladder
    assert fitted_peak(x, np.array([5.0, 0.0, 4.0])) == (x[0], "below")  # convex: the higher end
    assert fitted_peak(x[:2], np.array([1.0, 2.0])) == (x[1], "above")  # a line from two rates


def test_best_rate_and_whether_the_ladder_brackets_it():
    cell = lambda m: {"mean": m}  # noqa: E731
    assert best_rate({1e-4: cell(1.0), 2e-4: cell(3.0), 4e-4: cell(2.0)}) == {"rate": 2e-4, "mean": 3.0, "edge": None}
    assert best_rate({1e-4: cell(3.0), 2e-4: cell(3.0), 4e-4: cell(2.0)})["rate"] == 1e-4  # a tie: the lower rate
    assert best_rate({1e-4: cell(1.0), 2e-4: cell(2.0)})["edge"] == "highest"
    assert best_rate({1e-4: cell(math.nan), 2e-4: cell(2.0), 4e-4: cell(1.0)})["edge"] == "lowest"  # of the finite ones


def test_the_tuning_table_and_tune_on(ladder, tmp_path):
    # the ladder's gains (make_stability_fixture.py): grpo's means +10.417, 0, -14.583 at t = 0, 1, 2 give
    # c = (-14.583 - 0 + 10.417) / 2 = -2.083, b = 0 - 10.417 - c = -8.333: vertex t = -2, below the ladder,
    # so lr* is censored at 1e-4 ('<='), as its best rate is (the lowest: the ladder does not bracket it).
    root, (_, result, tables, _) = ladder
    block = result["stability"]["builtin:arith-tiny"]
    grpo = block["rules"]["grpo"]
    assert grpo["best"] == {"rate": 1e-4, "mean": pytest.approx(125 / 12), "edge": "lowest"}
    assert grpo["peak"]["rate"] == pytest.approx(1e-4) and grpo["peak"]["censored"] == "below"
    t = next(t for t in tables if t.key == "tuning")
    assert t.rows[[r[0] for r in t.rows].index("grpo")][1:3] == [
        "0.0001 (+10.4; the lowest rate of the ladder)",
        # the resample of seed 1 thrice: gains 6.25, 6.25, -12.5: c = -9.375, b = 9.375, vertex t = 0.5
        # (1.414e-4), drawn with probability 1/27 > 2.5%: the upper end
        "<= 0.0001 [0.0001, 0.000141]",
    ]
    assert block["bench"] is None and "benchmarks averaged" in t.title
    _, tuned, tuned_tables, _ = build_report(root, "ladder", None, tune_on="arith")
    assert tuned["stability"]["builtin:arith-tiny"]["bench"] == "arith"
    assert next(t for t in tuned_tables if t.key == "tuning").title.startswith("Tuned learning rate, gain on arith")
    assert result["claims"] and tuned["claims"] == []  # a tuning sweep tests no claims, and says so
    assert TUNING_NOTE in tuned["notes"] and not any(t.key == "claims" for t in tuned_tables)
    with pytest.raises(
        UserError, match=r"--tune-on: sweep 'ladder' has no evaluation on 'arith-val' \(its benchmarks: arith\)"
    ):
        build_report(root, "ladder", None, tune_on="arith-val")


def test_the_completion_length_curve(ladder):
    # make_stability_fixture.py: cispo's length rises 20 -> 45 over the 10 steps at 2e-4 and 4e-4; every
    # other run stays at 20
    from clipbench.report.load import load_results
    from clipbench.report.plots import close_figures, make_figures

    root, (_, result, _, _) = ladder
    figs = make_figures(load_results(root, "ladder"), result)
    try:
        lines = {ln.get_label(): ln for ln in figs["length"].axes[0].get_lines() if not ln.get_label().startswith("_")}
        assert len(lines) == 6  # one per (rule, rate) label
        x, y = lines["grpo(lr=0.0001)"].get_data()
        assert list(x) == list(range(10)) and np.allclose(y, 20.0)
        _, y = lines["cispo(lr=0.0002)"].get_data()
        assert np.allclose(y, [20 + 25 * s / 9 for s in range(10)])  # 20 + 25 x step / 9, every seed alike
    finally:
        close_figures(figs)


def test_the_tuning_figure_has_a_panel_per_rule_with_its_best_rate_and_lr_star(ladder):
    from clipbench.report.load import load_results
    from clipbench.report.plots import close_figures, make_figures

    root, (_, result, _, _) = ladder
    figs = make_figures(load_results(root, "ladder"), result)
    try:
        visible = [ax for ax in figs["tuning"].axes if ax.get_visible()]
        assert [ax.get_title() for ax in visible] == ["cispo", "grpo"]
        grpo = visible[1]
        # the ring at the best rate (1e-4, mean gain 125/12) and lr*'s dashed line at 1e-4 (censored below)
        ring = [ln for ln in grpo.get_lines() if ln.get_fillstyle() == "none"]
        assert len(ring) == 1 and ring[0].get_xdata()[0] == 1e-4 and ring[0].get_ydata()[0] == pytest.approx(125 / 12)
        dashed = [ln for ln in grpo.get_lines() if ln.get_linestyle() == "--"]
        assert len(dashed) == 1 and dashed[0].get_xdata()[0] == pytest.approx(1e-4)
    finally:
        close_figures(figs)


def test_rules_each_at_one_rate_of_their_own_are_not_a_ladder(ladder):
    """A tuned comparison trains each rule at its own rate (grpo 1e-4, cispo 2e-4): the block has two
    rates but no rule has two, so there is no ladder to read a critical or tuned rate from (before,
    the report gave every rule a 'critical rate >= its one rate' and a 'best rate' of one)."""
    from clipbench.report.load import load_results
    from clipbench.report.stability import run_lr, stability

    root, _ = ladder
    runs = load_results(root, "ladder").runs
    own = [r for r in runs if (r.method, run_lr(r)) in {("grpo", 1e-4), ("cispo", 2e-4)}]
    assert {run_lr(r) for r in own} == {1e-4, 2e-4}
    assert stability(own, {}) is None
    two = own + [r for r in runs if (r.method, run_lr(r)) == ("grpo", 4e-4)]  # grpo at two rates: a ladder
    assert list(stability(two, {})["builtin:arith-tiny"]["rules"]) == ["cispo", "grpo"]
