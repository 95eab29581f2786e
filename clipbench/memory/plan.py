"""A run config -> its memory plan per GPU, and the check a run makes before it loads anything.

    hw = target_hardware(cfg, gpu_memory=None)                # the recipe's GPUs (launch.*), or the flags'
    setup = setup_for(cfg, world_size=8, device_gib=80)      # the knobs that decide memory
    check_fits(cfg, model_path, world_size=8, device_gib=80)  # UserError naming the knob to turn

Every run's preflight (clipbench.engines.preflight) runs `check_fits` with the GPU's memory;
`clipbench plan` and `clipbench rehearse` plan on the recipe's declared GPUs (`target_hardware`).
"""

from __future__ import annotations

from dataclasses import dataclass

from clipbench.config import RunConfig
from clipbench.errors import UserError
from clipbench.memory.estimator import MARGIN, MemoryPlan, Setup, advise, estimate, gib
from clipbench.models import PROMPT_TOKENS, compute_dtype, dtype_name
from clipbench.models.shapes import ModelShape, model_shape


def launch_nproc(cfg: RunConfig) -> int:
    """Processes per node the run config asks for (`launch.nproc_per_node`)."""
    return cfg.launch.nproc_per_node


DEFAULT_GPU_GIB = 80.0  # the GPU memory assumed when neither --gpu-memory nor launch.gpu_memory says


@dataclass(frozen=True)
class Hardware:
    """The GPUs a plan is for: `nproc` per node on `nnodes` nodes, `gpu_gib` GiB each, the GPU's
    name when the recipe gives it, and where each figure comes from."""

    nproc: int
    nnodes: int
    gpu_gib: float
    gpu: str | None = None
    nproc_from: str = "launch.nproc_per_node"
    gpu_gib_from: str = "launch.gpu_memory"
    recipe_gib: float | None = None  # the recipe's own launch.gpu_memory, when a flag overrides it

    def describe(self) -> str:
        """One line: what the plan assumes and why, e.g. "8 x H200 of 139 GiB (launch.nproc_per_node,
        launch.gpu, launch.gpu_memory of the recipe)"."""
        n = self.nproc * self.nnodes
        gpus = f"{self.nproc} x {self.gpu}" if self.gpu else f"{self.nproc} GPU{'s' if self.nproc > 1 else ''}"
        if self.nnodes > 1:
            gpus += f" per node x {self.nnodes} nodes ({n} GPUs)"
        why = [f"GPUs: {self.nproc_from}", f"memory: {self.gpu_gib_from}"]
        if self.recipe_gib is not None:
            why.append(f"the recipe's launch.gpu_memory is {self.recipe_gib:g} GiB")
        return f"{gpus} of {self.gpu_gib:g} GiB ({'; '.join(why)})"

    def as_dict(self) -> dict:
        return {
            "gpus_per_node": self.nproc,
            "nnodes": self.nnodes,
            "gpu_memory_gib": self.gpu_gib,
            "gpu": self.gpu,
            "from": {"gpus_per_node": self.nproc_from, "gpu_memory_gib": self.gpu_gib_from},
        }


def target_hardware(
    cfg: RunConfig, *, nproc_per_node: int | None = None, nnodes: int = 1, gpu_memory: float | None = None
) -> Hardware:
    """The GPUs to plan `cfg` on: the flags' where given (--nproc-per-node, --nnodes, --gpu-memory),
    else the recipe's (`launch.nproc_per_node`, `launch.gpu`, `launch.gpu_memory`), else
    DEFAULT_GPU_GIB per GPU. The GPU's name is shown only with the recipe's memory."""
    nproc_from = "--nproc-per-node" if nproc_per_node is not None else "launch.nproc_per_node"
    nproc = nproc_per_node if nproc_per_node is not None else launch_nproc(cfg)
    declared = cfg.launch.gpu_memory
    if gpu_memory is not None:
        overridden = declared if declared is not None and declared != gpu_memory else None
        return Hardware(nproc, nnodes, gpu_memory, None, nproc_from, "--gpu-memory", overridden)
    if declared is not None:
        return Hardware(nproc, nnodes, float(declared), cfg.launch.gpu, nproc_from, "launch.gpu_memory")
    why = f"the default {DEFAULT_GPU_GIB:g} GiB: the recipe sets no launch.gpu_memory"
    return Hardware(nproc, nnodes, DEFAULT_GPU_GIB, None, nproc_from, why)


