"""Micro-batching: its time overhead at equal tokens and its peak memory as the mini-batch grows.

    .venv/bin/python bench/bench_step.py [--reps N] [--quick] [--out results/bench/step.json]

The workload is one optimizer step of the built-in loop's own functions (clipbench/train/step.py:
`plan_update`, `frozen_logprobs` for the old log-probs, `accumulate_gradients` with grpo + token-mean,
`optimizer_step` with AdamW), on a randomly initialised Qwen3-shaped model (4 layers, hidden 256,
8 heads / 4 KV heads, vocab 4096: 13M parameters) and rows of 32 prompt + 224 completion tokens
(256 per row: long enough that the step is compute, not Python overhead), float32, CPU, 1 thread.

1. Overhead at equal tokens. One mini-batch of 32 rows (8,192 tokens) as one forward/backward
   (`train.micro_batch_tokens` 0) vs 4 micro-batches of 8 rows (budget 2,048 tokens); the gradient is
   the same (tests/test_microbatch.py), so the ratio is the cost of splitting. Arms alternate (A B A B
   ...) in one process; medians of `--reps` steps each. Target <= 1.05x.
2. Peak memory as the mini-batch grows 4x at a fixed micro-batch budget (2,048 tokens): 8 rows vs 32
   rows. Each arm runs in a fresh subprocess (peak resident memory is a high-water mark a process
   never lowers); the figure is the peak RSS of the process over the step (VmHWM), and, the
   informative part, its growth over the same process's RSS after building the model and optimizer
   state and one warm-up step at 8 rows. Target: total peak <= 1.1x. The children run with glibc's
   mmap threshold fixed (`MALLOC_ENV`), so that the peak counts live memory, not the allocator's history. For reference, the 32 rows
   without micro-batching (one forward/backward over all of them).

Writes results/bench/step.json and prints a small table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPT, COMPLETION, BUDGET = 32, 224, 2048
SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=4096,
)


def build_model(seed: int = 0):
    """(model, AdamW, constant scheduler): the random Qwen3-shaped policy."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, max_position_embeddings=512, tie_word_embeddings=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def build_batch(rows: int, seed: int = 0):
    """(packed batch, advantages (rows,)) of random tokens."""
    import torch

    from clipbench.train.packing import pack

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, SHAPE["vocab_size"], (rows, PROMPT), generator=gen).tolist()
    completions = torch.randint(5, SHAPE["vocab_size"], (rows, COMPLETION), generator=gen).tolist()
    return pack(prompts, completions, pad_id=0), torch.randn(rows, generator=gen)


def one_step(model, opt, sched, batch, adv, budget: int) -> float:
    """Seconds of one optimizer step (old log-probs, loss over micro-batches, AdamW)."""
    import torch

    from clipbench.objectives import METHODS
    from clipbench.train.distributed import Dist
    from clipbench.train.step import (
        Objective,
        StepInputs,
        accumulate_gradients,
        frozen_logprobs,
        optimizer_step,
        plan_update,
    )

    dist = Dist()
    t0 = time.perf_counter()
    plan = plan_update(batch, mini_batches=1, epochs=1, budget=budget, perm=torch.Generator().manual_seed(0), dist=dist)
    kw = dict(pad_id=0, temperature=1.0, dist=dist)
    old = frozen_logprobs(model, batch, plan, **kw)
    inputs = StepInputs(advantages=adv, old_logp=old, ref_logp=None, uniforms=None)
    objective = Objective("grpo", dict(METHODS["grpo"].defaults), "token-mean", 0.0, COMPLETION)
    for s in plan:
        accumulate_gradients(model, batch, s, inputs, objective, **kw)
        optimizer_step(model, opt, sched, 1.0)
    return time.perf_counter() - t0


def overhead(reps: int) -> dict:
    model, opt, sched = build_model()
    batch, adv = build_batch(32)
    one_step(model, opt, sched, batch, adv, 0)  # warm-up
    times = {"whole": [], "micro": []}
    for _ in range(reps):
        times["whole"].append(one_step(model, opt, sched, batch, adv, 0))
        times["micro"].append(one_step(model, opt, sched, batch, adv, BUDGET))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "rows": 32,
        "tokens_per_row": PROMPT + COMPLETION,
        "budget": BUDGET,
        "micro_batches": 4,
        "s_whole": med["whole"],
        "s_micro": med["micro"],
        "ratio": med["micro"] / med["whole"],
        "target": 1.05,
        "reps": reps,
        "all_s": times,
    }


