"""Evaluate a sampler on benchmarks: n samples per problem, graded, as correctness matrices.

The one evaluation of the project, used by the trainer (at the start, every `eval.every` steps and at
the end of a run) and by `clipbench eval`; it sits below both (tasks own problems and graders).

    payloads = evaluate(sampler, {"aime24": problems, ...}, n=64, seed=0)
    evaluate_and_store(run_dir, step, sampler, problems_by_benchmark, n=8, seed=0)  # the trainer

One payload per benchmark (what ``RunDir.write_eval`` stores and the report reads):

    {"benchmark": str, "n": int, "seed": int, "problem_ids": [P ids], "correct": P x n 0/1 lists,
     "summary": clipbench.eval.passk.summarize(correct) without per-problem arrays,
     "temperature", "max_new_tokens", "truncated_fraction", "mean_completion_tokens", "seconds"}

Seeding: the prompts of a benchmark are sampled in batches of ``batch_prompts``; batch b of
benchmark B is generated with the seed ``SeedSequence([seed, crc32(B), b])`` (one 31-bit word), so
each benchmark's samples depend only on the seed, the benchmark and the batching, never on which
other benchmarks are evaluated alongside it, nor on how many processes share the work. One process
hands a sampler with ``generate_calls`` (the hf sampler) every batch at once, each with its seed: it
may sample several batches as one call where that gives the same tokens (rollout/hf.py).

Several processes (``shard``: a run sharded over ranks, which sample in lockstep): process r samples
and grades batches r, r + world, ...; a process with no batch left in a round repeats the last batch
and discards it (every process joins every generate call); the graded batches are gathered, so
every process returns the whole payload, equal to one process's.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from clipbench.eval.passk import summarize
from clipbench.tasks.base import Problem
from clipbench.tasks.benchmarks import benchmark_grader

Grade = Callable[[str, Problem], bool]
DEFAULT_BATCH_PROMPTS = 16


@dataclass(frozen=True)
class Shard:
    """This process's part of an evaluation shared by `world` processes that sample in lockstep."""

    rank: int
    world: int
    gather: Callable[[object], list]  # this process's object -> every process's, in rank order


def batch_seed(seed: int, benchmark: str, batch: int) -> int:
    """The sampler seed of one batch: independent streams per (seed, benchmark, batch)."""
    words = np.random.SeedSequence([int(seed), zlib.crc32(benchmark.encode()), int(batch)]).generate_state(1)
    return int(words[0] >> 1)  # 31 bits: fits every backend's seed type


def _grader(grade: Grade | Mapping[str, Grade] | None, benchmark: str) -> Grade:
    """``grade`` itself, its entry for ``benchmark``, or the benchmark's own grader."""
    if callable(grade):
        return grade
    if isinstance(grade, Mapping) and benchmark in grade:
        return grade[benchmark]

    return benchmark_grader(benchmark)


def _public_summary(correct: np.ndarray) -> dict:
    s = summarize(correct)
    s.pop("per_problem", None)
    return s


def _graded(sampler, out, chunk: Sequence[Problem], n: int, grade: Grade) -> tuple[list[list[bool]], int, int]:
    """A batch's (correct rows: prompt i owns rows i*n .. i*n+n-1, truncated rows, completion tokens)."""
    if len(out.texts) != len(chunk) * n:
        raise RuntimeError(
            f"sampler {getattr(sampler, 'name', sampler)!r} returned {len(out.texts)} "
            f"completions for {len(chunk)} prompts x n={n}"
        )
    return (
        [[bool(grade(out.texts[i * n + j], problem)) for j in range(n)] for i, problem in enumerate(chunk)],
        sum(bool(t) for t in out.truncated),
        sum(len(c) for c in out.completion_ids),
    )


