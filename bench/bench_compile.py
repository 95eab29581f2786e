"""A speed lever not taken: `torch.compile` of the training forward and backward.

    .venv/bin/python bench/bench_compile.py [--reps N] [--out results/bench/compile.json]

The workload is an optimizer step's model work at the quickstart regime's shape: the built-in
`builtin:arith-steps` model (3 layers, width 128), a micro-batch of 16 rows of 12 prompt + 24
completion tokens (the widths vary by a few tokens from step to step, as packed micro-batches do),
`completion_logprobs` (the function training runs) and the backward of a token-mean of the log-probs,
float32, CPU, one thread (what `clipbench sweep --jobs 2` gives a run on 2 cores).

Two arms, alternating (eager, compiled, eager, ...) in one process, medians of `--reps` steps each:
eager (the product's path) and the same module under `torch.compile(dynamic=True)` (inductor's C++
kernels). Reported: seconds per step, the compile time paid before the first compiled step (cold:
an empty inductor cache; a second process finds the cache and pays less), and how far the compiled
numbers are from the eager ones (largest absolute difference of the log-probs and of the gradient).

Why it is measured and not used: its kernels sum in another order, so log-probs and gradients move
by ~1e-7; sampled tokens then move where two candidates tie, and a run's numbers are no longer the
numbers its run id names (docs/speed.md). Needs a C++ compiler; without one it reports that and
exits 0. Writes results/bench/compile.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def micro_batch(vocab: int, width_extra: int, gen):
    """16 rows of 12 prompt + 24 completion tokens (+ width_extra), left-padded prompts (the first
    four rows 3 tokens shorter), positions counted from each row's first real token."""
    import torch

    P, T, B = 12, 24 + width_extra, 16
    ids = torch.randint(3, vocab, (B, P + T), generator=gen)
    att = torch.ones(B, P + T, dtype=torch.long)
    att[:4, :3] = 0
    ids[:4, :3] = 0
    pos = (att.cumsum(1) - 1).clamp(min=0)
    return SimpleNamespace(input_ids=ids, attention_mask=att, position_ids=pos, completion_ids=ids[:, P:])


def step(model, batch):
    """One micro-batch's forward and backward; returns the log-probs and the flat gradient."""
    import torch

    from clipbench.train.logprobs import completion_logprobs

    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, batch)
    logp.mean().backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return logp.detach(), grad


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "compile.json")
    a = ap.parse_args(argv)

    import torch

    from clipbench.models.load import load_model_and_tokenizer

    torch.set_num_threads(1)
    model, _ = load_model_and_tokenizer("builtin:arith-steps")
    model.train()
    gen = torch.Generator().manual_seed(0)
    batches = [micro_batch(model.config.vocab_size, k % 6, gen) for k in range(12)]
    compiled = torch.compile(model, dynamic=True)
    t = time.perf_counter()
    try:
        for b in batches[:2]:  # two widths: the dynamic-shape graph is the one the steps use
            step(compiled, b)
    except Exception as e:  # noqa: BLE001 - no compiler, an unsupported platform: say so and stop
        print(f"bench_compile: torch.compile is unavailable here ({type(e).__name__}: {str(e).splitlines()[0]})")
        return {}
    compile_s = time.perf_counter() - t

    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    diff_logp = diff_grad = 0.0
    for k in range(a.reps):
        b = batches[k % len(batches)]
        out = {}
        for arm, m in (("eager", model), ("compiled", compiled)):
            c = time.thread_time()
            out[arm] = step(m, b)
            times[arm].append(time.thread_time() - c)
        diff_logp = max(diff_logp, (out["eager"][0] - out["compiled"][0]).abs().max().item())
        diff_grad = max(diff_grad, (out["eager"][1] - out["compiled"][1]).abs().max().item())
    med = {arm: statistics.median(ts) for arm, ts in times.items()}
    result = {
        "shape": "16 rows x (12 prompt + 24..29 completion) tokens, builtin:arith-steps, float32, 1 thread",
        "reps": a.reps,
        "eager_ms": round(1e3 * med["eager"], 2),
        "compiled_ms": round(1e3 * med["compiled"], 2),
        "speedup": round(med["eager"] / med["compiled"], 3),
        "compile_s": round(compile_s, 1),
        "max_abs_diff_logp": diff_logp,
        "max_abs_diff_grad": diff_grad,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"forward+backward per micro-batch (thread CPU, median of {a.reps}): eager {result['eager_ms']:.1f} ms, "
        f"compiled {result['compiled_ms']:.1f} ms ({result['speedup']:.2f}x); compile {result['compile_s']:.0f} s "
        f"before the first step; compiled - eager: log-probs up to {diff_logp:.1e}, gradient up to {diff_grad:.1e}"
    )
    return result


if __name__ == "__main__":
    main()
