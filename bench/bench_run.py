"""A sweep's quickstart-regime runs, before and after the speed work of docs/speed.md, side by side in one process.

    .venv/bin/python bench/bench_run.py [--steps N] [--rules grpo dapo] [--repeats R] [--quick]

What runs: `recipes/quickstart.yaml` (40 rollout steps of 16 prompts x 8 samples, 8 mini-batches x
3 epochs, evaluation of the 500 held-out problems x 8 at the start and the end) as a sweep's worker
runs it: `run_training` into a sweep directory (with its manifest), the hf sampler on the CPU, one
torch thread (what `clipbench sweep --jobs 2` gives each run on 2 cores), no MLflow. One sweep per
arm and repeat: the runs of `--rules` on seed 0, one after another. Two arms:

  before   the readable reference path (`reference_path()`): transformers' own SDPA attention
           (copies of the key/value heads), log-prob chunks of one sequence each, and every run
           evaluates its base model itself
  after    the product: SDPA with the shared key/value heads inside the kernel where no gradient is
           taken (models/attention.py), log-prob chunks of whole micro-batches (train/logprobs.py),
           the start's evaluation computed once per sweep and seed (train/shared_eval.py)

The arms alternate (before, after, before, after, ...), so both see the same background load of a
shared machine. Every run's numbers are compared across the arms: metrics.jsonl (all but time/*)
and every evaluation payload (all but its seconds) must be identical, bit for bit; the bench fails
otherwise.

Times per run (thread CPU seconds, which other processes on the machine barely move, and wall
seconds): setup (model, task, sampler), eval (start and end), sampling (the rollouts: generate and
rewards), update (every optimizer step), other (logging, checkpoints). Imports are timed apart, in a
fresh interpreter (`python -c "import ..."`, the modules a run imports, as a worker's first run
pays them): the same for both arms.

Writes results/bench/run.json and prints a table. Defaults: 2 rules x 40 steps x 2 arms, 1 repeat:
about 6 minutes of CPU; `--quick`: 8 steps, eval on 100 problems.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PARTS = ("setup", "evaluate_run", "collect_rollout", "update")  # train/loop.py's phases, timed
LABELS = {"setup": "setup", "evaluate_run": "eval", "collect_rollout": "sampling", "update": "update"}
IMPORTS = (
    "import clipbench.train.loop, clipbench.sweep.execute; "
    "from transformers import AutoModelForCausalLM, GenerationMixin"
)


# ----------------------------------------------------------------------------------------------
# The reference path


def one_sequence_chunks(b_size: int, t_size: int, rows: int):
    """train/logprobs.py's chunks before the speed work: one sequence (or part of one) per chunk."""
    for b in range(b_size):
        for t0 in range(0, t_size, rows):
            yield slice(b, b + 1), slice(t0, min(t0 + rows, t_size))


@contextlib.contextmanager
def reference_path():
    """The readable path the fast one must equal: transformers' SDPA attention, one sequence per
    log-prob chunk, no evaluation shared between runs."""
    import clipbench.models.load as load
    import clipbench.train.logprobs as logprobs
    import clipbench.train.loop as loop

    saved = load.use_fast_attention, logprobs._chunks, loop.start_eval_key
    load.use_fast_attention = lambda model: None
    logprobs._chunks = one_sequence_chunks
    loop.start_eval_key = lambda *a, **k: None
    try:
        yield
    finally:
        load.use_fast_attention, logprobs._chunks, loop.start_eval_key = saved


# ----------------------------------------------------------------------------------------------
# Timing one sweep


