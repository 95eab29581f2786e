"""One task per run: the trainer's evaluation and `clipbench eval <run_dir>` build the run's task
with the same function (`clipbench.tasks.build_run_task`), so for a seed != 0 both evaluate the
same held-out split (before, the trainer always drew seed 0's split)."""

from __future__ import annotations

import json

import pytest

from clipbench.commands.eval import eval_command
from clipbench.config import load_run_config
from clipbench.tasks import build_run_task
from clipbench.tasks.arith import ArithTask
from clipbench.tracking.store import RunDir
from clipbench.train.loop import run_training

# Near-greedy sampling (T = 1e-3) makes each problem's correctness a function of the model and the
# prompt only, so two evaluations of the same checkpoint agree problem by problem iff they draw the
# same problems.
TINY = [
    "seed=3",
    "train.steps=1",
    "train.prompts_per_step=2",
    "sampler.group_size=2",
    "train.mini_batches=1",
    "sampler.max_new_tokens=4",
    "eval.n=1",
    "eval.limit=24",
    "eval.temperature=0.001",
    "eval.at_start=false",
    "tracking.mlflow=false",
]


@pytest.mark.slow
def test_trainer_and_eval_command_evaluate_the_same_split_for_seed_3(tmp_path):
    cfg = load_run_config(None, TINY)  # builtin:arith-tiny on arith (the schema's defaults)
    run_dir = tmp_path / "train" / "run"
    run_training(cfg, run_dir)
    trainer = RunDir(run_dir).read_evals()[1]["arith"]
    eval_command(
        model=str(run_dir),
        benchmarks="arith",
        n=1,
        data_dir=None,
        limit=24,
        max_new_tokens=4,
        temperature=0.001,
        seed=0,
        backend="hf",
        out=tmp_path / "eval",
    )
    again = json.loads((tmp_path / "eval" / "arith.json").read_text())
    assert again["problem_ids"] == trainer["problem_ids"]
    assert again["correct"] == trainer["correct"]  # same problems, graded alike
    assert 0 < sum(c for (c,) in trainer["correct"]) < 24  # (so the match is informative)
    # the split is the run seed's, not seed 0's
    prompts = [p.prompt for p in build_run_task(cfg).test_problems()[:24]]
    assert prompts == [p.prompt for p in ArithTask(seed=3).test_problems(24)]
    assert prompts != [p.prompt for p in ArithTask(seed=0).test_problems(24)]
