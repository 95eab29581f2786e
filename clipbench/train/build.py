"""What a run's trainer is built from: the policy (and frozen reference), the optimizer and its LR
schedule. Used by `train/loop.py: setup`.

Master weights are float32; bfloat16/float16 is the compute dtype (autocast in one process, FSDP's
param dtype when sharded), so small AdamW updates are not rounded away.
"""

from __future__ import annotations

import math

import torch

from clipbench.config import RunConfig
from clipbench.models import dtype_name, load_model_and_tokenizer, resolve_model_name
from clipbench.models.routing import RouteReplay, replayable
from clipbench.objectives import reads_rollout_logp
from clipbench.objectives.corrections import NONE
from clipbench.rollout import build_sampler, resolve_backend
from clipbench.train.distributed import Dist, shard_model


def lr_lambda(tc):
    """LR multiplier per optimizer step: linear warmup, then constant or cosine to 0."""
    total = planned_optimizer_steps(tc)

    def f(s: int) -> float:
        if tc.warmup_steps and s < tc.warmup_steps:
            return (s + 1) / tc.warmup_steps
        if tc.lr_schedule == "cosine":
            progress = min(1.0, (s - tc.warmup_steps) / max(1, total - tc.warmup_steps))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return f


def planned_optimizer_steps(tc) -> int:
    return max(1, tc.steps * tc.mini_batches * tc.epochs)


def load_policy_model(
    name: str, dist: Dist, compute_dtype: torch.dtype, *, trainable: bool, gradient_checkpointing: bool = False
):
    """(model, tokenizer) with float32 master weights on this rank's device, FSDP-sharded when N > 1."""
    model, tok = load_model_and_tokenizer(name, dtype="float32", device="cpu" if dist.sharded else str(dist.device))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dist.sharded:
        shard_model(model, compute_dtype)
    if trainable:
        model.train()
    else:
        model.eval().requires_grad_(False)
    return model, tok


def build_models(cfg: RunConfig, dist: Dist, dtype: torch.dtype):
    """(policy, frozen reference or None, tokenizer). Master weights in float32; bfloat16/float16 is
    the compute dtype (autocast in one process, FSDP's param dtype when sharded), so small AdamW
    updates are not rounded away."""
    name = resolve_model_name(cfg.model.name)
    model, tok = load_policy_model(
        name, dist, dtype, trainable=True, gradient_checkpointing=cfg.model.gradient_checkpointing
    )
    if cfg.model.routing_replay != "none":
        RouteReplay.attach(model)  # the routers' hooks; step.py records and replays through them
    elif replayable(model) is None:  # a MoE policy without replay: the hooks only observe (diagnostics)
        RouteReplay.attach(model, replaces=False)
    ref_model = None
    if cfg.train.beta > 0:  # frozen reference: the initial policy
        if dist.sharded:
            ref_model, _ = load_policy_model(name, dist, dtype, trainable=False)
        else:
            ref_model, _ = load_model_and_tokenizer(name, dtype=dtype_name(dtype), device=str(dist.device))
            ref_model.eval().requires_grad_(False)
    return model, ref_model, tok


def build_optimizer(model, tc):
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay, fused=True
    )  # one kernel for all tensors: 3x faster than the default on CPU
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc))


def build_run_sampler(cfg: RunConfig, model, tok, dist: Dist, dtype: torch.dtype):
    """(backend name, sampler) of run `cfg`: the sampler over the policy `model`, asked for its log-probs
    where the run reads them."""
    backend = resolve_backend(cfg.sampler.backend)
    sc = cfg.sampler
    # the sampler's log-probs: its old log-probs, or the mismatch (always logged by vLLM; with hf only
    # when a correction asks for it: hf samples from the training model itself)
    # (and a rule that reads the rollout policy's log-probs: rollout_is)
    # (and a lagged sampler: the behaviour policy's log-probs measure the batch's staleness)
    want_logp = (
        sc.old_logp == "sampler"
        or cfg.sampler.correction.name != NONE
        or backend == "vllm"
        or reads_rollout_logp(cfg.objective.name)
        or sc.lag > 0
    )
    eval_tokens = cfg.eval.max_new_tokens or sc.max_new_tokens  # the engine must hold eval's completions too
    sampler = build_sampler(
        backend,
        model,
        tok,
        max_new_tokens=sc.max_new_tokens,
        temperature=sc.temperature,
        top_p=sc.top_p,
        seed=cfg.seed,
        return_logprobs=want_logp,
        dtype=dtype_name(dtype),
        gpu_memory_utilization=sc.gpu_memory_utilization,
        longest_new_tokens=max(eval_tokens, sc.max_new_tokens),
        sleep_mode=sc.sleep_mode,
        synced_gpus=dist.sharded,
        model_path=resolve_model_name(cfg.model.name) if dist.sharded else None,
        record_routes=cfg.model.routing_replay == "r3",  # Rollout.routes: the experts the sampler chose
    )
    return backend, sampler
