"""Benchmark of the clip objectives and of the chunked log-probs (run by `make bench`).

    .venv/bin/python bench/bench_objectives.py [--quick] [--out results/bench/objectives.json]

1. Speed: forward + backward of ``policy_loss`` (rule, aggregation, KL off, and the per-step
   diagnostics the trainer logs) for every method on B=64, T=2048, side by side in one process.
   Methods are interleaved within every repeat (rotating the order) so that drift and noise
   from other processes hit all of them alike; we report the median over 150 repeats of the
   thread CPU time (``time.thread_time``: robust to a machine shared with other jobs) and of
   the wall time, relative to ``grpo``. Target: every method <= 1.10x grpo.
   torch runs on one thread (element-wise kernels of this size do not scale on a shared
   machine), and the process is re-executed with glibc's malloc told to reuse freed blocks
   (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_), so that the timings measure compute and not
   the page faults of fresh 512 KiB mmaps (which inflate every method by ~1 ms).

2. Memory: peak allocation of log-probs + entropy (forward, and forward + backward to the
   logits) of the chunked path (clipbench.train.logprobs) versus the naive
   ``log_softmax(logits.float())`` path, at vocabularies of 32k and 151k, relative to the size
   of the logits tensor. Target: <= 1.3x the logits. Measured with torch's profiler
   (``profile_memory=True``): every CPU allocator alloc/free event carries the allocator's
   running "Total Allocated"; the peak is its maximum minus the value before the measured call,
   i.e. the real high-water mark of tensor allocations (the logits themselves excluded).
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

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in _MALLOC_ENV.items()):
    os.environ.update(_MALLOC_ENV)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clipbench.objectives import METHODS, policy_loss  # noqa: E402
from clipbench.train.logprobs import entropy_from_logits, selective_log_softmax  # noqa: E402

TARGET_SPEED = 1.10
TARGET_MEMORY = 1.3


# --------------------------------------------------------------------------------------------
# 1. Speed of the objectives
# --------------------------------------------------------------------------------------------
def make_batch(B: int, T: int, seed: int = 0):
    """A realistic off-policy mini-batch: log-ratios ~ N(0, 0.15) (a few % of tokens clipped),
    1 in 8 sequences with A == 0, ragged lengths T/4..T."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + torch.randn(B, T, generator=g) * 0.15
    A = torch.randn(B, generator=g)
    A[::8] = 0.0
    lens = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    return logp, old, A, mask


def time_objectives(B: int, T: int, repeats: int) -> dict:
    logp0, old, A, mask = make_batch(B, T)
    gen = torch.Generator().manual_seed(1)
    methods = list(METHODS)

    def once(method):
        logp = logp0.clone().requires_grad_(True)
        t_cpu, t_wall = time.thread_time(), time.perf_counter()
        out = policy_loss(method, logp, old, A, mask, generator=gen)
        out.loss.backward()
        return time.thread_time() - t_cpu, time.perf_counter() - t_wall

    for m in methods:  # warm-up
        once(m), once(m)
    cpu = {m: [] for m in methods}
    wall = {m: [] for m in methods}
    for rep in range(repeats):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:
            c, w = once(m)
            cpu[m].append(c)
            wall[m].append(w)
    med_cpu = {m: statistics.median(v) for m, v in cpu.items()}
    med_wall = {m: statistics.median(v) for m, v in wall.items()}
    rows = {}
    for m in methods:
        rows[m] = {
            "cpu_ms": 1e3 * med_cpu[m], "cpu_vs_grpo": med_cpu[m] / med_cpu["grpo"],
            "wall_ms": 1e3 * med_wall[m], "wall_vs_grpo": med_wall[m] / med_wall["grpo"],
            "cpu_ms_min": 1e3 * min(cpu[m]),
        }
        rows[m]["meets_target"] = rows[m]["cpu_vs_grpo"] <= TARGET_SPEED
    return {"B": B, "T": T, "repeats": repeats, "methods": rows}


