"""`clipbench eval --model PATH_OR_RUN --benchmarks aime24,aime25,amc23 --n 64`.

``--model`` is an HF name, a local model directory, a built-in model (``builtin:arith-steps``:
``arith`` is then the task it was built for), or a run directory of the results store
(``<results>/<sweep>/<run_id>``: its last checkpoint is evaluated, with the run's dtype, and ``arith``
is the test split of the run's own task, built by ``clipbench.tasks.build_run_task`` exactly as the
trainer builds it). Prints Avg@n and Pass@k per benchmark and
writes one correctness-matrix payload per benchmark plus ``summary.json`` to ``--out`` (default
``results/eval/<model-slug>/``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from clipbench.config.stored import recorded, setting
from clipbench.errors import UserError
from clipbench.eval.evaluate import evaluate
from clipbench.eval.passk import default_ks
from clipbench.models import (
    BUILTIN_PREFIX,
    compute_dtype,
    dtype_name,
    load_model_and_tokenizer,
    read_build_info,
    resolve_model_name,
)
from clipbench.rollout import build_sampler, resolve_backend
from clipbench.tasks import build_run_task, build_task
from clipbench.tasks.base import Task
from clipbench.tasks.benchmarks import benchmark_grader, get_benchmark, load_benchmark
from clipbench.tracking.files import atomic_write_json
from clipbench.tracking.store import RunDir
from clipbench.train.checkpoint import find_checkpoint, load_policy

DEFAULT_OUT_ROOT = Path("results") / "eval"
EVAL_GPU_MEMORY_UTILIZATION = 0.7  # vllm: no optimizer or activations to share the GPU with here


@dataclass
class EvalTarget:
    """What to load: model path/name, dtype, and (for a run dir) the run's config; ``arith`` is the
    arith task whose test split the ``arith`` benchmark evaluates (None: the default ``ArithTask()``)."""

    model: str
    slug: str
    dtype: str = "float32"
    checkpoint: Path | None = None  # a run's checkpoint directory (clipbench.train.checkpoint layout)
    run_config: dict | None = None
    arith: Task | None = None


def slugify(text: str) -> str:
    """'Qwen/Qwen3-4B-Base' -> 'Qwen--Qwen3-4B-Base'; anything else unsafe in a file name -> '-'."""
    s = text.strip().rstrip("/").replace("/", "--").replace(":", "-")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-.") or "model"


def _run_arith_task(cfg: dict) -> Task | None:
    """The run's own task when it is arith (the trainer evaluated its test split), else None."""
    if setting(cfg, "task.name") != "arith":
        return None

    try:
        return build_run_task(cfg)
    except UserError as e:
        raise UserError(f"run config: {e}") from None


def built_on_task(path: str | Path) -> Task:
    """The arith task a built-in model was fine-tuned on (its build record), seed 0: every seed's
    test split is held out of every seed's train split, so it is a fair test for any build seed."""

    knobs = {k: v for k, v in read_build_info(path)["task"].items() if k not in ("name", "seed")}
    return build_task({"name": "arith", **knobs}, seed=0)


def resolve_target(model: str, default_dtype: str) -> EvalTarget:
    """A run directory (config.yaml + checkpoints/last/model) or a model name/path."""
    path = Path(model).expanduser()
    if (path / "config.yaml").is_file():
        rd = RunDir(path)
        cfg = rd.read_config() or {}
        ckpt = find_checkpoint(rd.checkpoint_dir)
        if ckpt is None:
            raise UserError(
                f"--model {model}: run directory has no checkpoint ({rd.checkpoint_dir}); "
                f"train it first or pass a model name"
            )
        dtype = str(recorded(cfg, "model.dtype") or default_dtype)
        return EvalTarget(
            model=str(ckpt),
            slug=slugify(f"{path.parent.name}/{path.name}"),
            dtype=dtype,
            checkpoint=ckpt,
            run_config=cfg,
            arith=_run_arith_task(cfg),
        )
    if model.startswith(BUILTIN_PREFIX):
        return EvalTarget(
            model=model, slug=slugify(model), dtype=default_dtype, arith=built_on_task(resolve_model_name(model))
        )
    return EvalTarget(model=model, slug=slugify(model), dtype=default_dtype)