class PhaseClock:
    """Wraps train/loop.py's phases (module globals `run_training` calls) to add up their times."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    @contextlib.contextmanager
    def installed(self):
        import clipbench.train.loop as loop

        saved = {name: getattr(loop, name) for name in PARTS}
        for name, fn in saved.items():
            setattr(loop, name, self._timed(name, fn))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(loop, name, fn)

    def _timed(self, name, fn):
        def wrapper(*args, **kwargs):
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w

        return wrapper


def run_configs(recipe: Path, rules: list[str], overrides: list[str]) -> list:
    from clipbench.config.load import load_run_config

    base = ["sampler.backend=hf", "model.device=cpu", "tracking.mlflow=false", *overrides]
    return [load_run_config(recipe, [*base, f"objective.method={rule}"]) for rule in rules]


def run_sweep(configs: list, sweep_dir: Path, *, reference: bool) -> list[dict]:
    """Train `configs` one after another into `sweep_dir` (a sweep directory: manifest.json beside
    the runs, as `clipbench sweep` leaves it). Returns per run: its id, times and numbers."""
    import torch

    from clipbench.config import run_id
    from clipbench.tracking.sink import NullSink
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "manifest.json").write_text(json.dumps({"runs": {run_id(c): {} for c in configs}}))
    torch.set_num_threads(1)
    out = []
    for cfg in configs:
        rid = run_id(cfg)
        clock = PhaseClock()
        with clock.installed(), reference_path() if reference else contextlib.nullcontext():
            c, w = time.thread_time(), time.perf_counter()
            run_training(cfg, sweep_dir / rid, sink=NullSink())
            total_cpu, total_wall = time.thread_time() - c, time.perf_counter() - w
        out.append(
            {
                "run_id": rid,
                "rule": cfg.objective.name,
                "cpu": split(clock.cpu, total_cpu),
                "wall": split(clock.wall, total_wall),
                "numbers": run_numbers(RunDir(sweep_dir / rid)),
            }
        )
    return out


def split(parts: dict[str, float], total: float) -> dict[str, float]:
    named = {LABELS[k]: round(parts.get(k, 0.0), 3) for k in PARTS}
    return {**named, "other": round(total - sum(parts.values()), 3), "total": round(total, 3)}


def run_numbers(rd) -> dict:
    """What must not change: every metric but the wall-clock ones, every evaluation but its seconds."""
    metrics = [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rd.read_metrics()]
    evals = {
        step: {b: {k: v for k, v in p.items() if k != "seconds"} for b, p in d.items()}
        for step, d in rd.read_evals().items()
    }
    return {"metrics": metrics, "evals": evals}


def import_seconds() -> float:
    """Wall seconds of a fresh interpreter importing what a run imports (and nothing else)."""
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", IMPORTS],
        check=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    return time.perf_counter() - t


# ----------------------------------------------------------------------------------------------
# Main


def mean_split(runs: list[dict], kind: str) -> dict[str, float]:
    keys = runs[0][kind].keys()
    return {k: round(statistics.mean(r[kind][k] for r in runs), 3) for k in keys}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "quickstart.yaml")
    ap.add_argument("--rules", nargs="+", default=["grpo", "dapo"])
    ap.add_argument("--steps", type=int, default=None, help="rollout steps per run (default: the recipe's)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="8 steps, evaluation on 100 problems")
    ap.add_argument("--override", action="append", default=[], help="more run-config overrides (key=value)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "run.json")
    a = ap.parse_args(argv)
    over = list(a.override)
    if a.quick:
        over += ["train.steps=8", "eval.limit=100"]
    if a.steps:
        over.append(f"train.steps={a.steps}")
    configs = run_configs(a.recipe, a.rules, over)
    exec(IMPORTS)  # paid once here, before either arm: imports are timed apart (import_seconds)
    arms: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for arm in arms:
                arms[arm] += run_sweep(configs, Path(tmp) / f"{arm}{r}" / "bench", reference=arm == "before")
    identical = all(b["numbers"] == f["numbers"] for b, f in zip(arms["before"], arms["after"]))
    imports = [import_seconds() for _ in range(2)]
    result = {
        "recipe": str(a.recipe.relative_to(REPO)) if a.recipe.is_relative_to(REPO) else str(a.recipe),
        "overrides": over,
        "rules": a.rules,
        "repeats": a.repeats,
        "machine": platform.processor() or platform.machine(),
        "identical_numbers": identical,
        "imports_wall_s": round(min(imports), 2),
        **{
            arm: {
                "cpu": mean_split(runs, "cpu"),
                "wall": mean_split(runs, "wall"),
                "runs": [{k: v for k, v in r.items() if k != "numbers"} for r in runs],
            }
            for arm, runs in arms.items()
        },
    }
    result["speedup"] = {
        kind: round(result["before"][kind]["total"] / result["after"][kind]["total"], 3) for kind in ("cpu", "wall")
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    if not identical:
        raise SystemExit("bench_run: the fast path's numbers differ from the reference path's")
    return result


def print_table(res: dict) -> None:
    cols = ["setup", "eval", "sampling", "update", "other", "total"]
    print(f"per run (mean of {len(res['before']['runs'])}; rules {', '.join(res['rules'])}; {res['overrides']})")
    print(f"{'':14}" + "".join(f"{c:>10}" for c in cols))
    for kind in ("cpu", "wall"):
        for arm in ("before", "after"):
            print(f"{arm + ' ' + kind:14}" + "".join(f"{res[arm][kind][c]:>10.2f}" for c in cols))
    print(
        f"speedup (before / after): cpu {res['speedup']['cpu']:.2f}x  wall {res['speedup']['wall']:.2f}x;  "
        f"imports (fresh interpreter, wall, both arms): {res['imports_wall_s']:.1f} s;  "
        f"numbers identical: {res['identical_numbers']}"
    )


if __name__ == "__main__":
    main()