def rss_mib() -> float:
    """Peak resident memory of this process so far (MiB): VmHWM, the high-water mark of its own
    address space (ru_maxrss would carry the parent's peak across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB on most systems


def child(rows: int, budget: int) -> None:
    """Subprocess arm: prints {"base_mib", "peak_mib"} as JSON."""
    import torch

    torch.set_num_threads(1)
    model, opt, sched = build_model()
    batch, adv = build_batch(8)
    one_step(model, opt, sched, batch, adv, BUDGET)  # warm-up at the smallest size: AdamW state, allocator
    batch, adv = build_batch(rows, seed=1)
    base = rss_mib()
    one_step(model, opt, sched, batch, adv, budget)
    print(json.dumps({"rows": rows, "budget": budget, "base_mib": base, "peak_mib": rss_mib()}))


# glibc raises its mmap threshold after each large free (up to 32 MiB), so freed activations stay
# in the heap and the high-water mark measures the allocator's history, not live tensors (8 -> 32
# rows: +170 MiB once, then flat). A fixed threshold returns large blocks to the OS when freed.
MALLOC_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}


def memory() -> dict:
    out = {}
    for rows, budget in ((8, BUDGET), (32, BUDGET), (32, 0)):  # the last: no micro-batching, for reference
        res = subprocess.run(
            [sys.executable, __file__, "--child", str(rows), "--budget", str(budget)],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
            env=MALLOC_ENV,
        )
        out[(rows, budget)] = json.loads(res.stdout.strip().splitlines()[-1])
    small, big, whole = out[(8, BUDGET)], out[(32, BUDGET)], out[(32, 0)]
    return {
        "budget": BUDGET,
        "rows": [8, 32],
        "peak_mib": [small["peak_mib"], big["peak_mib"]],
        "growth_mib": [small["peak_mib"] - small["base_mib"], big["peak_mib"] - big["base_mib"]],
        "ratio": big["peak_mib"] / small["peak_mib"],
        "target": 1.1,
        "reference_whole_minibatch_32_rows": {
            "peak_mib": whole["peak_mib"],
            "ratio": whole["peak_mib"] / small["peak_mib"],
        },
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=None, help="steps per arm (default 10; quick 3)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=BUDGET, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "step.json"))
    args = ap.parse_args(argv)
    if args.child is not None:
        child(args.child, args.budget)
        return {}
    import torch

    torch.set_num_threads(1)
    report = {
        "benchmark": "micro-batching: overhead at equal tokens, peak memory at 4x the mini-batch",
        "model": SHAPE,
        "overhead": overhead(args.reps or (3 if args.quick else 10)),
        "memory": memory(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    o, m = report["overhead"], report["memory"]
    print(
        f"micro-batching overhead at equal tokens ({o['rows']} rows x {o['tokens_per_row']} tokens, 1 vs "
        f"{o['micro_batches']} micro-batches): {o['s_whole']:.2f} s vs {o['s_micro']:.2f} s = {o['ratio']:.3f}x "
        f"(target <= {o['target']}x) {'ok' if o['ratio'] <= o['target'] else 'MISSED'}"
    )
    print(
        f"peak memory, mini-batch 8 -> 32 rows at {m['budget']} tokens per micro-batch: {m['peak_mib'][0]:.0f} -> "
        f"{m['peak_mib'][1]:.0f} MiB = {m['ratio']:.3f}x (target <= {m['target']}x; growth over the warmed-up "
        f"process: {m['growth_mib'][0]:.0f} -> {m['growth_mib'][1]:.0f} MiB) "
        f"{'ok' if m['ratio'] <= m['target'] else 'MISSED'}; without micro-batching, 32 rows: "
        f"{m['reference_whole_minibatch_32_rows']['peak_mib']:.0f} MiB = "
        f"{m['reference_whole_minibatch_32_rows']['ratio']:.2f}x"
    )
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