def setup_for(
    cfg: RunConfig,
    *,
    world_size: int = 1,
    device_gib: float = DEFAULT_GPU_GIB,
    prompt_tokens: int = PROMPT_TOKENS,
    backend: str | None = None,
    shape: ModelShape | None = None,
) -> Setup:
    """The memory-relevant knobs of `cfg` on `world_size` GPUs of `device_gib` each.

    prompt_tokens: the longest prompt assumed, capped by the model's context (`shape`) less the
    completion budget (the vLLM sampler's own limit). backend: the resolved sampler backend
    (default: the config's, with `auto` read as vllm, what a GPU machine with the vllm extra
    resolves it to)."""
    tc, sc = cfg.train, cfg.sampler
    if shape is not None and shape.max_position_embeddings and shape.max_position_embeddings > sc.max_new_tokens:
        prompt_tokens = min(prompt_tokens, shape.max_position_embeddings - sc.max_new_tokens)
    rollout_rows = tc.prompts_per_step * sc.group_size
    prompts_per_rank = -(-tc.prompts_per_step // world_size)
    prompts_per_call = min(sc.prompts_per_call or prompts_per_rank, prompts_per_rank)
    backend = backend or ("vllm" if sc.backend == "auto" else sc.backend)
    return Setup(
        dtype=dtype_name(compute_dtype(cfg.model.dtype, "cuda", bf16_supported=True)),  # a plan is for a GPU
        world_size=world_size,
        device_gib=device_gib,
        prompt_tokens=prompt_tokens,
        max_new_tokens=sc.max_new_tokens,
        rows_per_mini_batch=-(-rollout_rows // tc.mini_batches),
        micro_batch_tokens=tc.micro_batch_tokens,
        generate_rows=prompts_per_call * sc.group_size,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        reference_model=tc.beta > 0,
        backend=backend,
        gpu_memory_utilization=sc.gpu_memory_utilization,
        sleep_mode=sc.sleep_mode,
        sampler_logprobs=sc.old_logp == "sampler"
        or sc.correction.name != "none"
        or sc.lag > 0
        or _reads_rollout_logp(cfg),
        lag=sc.lag,
    )


def _reads_rollout_logp(cfg: RunConfig) -> bool:
    """Does the run's rule read the sampler's log-probs (rollout_is)? The hf sampler then keeps them."""
    from clipbench.objectives import reads_rollout_logp  # noqa: PLC0415 - objectives pulls in torch

    return reads_rollout_logp(cfg.objective.name)


def fit_message(plan: MemoryPlan, knobs: list[str], where: str) -> str:
    """One line: what does not fit, by how much, and the knob(s) to turn."""
    u = plan.setup
    if not plan.kv_fits:
        need = f"the vLLM KV cache holds {plan.kv_sequences:.2f} of one {u.seq_tokens}-token sequence"
    else:
        need = (
            f"{plan.peak_phase} needs ~{gib(plan.with_margin_bytes)} GiB per GPU "
            f"(with {MARGIN:.0%} margin) of {u.device_gib:g} GiB"
        )
    fix = (
        ("set " + knobs[0] + (" (or " + ", ".join(knobs[1:]) + ")" if knobs[1:] else ""))
        if knobs
        else (
            "no single knob (train.micro_batch_tokens, model.gradient_checkpointing, sampler.sleep_mode, "
            "sampler.gpu_memory_utilization, --nproc-per-node up to 64) makes it fit; combine them "
            "(see `clipbench plan`)"
        )
    )
    return f"{plan.shape.name} does not fit {where}: {need}; {fix}"


def check_fits(
    cfg: RunConfig, model_path: str, *, world_size: int, device_gib: float, backend: str | None = None
) -> MemoryPlan:
    """The plan of `cfg` on `world_size` GPUs of `device_gib`; UserError naming the knob to turn
    when it does not fit. model_path: model.name resolved (`builtin:` names to their directory)."""
    shape = model_shape(model_path)
    setup = setup_for(cfg, world_size=world_size, device_gib=device_gib, backend=backend, shape=shape)
    plan = estimate(shape, setup)
    if not plan.fits:
        nnodes = max(1, world_size // launch_nproc(cfg)) if world_size % launch_nproc(cfg) == 0 else 1
        where = f"{world_size} x {device_gib:.0f} GiB GPU" + ("s" if world_size > 1 else "")
        raise UserError(fit_message(plan, advise(shape, setup, nnodes=nnodes), where))
    return plan