def evaluate_benchmark(
    sampler,
    name: str,
    problems: Sequence[Problem],
    *,
    n: int,
    seed: int,
    grade: Grade,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    top_p: float | None = None,
    batch_prompts: int | None = DEFAULT_BATCH_PROMPTS,
    shard: Shard | None = None,
) -> dict:
    """The payload of one benchmark (see the module docstring)."""
    if n < 1:
        raise ValueError(f"n must be >= 1 samples per problem, got {n}")
    if not problems:
        raise ValueError(f"benchmark '{name}' has no problems to evaluate")
    t0 = time.perf_counter()
    step = len(problems) if not batch_prompts else int(batch_prompts)
    if step < 1:
        raise ValueError(f"batch_prompts must be >= 1 or None, got {batch_prompts}")
    chunks = [problems[start : start + step] for start in range(0, len(problems), step)]
    rank, world = (0, 1) if shard is None else (shard.rank, shard.world)
    graded: dict[int, tuple[list[list[bool]], int, int]] = {}  # batch -> (correct rows, truncated, tokens)
    settings = dict(temperature=temperature, max_new_tokens=max_new_tokens, top_p=top_p)
    if shard is None and hasattr(sampler, "generate_calls"):  # every batch in one request (the sampler may merge them)
        outs = sampler.generate_calls(
            [([p.prompt for p in chunk], batch_seed(seed, name, b)) for b, chunk in enumerate(chunks)], n, **settings
        )
        graded = {b: _graded(sampler, out, chunk, n, grade) for b, (chunk, out) in enumerate(zip(chunks, outs))}
    else:
        for first in range(0, len(chunks), world):  # one round: a batch per process
            b = first + rank
            mine = b < len(chunks)
            run = b if mine else len(chunks) - 1  # no batch left: repeat the last one, discard it (lockstep)
            out = sampler.generate([p.prompt for p in chunks[run]], n, seed=batch_seed(seed, name, run), **settings)
            if mine:
                graded[b] = _graded(sampler, out, chunks[b], n, grade)
    if shard is not None:
        graded = {b: part for every in shard.gather(graded) for b, part in every.items()}
    correct = np.array([row for b in range(len(chunks)) for row in graded[b][0]], dtype=np.int8)  # (P, n)
    truncated = sum(graded[b][1] for b in graded)
    lengths = sum(graded[b][2] for b in graded)
    total = len(problems) * n
    return {
        "benchmark": name,
        "n": n,
        "seed": int(seed),
        "problem_ids": [p.id for p in problems],
        "correct": correct.tolist(),
        "summary": _public_summary(correct),
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "truncated_fraction": truncated / total,
        "mean_completion_tokens": lengths / total,
        "seconds": time.perf_counter() - t0,
    }


def evaluate(
    sampler,
    problems_by_benchmark: Mapping[str, Sequence[Problem]],
    *,
    n: int,
    seed: int,
    grade: Grade | Mapping[str, Grade] | None = None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    top_p: float | None = None,
    batch_prompts: int | None = DEFAULT_BATCH_PROMPTS,
    progress: Callable[[str, dict], None] | None = None,
    shard: Shard | None = None,
) -> dict[str, dict]:
    """{benchmark: payload}: ``n`` samples per problem from ``sampler``, graded.

    ``grade(completion, problem) -> bool``: one callable for every benchmark, a mapping
    {benchmark: callable}, or None for each benchmark's own grader
    (``clipbench.tasks.benchmarks.benchmark_grader``: math-verify, or arith's exact integer).
    ``temperature`` / ``max_new_tokens`` / ``top_p`` override the sampler's settings (None keeps them).
    ``shard``: this process's part when several processes share the evaluation (module docstring).
    """
    out = {}
    for name, problems in problems_by_benchmark.items():
        out[name] = evaluate_benchmark(
            sampler,
            name,
            list(problems),
            n=n,
            seed=seed,
            grade=_grader(grade, name),
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            top_p=top_p,
            batch_prompts=batch_prompts,
            shard=shard,
        )
        if progress is not None:
            progress(name, out[name])
    return out


def evaluate_and_store(
    run_dir, step: int, sampler, problems_by_benchmark: Mapping[str, Sequence[Problem]], **kwargs
) -> dict[str, dict]:
    """``evaluate`` and write each payload to ``run_dir.write_eval(step, benchmark, payload)``.
    ``run_dir`` None: evaluate only (the ranks of a sharded run that do not write; with ``shard`` they
    share the sampling and grading with the one that does)."""
    payloads = evaluate(sampler, problems_by_benchmark, **kwargs)
    for name, payload in payloads.items():
        if run_dir is not None:
            run_dir.write_eval(step, name, {**payload, "step": int(step)})
    return payloads
