"""A whole organism run, timed as a process: the readable path against the product, bit for bit.

    .venv/bin/python bench/bench_organism.py [--steps N] [--repeats R] [--out results/bench/organism.json]

What runs: `recipes/organism.yaml` as shipped (150 rollout steps of 16 prompts x 8, 8 mini-batches,
evaluation of 200 + 200 held-out problems at n = 64 at the start and the end and n = 8 every 50
steps), grpo, seed 0, the hf sampler on the CPU, one torch thread, no MLflow: one process per run
(`--child`), as a sweep's worker trains it, into a fresh directory (the run evaluates its start
itself). Two arms, alternating (before, after, before, ...), so both see the same background load:

  before   the readable path: transformers' `generate` for every sampling call, one call per
           evaluation batch of 16 problems
  after    the product: the sampler's own decode loop (rollout/decode.py) and evaluation calls of
           several batches (eval/evaluate.py), where they give the same numbers bit for bit

Reported per arm: the child process's CPU seconds (user + sys, from the kernel: what the run cost,
imports and set-up included, whatever else the machine runs), its wall seconds, and the CPU seconds
of the run's phases (set-up, evaluation, rollout sampling, update, the rest; thread CPU time inside
the child). Every run's metrics (all but `time/*`) and evaluations (all but their `seconds`) must be
identical across the arms; the bench fails otherwise. Target: after / before <= 0.4 of the CPU time.

Writes results/bench/organism.json and prints a table. One repeat of the full recipe is about 5
minutes of CPU; `--steps 20` is a quick look (its evaluations are a larger share of the run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

TARGET = 0.4  # after / before, process CPU seconds


@contextlib.contextmanager
def readable_path():
    """transformers' generate for every sampling call, one evaluation call per batch of problems."""
    from clipbench.rollout.hf import HFSampler

    saved = HFSampler.own_loop
    HFSampler.own_loop = False  # generate_calls then samples each call on its own
    try:
        yield
    finally:
        HFSampler.own_loop = saved


def child(arm: str, out: Path, overrides: list[str]) -> None:
    """One run in this process (one thread), its phases' CPU seconds and numbers to `out`."""
    import torch
    from bench_run import PhaseClock, run_configs, run_numbers, split

    from clipbench.config import run_id
    from clipbench.tracking.sink import NullSink
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    torch.set_num_threads(1)
    (cfg,) = run_configs(REPO / "recipes" / "organism.yaml", ["grpo"], overrides)
    with tempfile.TemporaryDirectory() as tmp:
        rd = Path(tmp) / run_id(cfg)
        clock = PhaseClock()
        with clock.installed(), readable_path() if arm == "before" else contextlib.nullcontext():
            c = time.thread_time()
            run_training(cfg, rd, sink=NullSink())
            total = time.thread_time() - c
        result = {"run_id": run_id(cfg), "phases": split(clock.cpu, total), "numbers": run_numbers(RunDir(rd))}
    out.write_text(json.dumps(result))


def timed_child(arm: str, overrides: list[str]) -> dict:
    """Run `arm` in a fresh process; its CPU seconds (user + sys) and wall seconds, and what it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--child", arm, str(out), *[f"--override={o}" for o in overrides]]
        w = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - w
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"bench_organism: the {arm} run failed:\n{proc.stderr.read().decode()[-2000:]}")
        proc.stderr.close()
        result = json.loads(out.read_text())
    return {**result, "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "wall_s": round(wall, 2)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="rollout steps (default: the recipe's 150)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--override", action="append", default=[], help="more run-config overrides (key=value)")
    ap.add_argument("--child", nargs=2, metavar=("ARM", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "organism.json")
    a = ap.parse_args(argv)
    over = list(a.override) + ([f"train.steps={a.steps}"] if a.steps else [])
    if a.child:
        child(a.child[0], Path(a.child[1]), over)
        return {}
    arms: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(a.repeats):
        for arm in arms:
            arms[arm].append(timed_child(arm, over))
    identical = all(b["numbers"] == f["numbers"] for b, f in zip(arms["before"], arms["after"]))
    summary = {
        arm: {
            "cpu_s": round(statistics.mean(r["cpu_s"] for r in runs), 2),
            "wall_s": round(statistics.mean(r["wall_s"] for r in runs), 2),
            "phases_cpu_s": {k: round(statistics.mean(r["phases"][k] for r in runs), 2) for k in runs[0]["phases"]},
            "runs": [{k: v for k, v in r.items() if k != "numbers"} for r in runs],
        }
        for arm, runs in arms.items()
    }
    ratio = summary["after"]["cpu_s"] / summary["before"]["cpu_s"]
    result = {
        "recipe": "recipes/organism.yaml",
        "rule": "grpo",
        "overrides": over,
        "repeats": a.repeats,
        "machine": platform.processor() or platform.machine(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "identical_numbers": identical,
        **summary,
        "cpu_ratio": round(ratio, 3),
        "target": TARGET,
        "met": ratio <= TARGET,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    if not identical:
        raise SystemExit("bench_organism: the product's numbers differ from the readable path's")
    return result


def print_table(res: dict) -> None:
    cols = list(res["before"]["phases_cpu_s"])
    print(f"organism run (grpo, seed 0, one thread; {res['overrides'] or 'as shipped'}), mean of {res['repeats']}")
    print(f"{'':8}{'process cpu':>12}{'wall':>8}" + "".join(f"{c:>10}" for c in cols))
    for arm in ("before", "after"):
        r = res[arm]
        print(
            f"{arm:8}{r['cpu_s']:>12.1f}{r['wall_s']:>8.1f}" + "".join(f"{r['phases_cpu_s'][c]:>10.2f}" for c in cols)
        )
    verdict = "met" if res["met"] else "NOT met"
    print(
        f"after / before: {res['cpu_ratio']:.3f} of the CPU time (target <= {res['target']}: {verdict}); "
        f"numbers identical: {res['identical_numbers']}; load average {res['load_avg_1min']}"
    )


if __name__ == "__main__":
    main()
