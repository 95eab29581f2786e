"""verl's custom reward function for tasks exported by `clipbench sweep --engine verl`.

    reward.custom_reward_function.path=<this file> reward.custom_reward_function.name=compute_score

Each exported row carries its clipbench task config and problem in `extra_info`, so the score is
clipbench's own: `task.reward` for the training rows (exact integers for arith, math-verify for math),
the same function the built-in loop and the TRL engine use, and the benchmark's grader for the
validation rows of other benchmarks (`clipbench.tasks.benchmarks.benchmark_grader`).
"""

from __future__ import annotations

import functools
import json

from clipbench.tasks import build_task
from clipbench.tasks.base import Problem


@functools.lru_cache(maxsize=8)
def _task(task_json: str):
    return build_task(json.loads(task_json))


@functools.lru_cache(maxsize=16)
def _grader(benchmark: str):
    from clipbench.tasks.benchmarks import benchmark_grader  # noqa: PLC0415 - tasks.benchmarks pulls in numpy

    return benchmark_grader(benchmark)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Training rows: the task's reward. Validation rows of another benchmark: its grader (1.0 / 0.0)."""

    info = extra_info or {}
    problem = Problem(
        id=str(info.get("id", "")),
        prompt=str(info.get("prompt", "")),
        answer=str(ground_truth),
        meta=json.loads(info.get("meta", "{}")),
    )
    if info.get("benchmark"):
        return float(_grader(info["benchmark"])(solution_str, problem))
    return float(_task(info["task"]).reward(solution_str, problem))
