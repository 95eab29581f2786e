"""A run's evaluation: the benchmarks of its config, graded, at a rollout step. Every engine uses it.

    suite = eval_suite(cfg, task)                  # {benchmark: (problems, grade)}
    run_eval(cfg, rd, step, sampler, suite, sink)  # Avg@n / Pass@k at `step`: stored, logged, returned

The sampling and grading itself is evaluate.py's (the one evaluation of the project, also behind
`clipbench eval`); this module reads a run config: which benchmarks, how many samples, the seed of
each evaluation (derived from the run seed and the step), where the payloads go.
"""

from __future__ import annotations

from collections.abc import Callable

from clipbench.eval.evaluate import Shard, evaluate_and_store
from clipbench.seeds import derive_seed
from clipbench.tasks.benchmarks import ARITH_SPLITS, arith_split, benchmark_grader, get_benchmark, load_benchmark


def eval_suite(cfg, task) -> dict[str, tuple[list, Callable]]:
    """{benchmark: (problems, grade(completion, problem) -> bool)} for the run's eval config."""
    return {name: benchmark_problems(cfg, task, name) for name in cfg.eval.benchmarks}


def benchmark_problems(cfg, task, name: str) -> tuple[list, Callable]:
    """(problems, grade) of one benchmark of the run's eval config: the problems its evaluations hold."""
    if name in ARITH_SPLITS and cfg.task.name == "arith":  # the run's own held-out split and knobs
        return list(arith_split(task, name))[: cfg.eval.limit or None], task.is_correct
    return load_benchmark(name, data_dir=cfg.eval.data_dir, limit=cfg.eval.limit), benchmark_grader(name)


def local_split(cfg, name: str) -> bool:
    """Whether the problems of benchmark `name` for this eval config come from this machine alone (a
    generated split, or a file in eval.data_dir): reading them needs neither the network nor a cache."""
    return (
        (name in ARITH_SPLITS and cfg.task.name == "arith")
        or get_benchmark(name).hf_name is None
        or (cfg.eval.data_dir is not None)
    )


def eval_n(cfg, step: int) -> int:
    """Samples per problem of the evaluation at rollout step ``step``: ``eval.n_ends`` at the first
    and the last (the endpoints a verdict reads), ``eval.n`` between."""
    ends = cfg.eval.n_ends is not None and step in (0, cfg.train.steps)
    return cfg.eval.n_ends if ends else cfg.eval.n


def run_eval(
    cfg,
    rd,
    step: int,
    sampler,
    suite: dict,
    sink,
    *,
    write: bool = True,
    shard: Shard | None = None,
    payloads: dict | None = None,
) -> dict:
    """Avg@n / Pass@k of every benchmark of `suite` at rollout step `step` (both engines). Every
    process of a sharded run samples, in lockstep (with `shard`: each its share of the batches, the
    graded results gathered); only the one with `write` stores and logs. `payloads`: this very
    evaluation, already computed by another run ({benchmark: payload}, train/shared_eval.py): stored
    and logged as if computed here, nothing sampled."""
    if payloads is None:
        payloads = evaluate_and_store(
            rd if write else None,
            step,
            sampler,
            {name: problems for name, (problems, _) in suite.items()},
            grade={name: grade_fn for name, (_, grade_fn) in suite.items()},
            n=eval_n(cfg, step),
            seed=derive_seed(cfg.seed, "eval", step),
            temperature=cfg.eval.temperature,
            top_p=cfg.eval.top_p,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.sampler.max_new_tokens,
            shard=shard,
        )
    elif write:
        for name, payload in payloads.items():
            rd.write_eval(step, name, {**payload, "step": int(step)})
    flat = {
        f"eval/{name}/{k}": float(v)
        for name, payload in payloads.items()
        for k, v in payload["summary"].items()
        if isinstance(v, (int, float))
    }
    if write:
        for name in payloads:
            sink.log_artifact(rd.eval_path(step, name), f"eval/step_{step:06d}")
        sink.log_metrics(step, flat)
    return flat
