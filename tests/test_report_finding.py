"""The report's first line (report/finding.py): the arms' gains over the base model, ties and losses said
as such, and each arm against the baseline with its interval, its seeds and the seeds 80% power needs."""

from __future__ import annotations

import math
from pathlib import Path

from clipbench.objectives.plugins import load_plugins
from clipbench.report.build import build_report
from clipbench.report.finding import finding_line
from clipbench.report.stats import mde, seeds_needed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _result(avgs: dict[str, float], base: float = 0.20, baseline: str | None = None, deltas=None) -> dict:
    """A one-block result: each label's mean Avg@8 (fractions), 3 seeds each; `deltas`: {label: (delta,
    (lo, hi), sd)} against the baseline, as analysis._compare writes them."""
    rows = {lb: {"metrics": {"avg": {"mean": v}}} for lb, v in avgs.items()}
    for lb, (d, ci, sd) in (deltas or {}).items():
        rows[lb]["metrics"]["avg"].update(delta=d, delta_ci=list(ci), delta_sd=sd, paired_seeds=3)
    block = {
        "model": "m",
        "n": 8,
        "labels": {lb: {"method": lb, "seeds": [0, 1, 2]} for lb in avgs},
        "average": {"rows": rows, "base": {"metrics": {"avg": {"mean": base}}}},
        "benchmarks": {},
    }
    return {"blocks": [block], "baseline": baseline, "claims": []}


def test_one_arm_below_the_base_model_reads_below_not_minus_over():
    assert finding_line(_result({"cispo": 0.188})) == (
        "Finding: cispo ends 1.2 points below the base model (Avg@8, mean of 3 seeds)."
    )
    assert (
        finding_line(_result({"grpo": 0.2})) == "Finding: grpo ends level with the base model (Avg@8, mean of 3 seeds)."
    )


def test_arms_that_tie_are_all_named():
    # grpo and dapo tie at the top (+5.0 as printed), cispo and sapo at the bottom (-3.0)
    line = finding_line(_result({"grpo": 0.25, "dapo": 0.2500001, "cispo": 0.17, "sapo": 0.17}))
    assert line == (
        "Finding: the gain over the base model runs from +5.0 points (grpo and dapo) to -3.0 (cispo and sapo) "
        "(Avg@8, mean of 3 seeds per arm)."
    )
    line = finding_line(_result({"grpo": 0.25, "dapo": 0.25}))
    assert line == "Finding: grpo and dapo each end 5.0 points over the base model (Avg@8, mean of 3 seeds per arm)."


def test_each_arm_is_compared_with_the_baseline_with_its_interval_seeds_and_power():
    """lower_only - grpo: -0.8 points, interval [-3.1, +1.5] (holds 0), sd 2.0 points over 3 seeds: the
    paired t test detects 0.8 points with 80% power from n seeds, the first n with
    (t_.975,n-1 + t_.8,n-1) * 2.0 / sqrt(n) <= 0.8."""
    deltas = {"lower_only": (-0.008, (-0.031, 0.015), 0.02), "cispo": (-0.12, (-0.2, -0.04), 0.03)}
    line = finding_line(_result({"grpo": 0.25, "lower_only": 0.242, "cispo": 0.13}, baseline="grpo", deltas=deltas))
    need = seeds_needed(2.0, 0.8)
    assert mde(2.0 / math.sqrt(need), need - 1) <= 0.8 < mde(2.0 / math.sqrt(need - 1), need - 2)
    assert need == 52
    assert (
        "; against grpo (Avg@8, 95% t CI over seeds): lower_only -0.8 points [-3.1, +1.5] (3 paired seeds; 80% power "
        "at this difference needs 52 seeds per arm); cispo -12.0 points [-20.0, -4.0] (3 paired seeds; told apart)."
    ) in line


def test_the_fixture_reports_finding_compares_with_its_baseline(tmp_path, report_fixture):
    """The fixture store (tests/test_report.py's header): Avg@4 averaged over arith and gsm8k per seed, grpo
    0.302083 and 0.3125, abc 0.447917 twice, nsr 0.302083 and 0.229167. abc - grpo: 0.145833 and 0.135417,
    mean +14.06 points, sd 0.7366, t_.975,1 = 12.706: +-12.706 x 0.7366 / sqrt(2) = +-6.62 -> [+7.4, +20.7];
    nsr - grpo: 0 and -8.333, mean -4.17, sd 5.893: [-57.1, +48.8], which holds 0; 18 paired seeds detect
    4.17 points at 80% power ((2.110 + 0.863) x 5.893 / sqrt(18) = 4.13 <= 4.17; 17 seeds: 4.27)."""
    root = report_fixture.build(tmp_path / "results")
    _, _, _, header = build_report(root, "fixture", "grpo", replay=False)
    assert (
        "against grpo (Avg@4 averaged over arith and GSM8K, 95% t CI over seeds): abc +14.1 points [+7.4, +20.7] (2 paired "
        "seeds; told apart); "
        "nsr -4.2 points [-57.1, +48.8] (2 paired seeds; 80% power at this difference needs 18 seeds per arm)"
    ) in header[0]
    assert seeds_needed(100 * 0.0833333 / math.sqrt(2), 100 * 0.0416667) == 18


def test_many_arms_compare_the_users_own_rules_alone():
    """Past SHOWN (4) arms besides the baseline, the Finding compares the user's rules (plugins) alone."""
    avgs = {"grpo": 0.25, **{f"r{i}": 0.2 for i in range(5)}}
    deltas = {f"r{i}": (-0.05, (-0.1, -0.01), 0.02) for i in range(5)}
    assert "against grpo" not in finding_line(_result(avgs, baseline="grpo", deltas=deltas))
    load_plugins([str(EXAMPLES / "plugins" / "lower_only.py")])
    avgs["lower_only"], deltas["lower_only"] = 0.2, (-0.05, (-0.1, -0.01), 0.02)
    line = finding_line(_result(avgs, baseline="grpo", deltas=deltas))
    assert line.endswith(
        "against grpo (Avg@8, 95% t CI over seeds): lower_only -5.0 points [-10.0, -1.0] (3 paired seeds; told apart)."
    )
