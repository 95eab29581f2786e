"""The sampler/trainer mismatch of a recipe's base model on its own task, and what each correction
would do to it (docs/studies/corrections.md, "The mismatch (before training)").

    .venv-vllm/bin/python scripts/measure_mismatch.py OUT.json recipes/quickstart.yaml sampler.backend=vllm model.dtype=bfloat16

Samples 64 training prompts x 8 with the recipe's sampler (the vLLM engine in the recipe's dtype),
recomputes the trainer's log-probs of the same tokens (under autocast in that dtype, as the trainer
does) and writes to OUT.json: the quantiles of |log rho| and `correction_stats` of each correction
(vLLM prints its own log on stdout).
"""

from __future__ import annotations

import json
import sys

import torch

from clipbench.config import load_run_config
from clipbench.models import compute_dtype, dtype_name, load_model_and_tokenizer, resolve_model_name
from clipbench.objectives.corrections import apply_correction, correction_stats
from clipbench.rollout import build_sampler, resolve_backend
from clipbench.tasks import build_run_task
from clipbench.train.logprobs import completion_logprobs
from clipbench.train.packing import pack

SETTINGS = {
    "none": None,
    "tis": {"name": "tis"},
    "icepop": {"name": "icepop"},
    "icepop_0.9_1.1": {"name": "icepop", "low": 0.9, "high": 1.1},
    "icepop_0.95_1.05": {"name": "icepop", "low": 0.95, "high": 1.05},
    "geo_mask": {"name": "geo_mask"},
    "veto": {"name": "veto"},
    "kl_rs": {"name": "kl_rs"},
}


def main(argv: list[str]) -> None:
    out_path, cfg = argv[0], load_run_config(argv[1], argv[2:])
    dtype = compute_dtype(cfg.model.dtype, torch.device("cpu"))
    model, tok = load_model_and_tokenizer(resolve_model_name(cfg.model.name), dtype="float32", device="cpu")
    problems = list(build_run_task(cfg).train_problems())[:64]
    sc = cfg.sampler
    sampler = build_sampler(
        resolve_backend(sc.backend),
        model,
        tok,
        max_new_tokens=sc.max_new_tokens,
        temperature=sc.temperature,
        top_p=sc.top_p,
        seed=cfg.seed,
        return_logprobs=True,
        dtype=dtype_name(dtype),
        gpu_memory_utilization=sc.gpu_memory_utilization,
        longest_new_tokens=sc.max_new_tokens,
        sleep_mode=False,
        synced_gpus=False,
    )
    ro = sampler.generate([p.prompt for p in problems], 8, seed=1)
    sampler.close()
    batch = pack(ro.prompt_ids, ro.completion_ids, tok.pad_token_id)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        trainer, _ = completion_logprobs(model, batch, with_entropy=False)
    trainer, mask = trainer.float(), batch.completion_mask
    sampled = torch.zeros_like(trainer)
    for i, lp in enumerate(ro.sampler_logp):
        sampled[i, : len(lp)] = torch.tensor(lp)
    d = ((trainer - sampled) * mask)[mask > 0].abs()
    out = {
        "tokens": int(mask.sum()),
        "rows": mask.shape[0],
        "abs_log_rho_quantiles": {q: float(d.quantile(q)) for q in (0.5, 0.9, 0.99, 0.999, 1.0)},
    }
    out.update(
        {name: correction_stats(apply_correction(s, sampled, trainer, mask).sums) for name, s in SETTINGS.items()}
    )
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