def parse_benchmarks(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names:
        raise UserError("--benchmarks: give at least one benchmark, e.g. aime24,aime25,amc23")
    for b in names:
        get_benchmark(b)  # UserError with did-you-mean
    return list(dict.fromkeys(names))


def load_suite(
    names: list[str], *, data_dir: Path | None, limit: int | None, template: str, arith: Task | None = None
) -> tuple[dict, dict]:
    """({benchmark: problems}, {benchmark: grade(completion, problem)})."""

    problems, graders = {}, {}
    for name in names:
        try:
            problems[name] = load_benchmark(name, data_dir=data_dir, limit=limit, template=template, arith=arith)
        except ValueError as e:
            raise UserError(f"benchmark '{name}': {e}") from None
        if not problems[name]:
            raise UserError(f"benchmark '{name}': no problems loaded")
        graders[name] = benchmark_grader(name, arith=arith)
    return problems, graders


def summary_table(payloads: dict[str, dict], title: str) -> Table:
    """Rich table: one row per benchmark, Avg@n and Pass@k (percent)."""

    n = min(p["n"] for p in payloads.values())
    ks = [k for k in default_ks(n) if k > 1]  # Avg@n is Pass@1
    table = Table(title=title)
    table.add_column("Benchmark")
    table.add_column("Problems", justify="right")
    table.add_column(f"Avg@{n}", justify="right")
    for k in ks:
        table.add_column(f"Pass@{k}", justify="right")
    for name, p in payloads.items():
        s = p["summary"]
        avg = s[f"avg@{p['n']}"]
        table.add_row(
            name,
            str(len(p["problem_ids"])),
            f"{100 * avg:.1f}",
            *[f"{100 * s[f'pass@{k}']:.1f}" if f"pass@{k}" in s else "" for k in ks],
        )
    return table


def eval_command(
    *,
    model: str,
    benchmarks: str,
    n: int,
    data_dir: Path | None,
    limit: int | None,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    backend: str,
    out: Path | None,
) -> dict:
    if n < 1:
        raise UserError(f"--n must be >= 1, got {n}")
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not temperature > 0:
        raise UserError(f"--temperature must be > 0, got {temperature}")
    if data_dir is not None and not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir}: not a directory")
    names = parse_benchmarks(benchmarks)
    console = Console(stderr=True)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = resolve_target(model, "auto")
    target.dtype = dtype_name(compute_dtype(target.dtype, device))  # a run's `auto` too
    template = "dapo"
    if target.run_config:
        template = setting(target.run_config, "task.template") or "dapo"
        template = "dapo" if template == "auto" else template
    problems, graders = load_suite(names, data_dir=data_dir, limit=limit, template=template, arith=target.arith)

    if target.checkpoint is not None:
        path = target.model
        lm, tok = load_policy(target.checkpoint, dtype=target.dtype, device=device)
    else:
        path = resolve_model_name(target.model)
        lm, tok = load_model_and_tokenizer(path, dtype=target.dtype, device=device)
    resolved = resolve_backend(backend)
    sampler = build_sampler(
        resolved,
        lm,
        tok,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        dtype=target.dtype,
        gpu_memory_utilization=EVAL_GPU_MEMORY_UTILIZATION,
    )
    out_dir = Path(out) if out is not None else DEFAULT_OUT_ROOT / target.slug
    console.print(f"evaluating {model} ({resolved}, {device}) on {', '.join(names)}: n={n}, seed={seed} -> {out_dir}")

    def progress(name: str, payload: dict) -> None:
        atomic_write_json(out_dir / f"{name}.json", payload)
        console.print(
            f"  {name}: avg@{n} {100 * payload['summary'][f'avg@{n}']:.1f}%  "
            f"({len(payload['problem_ids'])} problems, {payload['seconds']:.0f}s)"
        )

    t0 = time.perf_counter()
    try:
        payloads = evaluate(
            sampler,
            problems,
            n=n,
            seed=seed,
            grade=graders,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            progress=progress,
        )
    finally:
        sampler.close()
    summary: dict[str, Any] = {
        "model": model,
        "resolved_model": path,
        "backend": resolved,
        "n": n,
        "seed": seed,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "seconds": time.perf_counter() - t0,
        "benchmarks": {name: p["summary"] for name, p in payloads.items()},
    }
    atomic_write_json(out_dir / "summary.json", summary)
    Console().print(summary_table(payloads, f"{model}: Avg@{n} / Pass@k (%), seed {seed}"))
    console.print(f"correctness matrices: {out_dir}")
    return summary
