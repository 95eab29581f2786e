"""The tiny Table 3 pipeline for real: `clipbench sweep` (the trainer) then `clipbench report`.

Checks that what the trainer writes (metric keys, histograms, evaluation payloads) is what the
report reads. Two runs (grpo, abc) of 2 rollout steps; builds the built-in model on first use.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from clipbench.commands.report import report_command
from clipbench.report.build import build_report

SWEEP_TINY = Path(__file__).resolve().parent.parent / "recipes" / "abc_grpo_table3" / "sweep_tiny.yaml"


@pytest.mark.slow
@pytest.mark.slow
def test_tiny_table3_pipeline(tmp_path):
    from clipbench.commands.sweep import sweep_command

    results = tmp_path / "results"
    sweep_command(
        SWEEP_TINY,
        ["seed=0", "train.steps=2", "eval.every=0", "eval.n=4", "eval.limit=8", "tracking.mlflow=false"],
        dry_run=False,
        json_out=False,
        results_dir=results,
        jobs=1,
        launcher=None,
        retry_failed=False,
        tracking_uri=None,
    )
    sweep, result, tables, header = build_report(results, "abc_grpo_table3_tiny", "grpo")
    assert sorted(r.label for r in sweep.runs) == ["abc", "grpo"]
    block = result["blocks"][0]
    assert block["n"] == 4 and block["ks"] == [2, 4]
    arith = block["benchmarks"]["arith"]
    assert arith["problems"] == 8 and set(arith["rows"]) == {"grpo", "abc"} and arith["base"] is not None
    assert block["labels"]["grpo"]["final_steps"] == [2]
    # the clip metrics the trainer logs reach the quadrant table; shares of a run sum to 100 when it clipped
    q = result["quadrants"]["builtin:arith-tiny"]
    assert set(q) == {"grpo", "abc"}
    for entry in q.values():
        assert entry["tokens"] > 0
        if entry["events"]:
            assert sum(entry["share"][k]["mean"] for k in ("q1", "q2", "q3", "q4")) == pytest.approx(100.0)
    assert [t.key for t in tables] == [
        "table3",
        "paper_reference",
        "significance",
        "aggregates",
        "quadrants",
        "gradient_mass",
        "dynamics",
        "claims",
        "provenance",
        "runs",
    ]
    # every run recorded where it ran and its base model's checksum: one machine, the shipped bytes
    from clipbench.models import read_build_info, resolve_model_name

    shipped = read_build_info(resolve_model_name("builtin:arith-tiny"))["weights_sha256"]
    assert result["provenance"]["checksums"] == {"builtin:arith-tiny": [shipped]}
    assert len(result["provenance"]["machines"]) == 1 and not result["provenance"]["unrecorded"]
    assert f"Base model builtin:arith-tiny: weights sha256 {shipped[:12]} for every run that recorded it." in header

    out = tmp_path / "report"
    report_command("abc_grpo_table3_tiny", baseline="grpo", fmt="html", results_dir=results, out=out)
    html = (out / "report.html").read_text()
    # every figure had data: Pass@k against k, entropy, reward, length, eval, profile, quadrants,
    # log-ratio histogram
    assert html.count('src="data:image/png;base64,') == 8
    report_command("abc_grpo_table3_tiny", baseline="grpo", fmt="csv", results_dir=results, out=out)
    rows = list(csv.reader(io.StringIO((out / "table3.csv").read_text())))
    assert rows[0] == ["Benchmark", "Method", "Seeds", "Avg@4", "Pass@2", "Pass@4", "kind"]
    assert [r[1] for r in rows[1:]] == ["base (step 0)", "grpo", "abc", "Gain: abc vs grpo"]
