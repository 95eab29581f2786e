"""The report never shows a wrong number: failed and unfinished runs are listed, not compared;
skipped steps and collapse are flagged per run; identical results and sparse series are visible.
Built on the report fixture (tests/fixtures/make_report_fixture.py), edited per case; no training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from clipbench.report.analysis import analyze
from clipbench.report.build import build_report
from clipbench.report.load import load_results
from clipbench.report.plots import _is_sparse, close_figures, make_figures
from clipbench.report.render import to_markdown


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def store(tmp_path, report_fixture):
    root = report_fixture.build(tmp_path / "results")
    return root, lambda method, seed: root / "fixture" / report_fixture.run_id(method, seed)


def test_failed_and_unfinished_runs_are_listed_not_compared(store):
    root, run = store
    # grpo seed 1 failed during step 1: its only evaluation is step 0 (the base model's score)
    g1 = run("grpo", 1)
    shutil.rmtree(g1 / "eval" / "step_000002")
    write_rows(g1 / "metrics.jsonl", [r for r in rows_of(g1 / "metrics.jsonl") if r["step"] == 0])
    (g1 / "status.json").write_text(json.dumps({"state": "failed", "step": 0, "error": "RuntimeError: boom\nat x"}))
    # nsr seed 0 was interrupted; abc seed 1 finished but lost its final evaluation
    (run("nsr", 0) / "status.json").write_text(json.dumps({"state": "running", "step": 2}))
    shutil.rmtree(run("abc", 1) / "eval" / "step_000002")

    sweep, result, tables, header = build_report(root, "fixture", "grpo")
    arith = result["blocks"][0]["benchmarks"]["arith"]["rows"]
    # grpo is seed 0 alone: arith counts [4, 2, 1, 0] -> Avg@4 7/16; never the failed run's step-0 3/16
    assert arith["grpo"]["seeds"] == 1 and arith["grpo"]["metrics"]["avg"]["mean"] == pytest.approx(7 / 16)
    assert arith["abc"]["seeds"] == 1 and arith["abc"]["metrics"]["avg"]["mean"] == pytest.approx(9 / 16)  # seed 0
    assert arith["nsr"]["seeds"] == 1 and arith["nsr"]["metrics"]["avg"]["mean"] == pytest.approx(6 / 16)  # seed 1
    excluded = {e["run_id"]: e["reason"] for e in result["runs"]["excluded"]}
    assert excluded == {
        "grpo-s100000": "failed after 1/2 steps: RuntimeError: boom",
        "nsr-s0000000": "not finished (running, 2/2 steps: interrupted, or still training)",
        "abc-s1000000": "finished, but its last evaluation is at step 0 of 2",
    }
    assert result["runs"]["compared"] == 3
    assert any(h.startswith("Not compared (3 run(s)): abc seed 1 (abc-s1000000): finished, but") for h in header)
    runs = next(t for t in tables if t.key == "runs")
    text = to_markdown(runs)
    assert (
        "| grpo | 1 | grpo-s100000 | failed | 1/2 | 0 | not compared: failed after 1/2 steps: RuntimeError: boom |"
        in text
    )
    assert "| grpo | 0 | grpo-s000000 | finished | 2/2 | 0 | ok |" in text
    # the quadrant table counts compared runs only: grpo 1 seed x 4 rows x 10 events
    assert result["quadrants"]["builtin:arith-tiny"]["grpo"]["events"] == 40


def test_skipped_steps_and_collapse_are_flagged_per_run(store):
    root, run = store
    a0 = run("abc", 0)  # 2 of its 4 optimizer steps skipped; reward 0.4 -> 0.1
    rows = rows_of(a0 / "metrics.jsonl")
    for r, skipped in zip(rows, (0, 1, 1, 2)):
        r["skipped_nonfinite"] = skipped
        r["reward/mean"] = 0.4 if r["step"] == 0 else 0.1
    write_rows(a0 / "metrics.jsonl", rows)
    g0 = run("grpo", 0)  # entropy 0.85 (step 0 mean of 0.9, 0.8) -> 0.05; gsm8k Avg@4 1/12 -> 0
    rows = rows_of(g0 / "metrics.jsonl")
    for r in rows:
        if r["step"] == 1:
            r["entropy"] = 0.05
    write_rows(g0 / "metrics.jsonl", rows)
    p = g0 / "eval" / "step_000002" / "gsm8k.json"
    payload = json.loads(p.read_text())
    payload["correct"] = [[0] * 4 for _ in payload["correct"]]
    p.write_text(json.dumps(payload))
    n1 = run("nsr", 1)  # the off-policy mini-batches never moved the policy
    rows = rows_of(n1 / "metrics.jsonl")
    for r in rows:
        r.update({"mini_batch": (r["opt_step"] - 1) % 2, "ratio/min": 1.0, "ratio/max": 1.0})
    write_rows(n1 / "metrics.jsonl", rows)

    _, result, tables, header = build_report(root, "fixture", "grpo")
    h = result["health"]
    assert h["abc-s0000000"]["skipped"] == 2 and h["abc-s0000000"]["skipped_frac"] == 0.5
    assert h["abc-s0000000"]["flags"] == ["skipped 2 of 4 optimizer steps (non-finite)", "reward collapse (0.4 -> 0.1)"]
    assert h["grpo-s000000"]["flags"] == [
        "entropy collapse (0.85 -> 0.05)",
        "accuracy collapse on gsm8k (Avg@n 8.3% -> 0.0%)",
    ]
    assert h["nsr-s1000000"]["flags"] == ["policy frozen (ratio = 1 on every off-policy mini-batch)"]
    assert h["grpo-s100000"]["flags"] == []  # reward 0.35 -> 0.45, entropy 0.86 -> 0.66: healthy
    text = to_markdown(next(t for t in tables if t.key == "runs"))
    assert "| abc | 0 | abc-s0000000 | finished | 2/2 | 2 (50.0%) | reward collapse (0.4 -> 0.1) |" in text
    assert "reward collapse = mean reward over the last 10% of rollout steps" in text
    assert any(line.startswith("Flagged (3 run(s), see the Runs table): ") for line in header)


def test_identical_results_sparse_series_and_torn_lines_are_said(store):
    root, run = store
    for seed in (0, 1):  # nsr's evaluations and training curves become grpo's, seed by seed
        src, dst = run("grpo", seed), run("nsr", seed)
        shutil.copytree(src / "eval", dst / "eval", dirs_exist_ok=True)
        shutil.copy(src / "metrics.jsonl", dst / "metrics.jsonl")
    with open(run("abc", 0) / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "opt_st')  # a crash mid-append
    _, result, _, header = build_report(root, "fixture", "grpo")
    assert result["identical"] == {"builtin:arith-tiny": [["grpo", "nsr"]]}
    assert any(line.startswith("Identical results: grpo and nsr have the same correctness matrix") for line in header)
    assert any("abc-s0000000/metrics.jsonl: skipped an incomplete last line 5" in line for line in header)

    sweep = load_results(root, "fixture")
    figs = make_figures(sweep, analyze(sweep, "grpo", resamples=10))
    try:
        # the fixture's reward does not depend on the method: all three coincide there
        for name, same in (("entropy", "grpo = nsr"), ("eval", "grpo = nsr"), ("reward", "grpo = abc = nsr")):
            notes = [t.get_text() for t in figs[name].texts]
            assert f"Identical curves (drawn on top of each other): {same}" in notes, name
        assert figs["entropy"].axes[0].get_lines()[0].get_marker() == "o"  # 4 points: markers
    finally:
        close_figures(figs)


def test_sparse_rule():
    dense = np.arange(40.0)
    assert not _is_sparse(dense)
    assert _is_sparse(np.arange(5.0))  # few points
    gap = dense.copy()
    gap[[10, 12]] = np.nan  # the point at 11 has no neighbour: drawn as a marker
    assert _is_sparse(gap)
