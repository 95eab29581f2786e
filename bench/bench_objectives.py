"""Benchmark of the clip objectives and of the chunked log-probs (run by `make bench`).

    .venv/bin/python bench/bench_objectives.py [--quick] [--out results/bench/objectives.json]

1. Objective + diagnostics vs a training step. Target: for every registered rule, ``policy_loss``
   forward + backward (the rule, aggregation, and every diagnostic the trainer logs: the rule's
   per-token gradient by autograd, quadrant counts, gradient mass, ratio statistics) costs
   <= 2% of the forward + backward of a Qwen3-0.6B-shaped model on the same tokens (B=1, T=1024),
   measured on CPU side by side in one process.
   How the model is measured: the real Qwen3 architecture (transformers' Qwen3ForCausalLM, the
   0.6B shape: hidden 1024, MLP 3072, 16/8 heads of 128, vocab 151,936, tied embeddings; random
   weights) with 1 and 3 decoder layers instead of 28 (a 28-layer step takes minutes on one CPU
   thread and ~10 GB): the step is forward, chunked log-probs of the T tokens
   (clipbench.train.logprobs), backward. The decoder layers are identical, so the step time is
   linear in the layer count: one layer costs (t3 - t1) / 2 and the 28-layer step is
   t1 + 27 (t3 - t1) / 2 (embedding, final norm and the full vocabulary head counted once, at
   their real size). The ratio per rule is its median time over that estimate. One shape, B=1:
   the objective's fixed per-call cost is amortised least there, so the ratio is conservative.
   torch runs on one thread; medians of thread CPU time (``time.thread_time``: robust to a
   machine shared with other jobs), rules interleaved within every repeat.
   The process is re-executed with glibc's malloc told to reuse freed blocks
   (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_), so that timings measure compute and not
   the page faults of fresh mmaps.

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

TARGET_SHARE = 0.02  # objective + diagnostics <= 2% of a training step
TARGET_MEMORY = 1.3

QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
)
QWEN3_06B_LAYERS = 28


# --------------------------------------------------------------------------------------------
# 1. Objective + diagnostics vs a training step
# --------------------------------------------------------------------------------------------
def make_batch(B: int, T: int, seed: int = 0):
    """A realistic off-policy mini-batch: log-ratios ~ N(0, 0.15) (a few % of tokens clipped),
    1 in 8 sequences with A == 0, ragged lengths T/4..T (all of T when B == 1)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + torch.randn(B, T, generator=g) * 0.15
    A = torch.randn(B, generator=g)
    A[1::8] = 0.0
    lens = torch.randint(T // 4, T + 1, (B,), generator=g) if B > 1 else torch.full((B,), T)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    return logp, old, A, mask


def time_objectives(B: int, T: int, repeats: int) -> dict:
    logp0, old, A, mask = make_batch(B, T)
    u = torch.rand(B, T, generator=torch.Generator().manual_seed(1))
    # the inputs some rules read: each sequence's reward (topr), the token entropy (aspo), the sampler's
    # log-probs (rollout_is: old_logp, as with sampler.old_logp: sampler); a rule's mini-batch
    # statistic (bapo, m2po) is computed by the call itself (the unsplit step's cost)
    extra = {
        "rewards": (A > 0).float(),
        "entropy": torch.rand(B, T, generator=torch.Generator().manual_seed(3)),
        "sampler_logp": old,
    }
    methods = list(METHODS)

    def once(method):
        logp = logp0.clone().requires_grad_(True)
        t = time.thread_time()
        out = policy_loss(method, logp, old, A, mask, uniforms=u, **extra)
        out.loss.backward()
        return time.thread_time() - t

    for m in methods:  # warm-up
        once(m), once(m)
    cpu = {m: [] for m in methods}
    for rep in range(repeats):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:
            cpu[m].append(once(m))
    return {m: 1e3 * statistics.median(v) for m, v in cpu.items()}


def time_model_step(layers: int, T: int, repeats: int) -> float:
    """Median ms of forward + chunked log-probs + backward of a Qwen3-0.6B-shaped model with
    ``layers`` decoder layers on one sequence of T tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, **QWEN3_06B)).train()
    ids = torch.randint(0, QWEN3_06B["vocab_size"], (1, T + 1), generator=torch.Generator().manual_seed(2))

    def once():
        model.zero_grad(set_to_none=True)
        t = time.thread_time()
        logits = model(input_ids=ids[:, :-1]).logits  # (1, T, V)
        logp = selective_log_softmax(logits, ids[:, 1:])  # (1, T)
        logp.sum().backward()
        return time.thread_time() - t

    once()  # warm-up
    return 1e3 * statistics.median(once() for _ in range(repeats))  # the model is freed with this frame


def measure_share(T: int, obj_repeats: int, model_repeats: int) -> dict:
    t1 = time_model_step(1, T, model_repeats)
    t3 = time_model_step(3, T, model_repeats)
    per_layer = (t3 - t1) / 2
    step = t1 + (QWEN3_06B_LAYERS - 1) * per_layer
    rules = time_objectives(1, T, obj_repeats)
    rows = {
        m: {"objective_ms": ms, "share_of_step": ms / step, "meets_target": ms / step <= TARGET_SHARE}
        for m, ms in rules.items()
    }
    return {
        "B": 1,
        "T": T,
        "model": {
            "layers_1_ms": t1,
            "layers_3_ms": t3,
            "per_layer_ms": per_layer,
            "step_28_layers_ms": step,
            "shape": QWEN3_06B,
            "repeats": model_repeats,
        },
        "objective_repeats": obj_repeats,
        "rules": rows,
    }


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
            row = {"vocab": V, "dtype": str(dtype).replace("torch.", ""), "B": B, "T": T, "logits_MiB": size / 2**20}
            for name, path in (("naive", naive_path), ("chunked", chunked_path)):
                for backward in (False, True):
                    logits.grad = None
                    t = time.perf_counter()
                    peak = peak_bytes(lambda: path(logits, idx, backward))
                    key = f"{name}_{'fwd_bwd' if backward else 'fwd'}"
                    row[f"{key}_peak_MiB"] = peak / 2**20
                    row[f"{key}_vs_logits"] = peak / size
                    row[f"{key}_s"] = time.perf_counter() - t
            row["meets_target"] = row["chunked_fwd_bwd_vs_logits"] <= TARGET_MEMORY
            out.append(row)
            logits = None  # free the (B, T, V) tensor before the next vocabulary's
    return out


# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller memory cases")
    ap.add_argument("--out", default="results/bench/objectives.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    console = Console()

    T = 256 if args.quick else 1024
    share = measure_share(T, obj_repeats=10 if args.quick else 40, model_repeats=1 if args.quick else 3)
    mdl = share["model"]
    console.print(
        f"Qwen3-0.6B-shaped step (forward + log-probs + backward), B=1 T={T}, 1 thread: "
        f"1 layer {mdl['layers_1_ms']:.0f} ms, 3 layers {mdl['layers_3_ms']:.0f} ms -> "
        f"{mdl['per_layer_ms']:.0f} ms per layer, 28 layers ~ {mdl['step_28_layers_ms'] / 1e3:.1f} s"
    )
    t = Table(title=f"policy_loss forward + backward with diagnostics vs that step (B=1, T={T})")
    for col in ("rule", "CPU ms", "share of step", f"<= {TARGET_SHARE:.0%}"):
        t.add_column(col, justify="right")
    for m, r in share["rules"].items():
        t.add_row(m, f"{r['objective_ms']:.2f}", f"{r['share_of_step']:.3%}", "yes" if r["meets_target"] else "NO")
    console.print(t)

    if args.quick:
        vocabs, rows_for = (32_000, 151_000), (lambda V: (2, 256) if V < 100_000 else (1, 128))
    else:
        vocabs, rows_for = (32_000, 151_000), (lambda V: (8, 256) if V < 100_000 else (4, 112))
    memory = measure_memory(vocabs, rows_for, (torch.float32, torch.bfloat16))
    t = Table(title="log-probs + entropy: peak extra allocation / size of the logits tensor")
    for col in (
        "vocab",
        "dtype",
        "logits MiB",
        "naive fwd",
        "naive fwd+bwd",
        "chunked fwd",
        "chunked fwd+bwd",
        f"<= {TARGET_MEMORY}x",
    ):
        t.add_column(col, justify="right")
    for r in memory:
        t.add_row(
            str(r["vocab"]),
            r["dtype"],
            f"{r['logits_MiB']:.0f}",
            f"{r['naive_fwd_vs_logits']:.2f}x",
            f"{r['naive_fwd_bwd_vs_logits']:.2f}x",
            f"{r['chunked_fwd_vs_logits']:.3f}x",
            f"{r['chunked_fwd_bwd_vs_logits']:.2f}x",
            "yes" if r["meets_target"] else "NO",
        )
    console.print(t)

    result = {
        "objective_vs_step": share,
        "memory": memory,
        "targets": {"objective_share_of_step": TARGET_SHARE, "memory_vs_logits": TARGET_MEMORY},
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": 1,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "quick": args.quick,
            "malloc_env": _MALLOC_ENV,
            "loadavg": os.getloadavg(),
        },
        "method": {
            "speed": "median thread CPU time (time.thread_time); rules interleaved; the 28-layer step "
            "estimated as t1 + 27 * (t3 - t1) / 2 from 1- and 3-layer models",
            "memory": "torch.profiler profile_memory: max 'Total Allocated' over allocator events "
            "minus the value before the call",
        },
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
