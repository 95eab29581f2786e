"""Sweep speed targets (`make bench`): writes results/bench/sweep.json and prints a table.

1. Expanding a 10,000-run grid into validated, resolved run configs with ids (target <= 1 s).
2. Loading 1,000 finished runs' metrics (40 steps x 4 mini-batches = 160 rows x 57 columns each)
   from the results store into one DataFrame (target <= 2 s): with the sweep's parse cache (what a
   report sees after the first load), without it (a full Arrow JSON parse), and the line-by-line
   reader (read_jsonl + DataFrame) as the reference point.

Each figure is the median of `--repeat` timings after one warm-up (imports and the page cache are
warm; import time is reported separately).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GRID = {  # 2 x 10 x 5 x 10 x 10 = 10,000 runs, every objective axis applicable
    "objective.method": ["nsr", "decay"],
    "objective.p": [round(0.1 * i, 1) for i in range(1, 11)],
    "objective.delta": [0.05, 0.1, 0.2, 0.3, 0.4],
    "train.lr": [1e-6 * (i + 1) for i in range(10)],
    "seed": list(range(10)),
}
CELLS = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
COUNTS = ("tokens", "out_of_band", "zero_grad", "rescued", "in_band_near")


def timed(fn, repeat: int) -> tuple[float, list[float], object]:
    out = fn()  # warm-up
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts, out


def bench_expand(tmp: Path, repeat: int) -> dict:
    import yaml

    t0 = time.perf_counter()
    import clipbench.objectives  # noqa: F401  (torch)
    from clipbench.sweep import expand, load_spec

    t_import = time.perf_counter() - t0
    f = tmp / "grid10k.yaml"
    f.write_text(yaml.safe_dump({"name": "grid10k", "base": str(REPO / "recipes" / "quickstart.yaml"), "grid": GRID}))
    med, ts, exp = timed(lambda: expand(load_spec(f)), repeat)
    return {"runs": len(exp.runs), "seconds": med, "all": ts, "import_seconds": t_import, "target_seconds": 1.0}


def metrics_row(rng, step: int, opt: int) -> dict:
    row = {
        "step": step,
        "opt_step": opt,
        "epoch": 0,
        "mini_batch": (opt - 1) % 4,
        "reward/mean": rng.random(),
        "reward/std": rng.random(),
        "accuracy": rng.random(),
        "accuracy/sampled": rng.random(),
        "response_length/mean": 20 * rng.random(),
        "truncated_frac": 0.0,
        "zero_var_groups_frac": rng.random(),
        "groups_kept": 8,
        "time/sample": rng.random(),
        "time/score": rng.random(),
        "entropy": rng.random(),
        "loss": rng.normal(),
        "grad_norm": rng.random(),
        "lr": 2e-4,
        "skipped_nonfinite": 0,
        "old_logp_source": 0,
    }
    for c in CELLS:
        for k in COUNTS:
            row[f"{c}/{k}"] = float(rng.integers(0, 500))
    row.update(
        {
            "ratio/mean": 1 + 0.01 * rng.normal(),
            "ratio/min": 0.8,
            "ratio/max": 1.3,
            "approx_kl": 1e-3 * rng.random(),
            "clip_events": float(rng.integers(0, 50)),
            "time/update": rng.random(),
        }
    )
    return row


def bench_load(tmp: Path, n_runs: int, steps: int, mini_batches: int, repeat: int) -> dict:
    import numpy as np
    import pandas as pd

    from clipbench.tracking.files import read_jsonl
    from clipbench.tracking.metrics_table import load_sweep_metrics
    from clipbench.tracking.store import RunDir, list_run_dirs

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for i in range(n_runs):
        rd = RunDir(tmp / "sw" / f"{i:012x}")
        rd.write_config({"seed": i})
        rows = [metrics_row(rng, s, s * mini_batches + m + 1) for s in range(steps) for m in range(mini_batches)]
        rd.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        rd.set_status("finished")
    t_write = time.perf_counter() - t0

    cold, ts_cold, df = timed(lambda: load_sweep_metrics(tmp, "sw", cache=False), repeat)
    t0 = time.perf_counter()
    load_sweep_metrics(tmp, "sw")  # parses everything once more and writes <sweep>/.cache/
    first = time.perf_counter() - t0
    med, ts, dfc = timed(lambda: load_sweep_metrics(tmp, "sw"), repeat)
    import pandas.testing as pdt

    pdt.assert_frame_equal(df, dfc)

    def naive():
        frames = []
        for rd in list_run_dirs(tmp / "sw"):
            part = pd.DataFrame(read_jsonl(rd.metrics_path))
            part.insert(0, "run_id", rd.run_id)
            frames.append(part)
        return pd.concat(frames, ignore_index=True)

    med_naive, ts_naive, df2 = timed(naive, max(1, repeat // 2))
    assert len(df) == len(df2) == n_runs * steps * mini_batches
    assert list(df.columns) == list(df2.columns)
    return {
        "runs": n_runs,
        "rows": len(df),
        "columns": df.shape[1],
        "seconds": med,
        "all": ts,
        "uncached_seconds": cold,
        "uncached_all": ts_cold,
        "first_load_with_cache_write_seconds": first,
        "line_reader_seconds": med_naive,
        "write_seconds": t_write,
        "target_seconds": 2.0,
        "bytes": sum(p.stat().st_size for p in (tmp / "sw").glob("*/metrics.jsonl")),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=40, help="rollout steps per run (quickstart: 40)")
    ap.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per rollout step (quickstart: 4)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "sweep.json")
    a = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="clipbench-bench-sweep-") as d:
        tmp = Path(d)
        expand_res = bench_expand(tmp, a.repeat)
        load_res = bench_load(tmp, a.runs, a.steps, a.mini_batches, a.repeat)

    result = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "expand_10k": expand_res,
        "load_1k_runs": load_res,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"bench_sweep ({os.cpu_count()} CPUs) -> {a.out}", title_justify="left")
    for col in ("what", "size", "median", "target", "ok", "note"):
        t.add_column(col)
    e, ld = expand_res, load_res
    t.add_row(
        "expand grid",
        f"{e['runs']:,} runs",
        f"{e['seconds']:.3f} s",
        "<= 1 s",
        "yes" if e["seconds"] <= 1 else "NO",
        f"imports (torch) {e['import_seconds']:.1f} s, once",
    )
    size = f"{ld['runs']:,} runs, {ld['rows']:,} rows x {ld['columns']}"
    t.add_row(
        "load metrics (cached)",
        size,
        f"{ld['seconds']:.3f} s",
        "<= 2 s",
        "yes" if ld["seconds"] <= 2 else "NO",
        "unchanged runs come from <sweep>/.cache",
    )
    t.add_row(
        "load metrics (no cache)",
        size,
        f"{ld['uncached_seconds']:.3f} s",
        "",
        "",
        f"Arrow JSON parse of {ld['bytes'] / 2**20:.0f} MiB; line reader {ld['line_reader_seconds']:.2f} s",
    )
    Console(width=max(Console().width, 110)).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
