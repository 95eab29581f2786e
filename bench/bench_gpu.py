"""GPU benchmark (CUDA only; skipped with a note elsewhere): a full GRPO step at a realistic shape (issue 9).

    .venv/bin/python bench/bench_gpu.py [--layers 28] [--rows 64] [--completion 1024] [--peak-tflops 989]

On a randomly initialised Qwen3-1.7B-shaped model (hidden 2048, 28 layers, 16 / 8 heads, head dim 128,
vocab 151,936; bf16 compute over float32 master weights, as `model.dtype: bfloat16`), rows of 128 prompt
+ `--completion` tokens:
- the update alone (old log-probs + loss over micro-batches + AdamW; clipbench/train/step.py):
  tokens/s/GPU and MFU = 6 * parameters * tokens / time / peak bf16 FLOP/s (`--peak-tflops`, default
  the H100 SXM's dense 989; 3 * for the no-grad old log-probs pass is folded in as 2 * N * tokens);
- sampling `--rows` completions of `--completion` tokens: HF `generate` tokens/s, and vLLM's when
  it is installed (the engine loads the same weights from a temp dir);
- the full step = sampling + update.
A comparison with TRL's GRPOTrainer on the same GPU is not built here: run bench/bench_train.py's
arms on CUDA for that (not measured: no GPU has been available to this project).

Writes results/bench/gpu.json. On a machine without CUDA it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
PROMPT = 128


def model_and_batch(layers: int, rows: int, completion: int, device: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from clipbench.train.policy import pack

    torch.manual_seed(0)
    cfg = Qwen3Config(**{**QWEN3_1_7B, "num_hidden_layers": layers}, max_position_embeddings=PROMPT + completion + 8)
    model = Qwen3ForCausalLM(cfg).to(device)  # float32 master weights
    gen = torch.Generator().manual_seed(0)
    V = cfg.vocab_size
    batch = pack(torch.randint(10, V, (rows, PROMPT), generator=gen).tolist(),
                 torch.randint(10, V, (rows, completion), generator=gen).tolist(), pad_id=0)
    return model, batch, torch.randn(rows, generator=gen).to(device)


def time_update(model, batch, adv, budget: int) -> tuple[float, int]:
    import torch

    from clipbench.objectives import METHODS
    from clipbench.train.distributed import Dist
    from clipbench.train.step import (Objective, StepInputs, accumulate_gradients, frozen_logprobs, optimizer_step,
                                      plan_update)

    dist = Dist(device=torch.device("cuda"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    compute = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    kw = dict(pad_id=0, temperature=1.0, dist=dist, compute=compute)
    objective = Objective("grpo", dict(METHODS["grpo"].defaults), "token-mean", 0.0, batch.completion_ids.shape[1])
    times = []
    for _ in range(3):  # the first is a warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = plan_update(batch, mini_batches=1, epochs=1, budget=budget, perm=torch.Generator().manual_seed(0),
                           dist=dist)
        old = frozen_logprobs(model, batch, plan, **kw)
        inputs = StepInputs(advantages=adv, old_logp=old, ref_logp=None, uniforms=None)
        for s in plan:
            accumulate_gradients(model, batch, s, inputs, objective, **kw)
            optimizer_step(model, opt, sched, 1.0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times[1:]), int(batch.attention_mask.sum())


def time_hf_generate(model, rows: int, completion: int) -> float:
    import torch

    ids = torch.randint(10, model.config.vocab_size, (rows, PROMPT), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=completion,
                       min_new_tokens=completion, pad_token_id=0)
        torch.cuda.synchronize()
    return rows * completion / (time.perf_counter() - t0)


def time_vllm(model, rows: int, completion: int) -> float | None:
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as d:
        model.to(dtype=__import__("torch").bfloat16).save_pretrained(d)
        model.float()
        llm = LLM(model=d, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.4,
                  max_model_len=PROMPT + completion + 8, enforce_eager=False)
        prompts = [{"prompt_token_ids": list(range(10, 10 + PROMPT))} for _ in range(rows)]
        params = SamplingParams(max_tokens=completion, min_tokens=completion, temperature=1.0, detokenize=False)
        llm.generate(prompts[:2], params)  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return rows * completion / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=16384, help="train.micro_batch_tokens")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of the GPU")
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "gpu.json"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: skipped: no CUDA GPU here (the GPU benchmark runs only on CUDA; nothing else needs one)")
        return {"skipped": "no CUDA GPU"}
    model, batch, adv = model_and_batch(args.layers, args.rows, args.completion, "cuda")
    n_params = sum(p.numel() for p in model.parameters())
    s_update, tokens = time_update(model, batch, adv, args.budget)
    hf_tps = time_hf_generate(model, args.rows, args.completion)
    vllm_tps = time_vllm(model, args.rows, args.completion)
    sample_s = args.rows * args.completion / (vllm_tps or hf_tps)
    flops = 6 * n_params * tokens + 2 * n_params * tokens  # forward+backward, and the old log-probs' forward
    report = {"gpu": torch.cuda.get_device_name(), "params": n_params, "rows": args.rows, "tokens": tokens,
              "update_s": s_update, "update_tokens_per_s": tokens / s_update,
              "update_mfu": flops / s_update / (args.peak_tflops * 1e12),
              "hf_generate_tokens_per_s": hf_tps, "vllm_tokens_per_s": vllm_tps,
              "step_s": s_update + sample_s, "step_tokens_per_s": tokens / (s_update + sample_s),
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
