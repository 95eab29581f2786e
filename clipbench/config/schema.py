"""The run config: every default of a run lives here (method parameters live in METHODS, arith's
knobs in ``clipbench.tasks.arith.ArithKnobs``, their one owner: ``TaskConfig`` reads them from it).

A recipe YAML is merged over these dataclasses (OmegaConf structured config), so an unknown key or
a wrong type is an error naming the key. Choices below are validated in `clipbench.config.load`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from clipbench.tasks.arith import ARITH_DEFAULTS as _ARITH

# Closed choices, checked by `load.validate` (the objective methods and aggregations are checked
# against `clipbench.objectives`, their one registry).
CHOICES: dict[str, tuple[str, ...]] = {
    "engine": ("builtin", "trl"),
    "model.dtype": ("float32", "bfloat16", "float16", "auto"),
    "model.device": ("auto", "cpu", "cuda"),
    "task.name": ("arith", "math"),
    "task.template": ("auto", "dapo", "plain"),
    "sampler.backend": ("auto", "hf", "vllm"),
    "sampler.old_logp": ("recompute", "sampler"),
    "sampler.mismatch_is": ("none", "token", "sequence"),
    "train.advantage": ("group", "group_mean", "rloo"),
    "train.lr_schedule": ("constant", "cosine"),
}


@dataclass
class ModelConfig:
    name: str = "builtin:arith-tiny"  # HF name, local path, or builtin:arith-tiny
    dtype: str = "float32"  # compute dtype; bfloat16/float16 train with float32 master weights + autocast
    device: str = "auto"  # auto: cuda when available, else cpu
    gradient_checkpointing: bool = False


@dataclass
class TaskConfig:
    name: str = "arith"  # arith | math
    path: Optional[str] = None  # math: .jsonl/.parquet file, directory, or HF dataset name
    config: Optional[str] = None  # math: the HF dataset's config name (e.g. 'all' for DAPO-Math-17k-Processed)
    split: str = "train"
    template: str = "auto"  # auto: dapo for math, the task's own format for arith
    limit: Optional[int] = None  # cap on training problems
    holdout: int = 0  # math: problems held out of the training file as its test split
    # arith knobs (ignored by math): defaults and checks owned by clipbench.tasks.arith.ArithKnobs
    operands: int = _ARITH.operands
    digits: int = _ARITH.digits
    ops: str = _ARITH.ops
    format: str = _ARITH.format  # answer: "37+45=" -> "82"; steps: worked steps, then "#<answer>"
    train_size: int = _ARITH.train_size
    test_size: int = _ARITH.test_size


@dataclass
class SamplerConfig:
    backend: str = "auto"  # auto: vllm when installed and a GPU is present, else hf
    group_size: int = 8  # G samples per prompt
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    old_logp: str = "recompute"  # recompute: training policy once per rollout; sampler: backend's
    # Prompts per generate call (0: all of a rank's prompts in one call). Each call is seeded from
    # (seed, step, global index of its first prompt), so 1 and N processes sample the same completions
    # when prompts_per_step / N is a multiple of it.
    prompts_per_call: int = 0
    gpu_memory_utilization: float = 0.3  # vllm only
    sleep_mode: bool = False  # vllm on CUDA: the engine sleeps while the trainer updates (frees its share)
    # sampler/trainer mismatch correction (truncated importance sampling; needs old_logp: recompute):
    # none | token: w_t = min(pi_old(y_t) / pi_sampler(y_t), cap) | sequence: one weight per sequence
    mismatch_is: str = "none"
    mismatch_is_cap: float = 2.0  # the cap C of the truncated importance weights (>= 1)


@dataclass
class OverlongConfig:
    enabled: bool = False  # DAPO overlong reward shaping
    buffer: int = 8  # soft penalty over the last `buffer` tokens before max_new_tokens
    penalty: float = 1.0  # reward - penalty * (len - (max - buffer)) / buffer; truncated: -penalty


@dataclass
class TrainConfig:
    steps: int = 40  # rollout steps
    prompts_per_step: int = 8  # P
    mini_batches: int = 4  # optimizer steps per rollout batch (and epoch): >1 makes updates off-policy
    epochs: int = 1
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0  # optimizer steps of linear warmup
    lr_schedule: str = "constant"  # constant | cosine (to 0 over all optimizer steps, after warmup)
    advantage: str = "group"
    agg: str = "token-mean"
    beta: float = 0.0  # KL-to-reference weight (k3); 0 keeps no reference model
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping (the norm is still logged)
    max_skipped_frac: float = 0.1  # the run fails once more than this share of its optimizer steps is skipped
    # Token budget of one forward/backward (rows x padded prompt+completion width); 0 = the whole
    # mini-batch. Gradients accumulate over micro-batches: the loss and gradient are the mini-batch's.
    micro_batch_tokens: int = 0
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups, draw more prompts
    max_resample_rounds: int = 3  # cap on extra draws per step when dynamic_sampling
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    checkpoint_every: int = 10  # rollout steps between checkpoints (and at the end)
    log_histograms: bool = True


@dataclass
class EvalConfig:
    every: int = 0  # rollout steps between evaluations; 0 = only at the start and the end
    benchmarks: List[str] = field(default_factory=lambda: ["arith"])
    n: int = 8  # samples per problem
    limit: Optional[int] = 64  # problems per benchmark (None = all)
    data_dir: Optional[str] = None  # local copies of the benchmarks (else HF dataset names)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None  # default: sampler.max_new_tokens
    at_start: bool = True


@dataclass
class TrackingConfig:
    mlflow: bool = True
    tracking_uri: Optional[str] = None  # default: MLFLOW_TRACKING_URI, else sqlite in results dir
    experiment: str = "clipbench"
    batch_every: int = 10  # optimizer steps per MLflow log_batch


@dataclass
class LaunchConfig:
    # Processes per node: > 1 trains one run over N torchrun processes (FSDP2). Where a run computes,
    # not what: outside the run's identity (config.load.NOT_IN_ID), so a run may resume on another N.
    nproc_per_node: int = 1


@dataclass
class RunConfig:
    seed: int = 0
    name: Optional[str] = None  # display name; the run_id is a hash of the resolved config
    engine: str = "builtin"  # builtin: clipbench's GRPO loop; trl: TRL's GRPOTrainer (clipbench.integrations.trl)
    trl: Dict[str, Any] = field(default_factory=dict)  # engine trl: extra GRPOConfig fields (deepspeed, vllm_mode, ...)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    objective: Dict[str, Any] = field(default_factory=lambda: {"method": "grpo"})
    # user rule files (.py, relative to the recipe) or modules, imported before objective.method is checked
    plugins: List[str] = field(default_factory=list)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
