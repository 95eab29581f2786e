"""Sampling speed on the organism's base model against a bound derived for this CPU.

    .venv/bin/python bench/bench_sampling.py [--prompts 100] [--n 16] [--reps 3] [--out results/bench/sampling.json]

Sampling is the larger part of an organism run: n = 64 on 200 test and 200 validation problems is
25,600 completions at each endpoint, and 150 rollout steps sample 19,200 more. This measures the HF
sampler the trainer and the evaluation use (`clipbench.rollout.hf.HFSampler`, from the shipped
builtin:arith-organism, float32, 1 thread) as completion tokens per second, on the evaluation's shape
(prompts x n rows, one generate call), and sets it beside a bound:

    FLOPs per generated token  = 2 x (the matmul parameters a token passes: attention and MLP
                                 projections of every layer, and the tied output layer)
                               + 4 x layers x heads x head_dim x context (attention scores and values)
    matmul rate                = this CPU's measured float32 GEMM rate on 1 thread (a 512 x 512 x 512
                                 matmul, median of 20), the most one core's arithmetic gives
    bound (tokens / s)         = matmul rate / FLOPs per token

The bound counts arithmetic only; a 0.45M-parameter model is far from it because each decoding step
is a few tiny matmuls plus Python and kernel-launch work per layer, paid once per step for the whole
batch. The ratio says how much room there is in principle and why a faster kernel alone would not
close it. Writes results/bench/sampling.json and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def gemm_rate(size: int = 512, reps: int = 20) -> float:
    """Median float32 FLOP/s of a size^3 matmul on the current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times)


def flops_per_token(config, context: float) -> float:
    """Arithmetic of one decoding step of one row (see the module docstring)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * config.intermediate_size
    matmul_params = layers * per_layer + h * config.vocab_size  # + the tied output layer
    return 2 * matmul_params + 4 * layers * heads * hd * context


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:arith-organism")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "sampling.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from clipbench.models import resolve_model_name  # noqa: PLC0415
    from clipbench.models.load import load_model_and_tokenizer  # noqa: PLC0415
    from clipbench.rollout.hf import HFSampler  # noqa: PLC0415
    from clipbench.tasks.arith import ArithTask  # noqa: PLC0415

    model, tok = load_model_and_tokenizer(resolve_model_name(args.model))
    model.eval()
    task = ArithTask(operands=3, format="steps", seed=0)
    prompts = [p.prompt for p in task.test_problems()[: args.prompts]]
    sampler = HFSampler(model, tok, max_new_tokens=48)
    sampler.generate(prompts[:8], 2, seed=0)  # warm-up
    runs = []
    for rep in range(args.reps):
        t0 = time.perf_counter()
        out = sampler.generate(prompts, args.n, seed=rep + 1)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c) for c in out.completion_ids)
        runs.append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in runs)
    mean_completion = statistics.mean(r["tokens"] for r in runs) / (len(prompts) * args.n)
    prompt_len = statistics.mean(len(tok(p)["input_ids"]) for p in prompts)
    context = prompt_len + mean_completion / 2  # the mean length a decoding step attends over
    rate = gemm_rate()
    fpt = flops_per_token(model.config, context)
    bound = rate / fpt
    result = {
        "model": args.model,
        "parameters": sum(p.numel() for p in model.parameters()),
        "rows": len(prompts) * args.n,
        "mean_completion_tokens": mean_completion,
        "tokens_per_s": tokens_per_s,
        "runs": runs,
        "gemm_flops_per_s": rate,
        "flops_per_token": fpt,
        "bound_tokens_per_s": bound,
        "fraction_of_bound": tokens_per_s / bound,
        "threads": torch.get_num_threads(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"sampling {args.model}: {len(prompts)} prompts x n={args.n}, 1 thread")
    print(f"  measured   {tokens_per_s:12,.0f} completion tokens/s  ({mean_completion:.1f} tokens per completion)")
    print(f"  matmul     {rate / 1e9:12.1f} GFLOP/s (float32 GEMM 512^3, 1 thread)")
    print(f"  per token  {fpt / 1e6:12.2f} MFLOP")
    print(f"  bound      {bound:12,.0f} tokens/s  -> measured is {100 * tokens_per_s / bound:.1f}% of it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
