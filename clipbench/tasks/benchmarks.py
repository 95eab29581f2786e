"""Evaluation benchmarks by name: Hugging Face datasets by default, local files with ``data_dir``.

load_benchmark("aime24")                        # datasets.load_dataset("HuggingFaceH4/aime_2024", split="train")
load_benchmark("aime24", data_dir="data/")      # data/aime24.jsonl (offline)
load_benchmark("arith")                         # ArithTask()'s test split (no files)
load_benchmark("arith", arith=task)             # a given arith task's test split (a run's own)
load_benchmark("arith-val", arith=task)         # its validation split (held out, disjoint from test)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clipbench.errors import UserError
from clipbench.registry import Registry
from clipbench.tasks.arith import ArithTask
from clipbench.tasks.base import Problem, Task
from clipbench.tasks.grader import grade
from clipbench.tasks.math import load_problems


@dataclass(frozen=True)
class Benchmark:
    name: str
    hf_name: str | None  # None: generated, not loaded (arith)
    hf_split: str = "test"
    hf_config: str | None = None
    local_file: str | None = None  # file name inside a --data-dir
    description: str = ""


BENCHMARKS: Registry[Benchmark] = Registry("benchmark")
for _b in (
    Benchmark("aime24", "HuggingFaceH4/aime_2024", "train", None, "aime24.jsonl", "AIME 2024 I+II, 30 problems"),
    Benchmark("aime25", "yentinglin/aime_2025", "train", None, "aime25.jsonl", "AIME 2025 I+II, 30 problems"),
    Benchmark("amc23", "math-ai/amc23", "test", None, "amc23.jsonl", "AMC 12 2023, 40 problems"),
    Benchmark("math500", "HuggingFaceH4/MATH-500", "test", None, "math500.jsonl", "MATH-500 (Lightman et al.)"),
    Benchmark("gsm8k", "openai/gsm8k", "test", "main", "gsm8k_test.jsonl", "GSM8K test, 1319 problems"),
    Benchmark("arith", None, description="ArithTask's held-out test split"),
    Benchmark("arith-val", None, description="ArithTask's validation split (held out, disjoint from the test split)"),
):
    BENCHMARKS.register(_b.name, _b)


def get_benchmark(name: str) -> Benchmark:
    return BENCHMARKS.lookup(name)


def _arith_task(arith: Task | None) -> Task:
    if arith is not None:
        return arith

    return ArithTask()


ARITH_SPLITS = {"arith": "test", "arith-val": "val"}  # the generated benchmarks: a run's own splits


def arith_split(task: Task, name: str):
    """The problems of generated benchmark ``name`` ('arith': the test split, 'arith-val': validation)."""
    return task.test_problems() if ARITH_SPLITS[name] == "test" else task.val_problems()


def load_benchmark(
    name: str,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    template: str = "dapo",
    *,
    arith: Task | None = None,
) -> list[Problem]:
    """Problems of benchmark ``name`` (first ``limit``), prompts rendered with ``template``.

    With ``data_dir`` the benchmark's local file is read from it; otherwise the Hugging Face dataset
    is loaded (which needs the network or the HF cache). ``arith`` is the arith task whose test
    split the ``arith`` benchmark is (default ``ArithTask()``; a run passes its own task, see
    ``clipbench.tasks.build_run_task``); it ignores ``data_dir``/``template``.
    """
    bench = get_benchmark(name)
    if limit is not None and limit < 0:
        raise UserError(f"benchmark '{name}': limit must be >= 0, got {limit}")
    if bench.hf_name is None:
        problems = list(arith_split(_arith_task(arith), name))
        return problems if limit is None else problems[:limit]
    if data_dir is not None:
        path = Path(data_dir).expanduser() / bench.local_file
        if not path.is_file():
            raise UserError(f"benchmark '{name}': no file {bench.local_file} in {data_dir}")
        return load_problems(path, template, limit=limit, label=name)
    try:
        return load_problems(bench.hf_name, template, bench.hf_split, limit, config=bench.hf_config, label=name)
    except UserError as e:
        raise UserError(
            f"benchmark '{name}': {e}; without the hub, pass --data-dir DIR holding {bench.local_file}"
        ) from None


def benchmark_grader(name: str, *, arith: Task | None = None) -> Callable[[str, Problem], bool]:
    """``is_correct(completion, problem)`` for the benchmark's problems."""
    bench = get_benchmark(name)
    if bench.hf_name is None:
        return _arith_task(arith).is_correct
    return lambda completion, problem: grade(completion, problem.answer)