# --------------------------------------------------------------------------------------------
# 2. Peak memory of log-probs + entropy
# --------------------------------------------------------------------------------------------
def peak_bytes(fn) -> int:
    """High-water mark of CPU tensor allocations during fn(), from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    mem = [e["args"] for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0]
    if not mem:
        return 0
    start = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    return max(a["Total Allocated"] for a in mem) - start


def naive_path(logits, idx, backward: bool):
    lp = torch.log_softmax(logits.float(), -1)
    logp = lp.gather(-1, idx[..., None]).squeeze(-1)
    with torch.no_grad():
        z = logits.detach().float()
        ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    del lp
    if backward:
        logp.sum().backward()
    return logp, ent


def chunked_path(logits, idx, backward: bool):
    logp = selective_log_softmax(logits, idx)
    ent = entropy_from_logits(logits.detach())
    if backward:
        logp.sum().backward()
    return logp, ent


def measure_memory(vocabs, rows_for, dtypes) -> list[dict]:
    out = []
    for V in vocabs:
        for dtype in dtypes:
            B, T = rows_for(V)
            g = torch.Generator().manual_seed(V)
            logits = torch.randn(B, T, V, generator=g).to(dtype).requires_grad_(True)
            idx = torch.randint(0, V, (B, T), generator=g)
            size = logits.numel() * logits.element_size()
            row = {"vocab": V, "dtype": str(dtype).replace("torch.", ""), "B": B, "T": T,
                   "logits_MiB": size / 2 ** 20}
            for name, path in (("naive", naive_path), ("chunked", chunked_path)):
                for backward in (False, True):
                    logits.grad = None
                    t = time.perf_counter()
                    peak = peak_bytes(lambda: path(logits, idx, backward))
                    key = f"{name}_{'fwd_bwd' if backward else 'fwd'}"
                    row[f"{key}_peak_MiB"] = peak / 2 ** 20
                    row[f"{key}_vs_logits"] = peak / size
                    row[f"{key}_s"] = time.perf_counter() - t
            row["meets_target"] = row["chunked_fwd_bwd_vs_logits"] <= TARGET_MEMORY
            out.append(row)
            del logits
    return out


# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller memory cases")
    ap.add_argument("--out", default="results/bench/objectives.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    console = Console()

    repeats = 30 if args.quick else 150  # interleaved repeats; the median is stable to ~1% at 150
    speed = time_objectives(64, 2048, repeats)
    t = Table(title=f"policy_loss forward+backward, B=64 T=2048, median of {repeats} (1 thread)")
    for col in ("method", "CPU ms", "vs grpo", "wall ms", "vs grpo (wall)", f"<= {TARGET_SPEED}x"):
        t.add_column(col, justify="right")
    for m, r in speed["methods"].items():
        t.add_row(m, f"{r['cpu_ms']:.2f}", f"{r['cpu_vs_grpo']:.3f}", f"{r['wall_ms']:.2f}",
                  f"{r['wall_vs_grpo']:.3f}", "yes" if r["meets_target"] else "NO")
    console.print(t)

    if args.quick:
        vocabs, rows_for = (32_000, 151_000), (lambda V: (2, 256) if V < 100_000 else (1, 128))
    else:
        vocabs, rows_for = (32_000, 151_000), (lambda V: (8, 256) if V < 100_000 else (4, 112))
    memory = measure_memory(vocabs, rows_for, (torch.float32, torch.bfloat16))
    t = Table(title="log-probs + entropy: peak extra allocation / size of the logits tensor")
    for col in ("vocab", "dtype", "logits MiB", "naive fwd", "naive fwd+bwd", "chunked fwd", "chunked fwd+bwd",
                f"<= {TARGET_MEMORY}x"):
        t.add_column(col, justify="right")
    for r in memory:
        t.add_row(str(r["vocab"]), r["dtype"], f"{r['logits_MiB']:.0f}", f"{r['naive_fwd_vs_logits']:.2f}x",
                  f"{r['naive_fwd_bwd_vs_logits']:.2f}x", f"{r['chunked_fwd_vs_logits']:.3f}x",
                  f"{r['chunked_fwd_bwd_vs_logits']:.2f}x", "yes" if r["meets_target"] else "NO")
    console.print(t)

    result = {
        "speed": speed, "memory": memory,
        "targets": {"speed_vs_grpo": TARGET_SPEED, "memory_vs_logits": TARGET_MEMORY},
        "env": {"torch": torch.__version__, "python": platform.python_version(), "threads": 1,
                "machine": platform.machine(), "cpus": os.cpu_count(), "quick": args.quick,
                "malloc_env": _MALLOC_ENV, "loadavg": os.getloadavg()},
        "method": {"speed": "median thread CPU time (time.thread_time) over interleaved repeats",
                   "memory": "torch.profiler profile_memory: max 'Total Allocated' over allocator events "
                             "minus the value before the call"},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
