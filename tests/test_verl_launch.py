"""`clipbench sweep --engine verl` without verl (the main environment): the task export verl trains on,
clipbench's reward as verl's custom reward function, and a real launch refused clearly where verl's
trainer cannot run (nothing written). The overrides themselves are checked against verl's schema in
tests/test_verl.py (.venv-verl)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.config import load_run_config, to_dict
from clipbench.engines.verl import export_task
from clipbench.integrations.verl_reward import compute_score
from clipbench.tasks import build_task

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "arith_tiny.yaml"


def test_export_and_reward_are_clipbenchs_own(tmp_path):
    """Train rows are the task's training pool, val rows every eval benchmark; compute_score gives the
    task's reward: 1.0 for the gold answer, 0.0 for a wrong one."""
    cfg = to_dict(load_run_config(RECIPE, ["eval.limit=5", "task.train_size=40"]))
    train, val = export_task(cfg, tmp_path / "data")
    tr, va = pd.read_parquet(train), pd.read_parquet(val)
    task = build_task(load_run_config(RECIPE, ["task.train_size=40"]).task)
    problems = list(task.train_problems())
    assert len(tr) == len(problems) == 40 and len(va) == 5
    assert set(va["data_source"]) == {"clipbench/arith"}
    row = tr.iloc[0]
    assert (
        row["prompt"][0]["content"] == problems[0].prompt and row["reward_model"]["ground_truth"] == problems[0].answer
    )
    info = dict(row["extra_info"])
    assert compute_score(row["data_source"], problems[0].answer, problems[0].answer, info) == 1.0
    wrong = str(int(problems[0].answer) + 1)
    assert compute_score(row["data_source"], wrong, problems[0].answer, info) == 0.0
    assert export_task(cfg, tmp_path / "data") == (train, val)  # once per task: reused


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed here")
def test_a_real_verl_launch_without_verl_is_one_line_and_writes_nothing(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({"name": "v", "base": str(RECIPE), "grid": {"objective.method": ["grpo"]}}))
    res = tmp_path / "results"
    r = CliRunner().invoke(app, ["sweep", str(f), "--engine", "verl", "--results-dir", str(res)])
    assert r.exit_code == 2 and "verl is not installed here" in r.stderr and "--dry-run prints" in r.stderr
    assert not res.exists()
    r = CliRunner().invoke(app, ["sweep", str(f), "--engine", "verll", "--results-dir", str(res)])
    assert r.exit_code == 2 and "unknown engine 'verll' (did you mean 'verl'?)" in r.stderr
