"""Sampling speed on the organism's base model against a bound derived for this CPU.

    .venv/bin/python bench/bench_sampling.py [--reps 3] [--out results/bench/sampling.json]

Sampling is the larger part of an organism run: n = 64 on 200 test and 200 validation problems is
25,600 completions at each endpoint, and 150 rollout steps sample 19,200 more. This measures the HF
sampler the trainer and the evaluation use (`clipbench.rollout.hf.HFSampler`, from the shipped
builtin:arith-organism, float32, 1 thread) as completion tokens per CPU second of this thread (the
machine may be shared; CPU time is what other processes barely move), at two shapes:

    evaluation  an endpoint's batches: 4 batches of 16 problems x n = 64, as `evaluate` hands them
                over (`generate_calls`; readable: one generate call per batch)
    rollout     one training step's call: 16 prompts x 8

each on the readable path (transformers' `generate`, `HFSampler.own_loop` off) and on the product
(the sampler's own decode loop, rollout/decode.py: the same tokens, checked here), alternating, and
sets both beside a bound:

    FLOPs per generated token  = 2 x (the matmul parameters a token passes: attention and MLP
                                 projections of every layer, and the tied output layer)
                               + 4 x layers x heads x head_dim x context (attention scores and values)
    matmul rate                = this CPU's measured float32 GEMM rate on 1 thread (a 512 x 512 x 512
                                 matmul per CPU second, median of 20), the most one core's arithmetic gives
    bound (tokens / s)         = matmul rate / FLOPs per token

Target: 40% of the bound at both shapes. The bound counts arithmetic only; a 0.45M-parameter model is
far from it because each decoding step is a few tiny matmuls, an attention kernel that pays a fixed
cost per row and head, and Python work per layer, paid once per step for the whole batch. Writes
results/bench/sampling.json and prints a short table.
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
    """Median float32 FLOP per CPU second of this thread of a size^3 matmul (one thread: the same clock
    as the sampling's tokens per CPU second, so another process's load moves neither much)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        a @ b
        times.append(time.thread_time() - t0)
    return 2 * size**3 / statistics.median(times)


def flops_per_token(config, context: float) -> float:
    """Arithmetic of one decoding step of one row (see the module docstring)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * config.intermediate_size
    matmul_params = layers * per_layer + h * config.vocab_size  # + the tied output layer
    return 2 * matmul_params + 4 * layers * heads * hd * context


SHAPES = {"evaluation": (4, 16, 64), "rollout": (1, 16, 8)}  # (calls, prompts per call, n)
QUICK = {"evaluation": (2, 4, 4), "rollout": (1, 4, 2)}  # --quick: a look at the mechanics, not a measurement
TARGET = 0.4  # of the bound


def measure(sampler, prompts: list[str], shape: tuple[int, int, int], seed: int, own: bool) -> dict:
    """One pass at `shape` on one path: thread CPU seconds, completion tokens, the completions."""
    calls, per_call, n = shape
    batches = [(prompts[i * per_call : (i + 1) * per_call], seed * 100 + i) for i in range(calls)]
    sampler.own_loop = own
    t0 = time.thread_time()
    outs = sampler.generate_calls(batches, n)
    seconds = time.thread_time() - t0
    completions = [c for o in outs for c in o.completion_ids]
    return {"seconds": seconds, "tokens": sum(map(len, completions)), "completions": completions}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:arith-organism")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the mechanics only)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "sampling.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = QUICK if args.quick else SHAPES

    from clipbench.models import resolve_model_name  # noqa: PLC0415
    from clipbench.models.load import load_model_and_tokenizer  # noqa: PLC0415
    from clipbench.rollout.hf import HFSampler  # noqa: PLC0415
    from clipbench.tasks.arith import ArithTask  # noqa: PLC0415

    model, tok = load_model_and_tokenizer(resolve_model_name(args.model))
    model.eval()
    task = ArithTask(operands=3, format="steps", seed=0)
    prompts = [p.prompt for p in task.test_problems()[:64]]
    sampler = HFSampler(model, tok, max_new_tokens=48)
    sampler.generate(prompts[:8], 2, seed=0)  # warm-up
    rate = gemm_rate()
    prompt_len = statistics.mean(len(tok(p)["input_ids"]) for p in prompts)
    result = {"model": args.model, "parameters": sum(p.numel() for p in model.parameters()), "threads": 1}
    result["gemm_flops_per_s"] = rate
    identical = True
    for name, shape in shapes.items():
        runs: dict[str, list[dict]] = {"readable": [], "product": []}
        for rep in range(args.reps):
            for arm in runs:
                runs[arm].append(measure(sampler, prompts, shape, rep + 1, own=arm == "product"))
            identical &= runs["readable"][-1].pop("completions") == runs["product"][-1].pop("completions")
        tokens = statistics.mean(r["tokens"] for r in runs["product"])
        mean_completion = tokens / (shape[0] * shape[1] * shape[2])
        fpt = flops_per_token(model.config, prompt_len + mean_completion / 2)  # the mean context attended over
        bound = rate / fpt
        part = {"calls_prompts_n": list(shape), "mean_completion_tokens": mean_completion, "flops_per_token": fpt}
        part["bound_tokens_per_s"] = bound
        for arm, rs in runs.items():
            tps = statistics.median(r["tokens"] / r["seconds"] for r in rs)
            part[arm] = {"tokens_per_s": tps, "fraction_of_bound": tps / bound, "runs": rs}
        part["speedup"] = part["product"]["tokens_per_s"] / part["readable"]["tokens_per_s"]
        result[name] = part
    result["identical_tokens"] = identical
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"sampling {args.model}, 1 thread; matmul {rate / 1e9:.1f} GFLOP/s (float32 GEMM 512^3)")
    print(
        f"{'shape':12}{'bound tok/s':>13}{'readable':>11}{'product':>11}{'speedup':>9}  target >= {TARGET:.0%} of the bound"
    )
    for name in shapes:
        r = result[name]
        fr, fp = r["readable"]["fraction_of_bound"], r["product"]["fraction_of_bound"]
        verdict = "met" if fp >= TARGET else "NOT met"
        print(f"{name:12}{r['bound_tokens_per_s']:>13,.0f}{fr:>11.1%}{fp:>11.1%}{r['speedup']:>8.2f}x  {verdict}")
    print(f"the same tokens on both paths: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
