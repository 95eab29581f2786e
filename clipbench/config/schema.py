"""The run config: every default of a run lives here (method parameters live in METHODS, arith's
knobs in ``clipbench.tasks.arith.ArithKnobs``, their one owner: ``TaskConfig`` reads them from it).
Each field is declared once (`declared`): its type, default, allowed values and help side by side;
`RANGES`, `CHOICES` and the reference table of docs/config.md are derived from those declarations.
The components of a run (objective, sampler correction, aggregation, advantage) are slots
(`SLOTS`), each a typed `Slot`: a name plus parameters, with one YAML form (docs/config.md); only
`clipbench.config.stored` (to_dict / from_dict) translates them to and from the stored form.

A recipe YAML is merged over these dataclasses (OmegaConf structured config), so an unknown key or
a wrong type is an error naming the key. `clipbench.config.load.check_values` then checks every
field against its declaration below (and the few cross-field rules it states), before anything is
written: a value that passes is one the trainer can run.

Design choices:
- Ranges are declarations beside their fields (the checks: `clipbench.config.values`: Range, Each,
  Text, Source), not `if`s scattered through the loader, and every
  leaf of `RunConfig` has one (tests/test_config.py, test_config_schema.py check it): a new field
  must say what it accepts.
- Floats must be finite (1e400 in YAML is inf). Upper bounds are generous but finite, so a typo
  like `train.steps: 10**29` is an error, not a run that trains until it is killed.
- Closed lists owned by the packages below config are read from their owner
  (`choices()` below): tasks and templates (`clipbench.tasks`), aggregations,
  advantages and methods (`clipbench.objectives`), benchmarks (`clipbench.tasks.benchmarks`): such
  a field names its `owner`. The `choices` declared below are the ones this schema owns; the
  packages above config (the samplers, the trainer) read them from here (`CHOICES`). Engine names are the engines' (`clipbench.engines`, above config).
"""

from __future__ import annotations

import functools
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from clipbench.config.values import Each, Range, Source, Text
from clipbench.tasks import TASK_NAMES
from clipbench.tasks.arith import ARITH_DEFAULTS as _ARITH
from clipbench.tasks.arith import FORMATS, MAX_DIGITS, MAX_OPERANDS, VALID_OPS
from clipbench.tasks.templates import TEMPLATE_CHOICES

# The mirrors of the results store a run may log to (`tracking.sinks`; clipbench.tracking implements each).
SINKS = ("mlflow", "wandb", "tensorboard")


# ---- components: the typed slots ---------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """A component of a run: its name in its registry and its parameters (the registry's defaults
    filled in once validated). A RunConfig holds one in each of its four slots (`SLOTS`):
    ``cfg.objective.name``, ``cfg.objective["eps_high"]``, ``cfg.train.agg.name``."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, param: str) -> Any:
        """The value of one parameter."""
        return self.params[param]

    def one_form(self) -> dict[str, Any]:
        """The component in the one YAML form: ``{"name": ..., <param>: ...}``."""
        return {"name": self.name, **self.params}


@dataclass(frozen=True)
class SlotDecl:
    """Where a component slot lives in the run config and how it is stored.

    The one YAML form of every slot is ``<key>: {name: <component>, <param>: <value>, ...}`` (a
    sweep's axes: ``<key>.name`` and ``<key>.<param>``). The stored form (what `to_dict` returns, the
    manifest records and the run id hashes) is the older one, unchanged so that every run id and
    results store stays valid: the name under ``name_key`` (``method`` for the objective), and a
    bare name for the slots whose components take no parameters (``bare``)."""

    slot: str  # the slot's own name: objective | correction | aggregation | advantage
    key: str  # its dotted place in the run config
    noun: str  # what one of its components is called in a message ("unknown method 'grpoo'")
    name_key: str = "name"  # the stored form's key of the name
    bare: bool = False  # stored as the bare name: its components take no parameters
    help: str = ""

    @property
    def spellings(self) -> tuple[str, ...]:
        """The keys that name the component inside the slot's mapping: ``name``, then the older
        ``name_key`` (``method`` for the objective)."""
        return tuple(dict.fromkeys(("name", self.name_key)))

    @property
    def name_path(self) -> str:
        """The dotted key of the name in the stored form (a sweep point's key)."""
        return self.key if self.bare else f"{self.key}.{self.name_key}"

    def name_keys(self) -> tuple[str, ...]:
        """Every dotted key that names the component (the one form's first)."""
        return tuple(dict.fromkeys((f"{self.key}.name", self.name_path)))


SLOTS: dict[str, SlotDecl] = {
    d.slot: d
    for d in (
        SlotDecl("objective", "objective", "method", name_key="method", help="the clipping rule (`clipbench methods`)"),
        SlotDecl(
            "correction",
            "sampler.correction",
            "correction",
            help="the sampler/trainer correction (needs old_logp: recompute)",
        ),
        SlotDecl("aggregation", "train.agg", "aggregation", bare=True, help="how token losses reduce to the loss"),
        SlotDecl("advantage", "train.advantage", "advantage", bare=True, help="the advantage estimator"),
    )
}


def slot_of(key: str) -> tuple[SlotDecl, str | None] | None:
    """(the slot, the parameter) a dotted key names: ``None`` parameter for the component's name;
    None when the key is outside every slot."""
    for decl in SLOTS.values():
        if key in decl.name_keys():
            return decl, None
        if not decl.bare and key.startswith(decl.key + "."):
            return decl, key[len(decl.key) + 1 :]
    return None


# ---- the fields: type, default, allowed values and help, declared together ------------------------
#
# Every leaf of RunConfig that is neither a bool, a component `Slot` (checked against its registry:
# its name and its component's parameters) nor free-form (`trl`: TRL's GRPOConfig fields, checked by
# TRL) declares its values beside its default: a `check` (Range, Each, Text,
# Source), closed `choices` this schema owns, or a closed list owned by a package below config
# (`owner`, read by `choices()` below). RANGES and CHOICES are derived from them.
MAX_STEPS = 1_000_000  # rollout steps (and optimizer/eval/checkpoint intervals)
MAX_TOKENS = 1 << 20  # new tokens per completion
MAX_BATCH = 1 << 16  # prompts per step, samples per prompt / problem, mini-batches


def declared(
    default: Any = MISSING,
    check: Range | Each | Text | Source | None = None,
    help: str = "",  # noqa: A002  (the field's help, as argparse names it)
    *,
    choices: tuple[str, ...] | None = None,
    owner: str | None = None,
    factory: Any = None,
) -> Any:
    """A field of the run config with its declaration beside it: ``check`` (its values), closed
    ``choices`` (this schema's) or ``owner`` (the package below config whose closed list it is:
    `choices()` reads it there), and ``help``. ``factory``: a default_factory."""
    meta = {"check": check, "choices": choices, "owner": owner, "help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name: str = declared("builtin:arith-tiny", Source(builtin=True), "HF name, local path, or builtin:<name>")
    dtype: str = declared(
        "float32",
        help="compute dtype; bfloat16/float16 train with float32 master weights + autocast",
        choices=("float32", "bfloat16", "float16", "auto"),
    )
    device: str = declared("auto", help="auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
    gradient_checkpointing: bool = declared(False, help="recompute activations in the backward")
    routing_replay: str = declared(
        "none",
        help="mixture-of-experts models: the experts the update's forwards use. none: the live router's; "
        "r2: those the old-log-prob forward chose; r3: those the sampler chose (clipbench.models.routing)",
        choices=("none", "r2", "r3"),  # clipbench.models.routing, clipbench.train.step
    )


@dataclass
class TaskConfig:
    name: str = declared("arith", help="arith | math", owner="clipbench.tasks")
    path: str | None = declared(None, Source(none=True), "math: .jsonl/.parquet file, directory, or HF dataset name")
    config: str | None = declared(None, Text(none=True), "math: the HF dataset's config name (e.g. 'all')")
    split: str = declared("train", Text(max_len=200), "the dataset split to train on")
    template: str = declared(
        "auto", help="auto: dapo for math, the task's own format for arith", owner="clipbench.tasks.templates"
    )
    limit: int | None = declared(None, Range(1, None, none=True), "cap on training problems")
    holdout: int = declared(0, Range(0, 10**8), "math: problems held out of the training file as its test split")
    # arith knobs (ignored by math): defaults and checks owned by clipbench.tasks.arith.ArithKnobs
    operands: int = declared(_ARITH.operands, Range(2, MAX_OPERANDS), "arith: operands per problem")
    digits: int = declared(_ARITH.digits, Range(1, MAX_DIGITS), "arith: digits per operand")
    ops: str = declared(_ARITH.ops, Text(alphabet=VALID_OPS), "arith: the operators drawn from")
    format: str = declared(
        _ARITH.format,
        help='arith: answer: "37+45=" -> "82"; steps: worked steps, then "#<answer>"',
        owner="clipbench.tasks.arith",
    )
    train_size: int = declared(_ARITH.train_size, Range(1, 10**8), "arith: training problems")
    test_size: int = declared(_ARITH.test_size, Range(1, 10**7), "arith: held-out problems")


@dataclass
class SamplerConfig:
    backend: str = declared(
        "auto",
        help="auto: vllm when installed and a GPU is present, else hf",
        choices=("auto", "hf", "vllm"),  # clipbench.rollout implements each
    )
    group_size: int = declared(8, Range(1, MAX_BATCH), "G samples per prompt")
    max_new_tokens: int = declared(32, Range(1, MAX_TOKENS), "new tokens per completion at most")
    temperature: float = declared(1.0, Range(0.0, 10.0, lo_open=True), "sampling temperature")
    top_p: float = declared(1.0, Range(0.0, 1.0, lo_open=True), "nucleus sampling mass")
    old_logp: str = declared(
        "recompute",
        help="recompute: the training policy once per rollout; sampler: the backend's",
        choices=("recompute", "sampler"),
    )
    prompts_per_call: int = declared(
        0,
        Range(0, MAX_BATCH),
        "prompts per generate call (0: all of a rank's prompts in one call): memory and speed only; "
        "each prompt's samples are drawn from its own seed (seed, step, its global index), so the "
        "completions do not depend on the call size or on how many processes sample",
    )
    gpu_memory_utilization: float = declared(0.3, Range(0.0, 1.0, lo_open=True), "vllm only")
    sleep_mode: bool = declared(
        False, help="vllm on CUDA: the engine sleeps while the trainer updates (frees its share)"
    )
    lag: int = declared(
        0,
        Range(0, MAX_STEPS),
        "policy lag k: each rollout batch is sampled by the policy as it was k rollout steps earlier (the "
        "first k steps by the oldest there is, the base model), as an asynchronous trainer's stale "
        "workers do; 0: on-policy sampling. The ratio's reference is old_logp's (sampler: the behaviour "
        "policy; recompute: the current policy, the behaviour gap through sampler.correction)",
    )
    correction: Slot = declared(
        factory=lambda: Slot("none"),
        help="the sampler/trainer correction (needs old_logp: recompute): {name: <correction>, <param>: ...}, "
        "its parameters' defaults from clipbench.objectives.corrections (`clipbench methods` lists them)",
    )


@dataclass
class OverlongConfig:
    enabled: bool = declared(False, help="DAPO overlong reward shaping")
    buffer: int = declared(8, Range(1, MAX_TOKENS), "soft penalty over the last `buffer` tokens before max_new_tokens")
    penalty: float = declared(
        1.0, Range(0.0, 1000.0), "reward - penalty * (len - (max - buffer)) / buffer; truncated: -penalty"
    )


@dataclass
class RecordConfig:
    """Recording of the rule's inputs for `clipbench replay` (docs/replay.md). Outside the run's
    identity (config.identity.NOT_IN_ID): it observes the run, it does not change what it computes."""

    every: int = declared(
        0, Range(0, MAX_STEPS), "record rollout steps 0, N, 2N, ... (every optimizer step of each); 0 = off"
    )
    state: str = declared(
        "auto",
        help="the policy and optimizer before recorded optimizer steps (parameter-level replay): last = "
        "before the last optimizer step of each recorded rollout step, all = before each, none; auto: "
        "last on engine builtin, none elsewhere",
        choices=("auto", "none", "last", "all"),  # clipbench.train.record reads it
    )
    max_mb: int = declared(
        1024, Range(1, 1 << 30), "a run's records stop growing here (a record that would pass it is skipped)"
    )


@dataclass
class TrainConfig:
    steps: int = declared(40, Range(1, MAX_STEPS), "rollout steps")
    prompts_per_step: int = declared(8, Range(1, MAX_BATCH), "P: prompts per rollout step")
    mini_batches: int = declared(
        4, Range(1, MAX_BATCH), "optimizer steps per rollout batch (and epoch): >1 makes updates off-policy"
    )
    epochs: int = declared(1, Range(1, 1000), "passes over each rollout batch")
    lr: float = declared(1e-6, Range(0.0, 1.0, lo_open=True), "AdamW learning rate")
    weight_decay: float = declared(0.0, Range(0.0, 1.0), "AdamW weight decay")
    betas: list[float] = declared(
        factory=lambda: [0.9, 0.999], check=Each(Range(0.0, 1.0, hi_open=True), length=2), help="AdamW betas"
    )
    warmup_steps: int = declared(0, Range(0, MAX_STEPS * 1000), "optimizer steps of linear warmup")
    lr_schedule: str = declared(
        "constant",
        help="constant | cosine (to 0 over all optimizer steps, after warmup)",
        choices=("constant", "cosine"),
    )
    advantage: Slot = declared(
        factory=lambda: Slot("group"), help="the advantage estimator (a slot)", owner="clipbench.objectives.advantages"
    )
    agg: Slot = declared(
        factory=lambda: Slot("token-mean"),
        help="how token losses reduce to the loss (a slot)",
        owner="clipbench.objectives",
    )
    beta: float = declared(0.0, Range(0.0, 1000.0), "KL-to-reference weight (k3); 0 keeps no reference model")
    grad_clip: float = declared(
        1.0, Range(0.0, 1e6), "max global gradient norm; 0 = no clipping (the norm is still logged)"
    )
    router_aux_loss_coef: float = declared(
        0.0,
        Range(0.0, 1000.0),
        "mixture-of-experts models: weight of the routers' load-balancing loss (Switch Transformer's, as "
        "transformers computes it) added to the policy loss; 0 = none (verl's RL default; TRL's is the "
        "model config's). Logged as router_aux_loss when non-zero. A dense model refuses a non-zero value",
    )
    max_skipped_frac: float = declared(
        0.1, Range(0.0, 1.0), "the run fails once more than this share of its optimizer steps is skipped"
    )
    micro_batch_tokens: int = declared(
        0,
        Range(0, 1 << 40),
        "token budget of one forward/backward (rows x padded prompt+completion width); 0 = the whole "
        "mini-batch. Gradients accumulate over micro-batches: the loss and gradient are the mini-batch's",
    )
    dynamic_sampling: bool = declared(False, help="DAPO: drop all-equal groups, draw more prompts")
    max_resample_rounds: int = declared(3, Range(0, 100), "cap on extra draws per step when dynamic_sampling")
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    checkpoint_every: int = declared(10, Range(1, MAX_STEPS), "rollout steps between checkpoints (and at the end)")
    log_histograms: bool = declared(True, help="log the log-ratio histograms")
    record: RecordConfig = field(default_factory=RecordConfig)


@dataclass
class EvalConfig:
    every: int = declared(
        0, Range(0, MAX_STEPS), "rollout steps between evaluations; 0 = only at the start and the end"
    )
    benchmarks: list[str] = declared(
        factory=lambda: ["arith"], help="benchmarks to evaluate on", owner="clipbench.tasks.benchmarks"
    )
    n: int = declared(8, Range(1, MAX_BATCH), "samples per problem")
    n_ends: int | None = declared(
        None,
        Range(1, MAX_BATCH, none=True),
        "samples per problem at the first and the last evaluation (the endpoints: Avg@n and Pass@k up to "
        "this n); null: n. The evaluations between use n (curves)",
    )
    limit: int | None = declared(64, Range(1, None, none=True), "problems per benchmark (null = all)")
    data_dir: str | None = declared(
        None, Source(hub=False, dir_only=True, none=True), "local copies of the benchmarks (else HF dataset names)"
    )
    temperature: float = declared(1.0, Range(0.0, 10.0, lo_open=True), "sampling temperature")
    top_p: float = declared(1.0, Range(0.0, 1.0, lo_open=True), "nucleus sampling mass")
    max_new_tokens: int | None = declared(
        None, Range(1, MAX_TOKENS, none=True), "new tokens per completion (null: sampler.max_new_tokens)"
    )
    at_start: bool = declared(True, help="evaluate the base model before the first step")


@dataclass
class TrackingConfig:
    mlflow: bool = declared(True, help="mirror the run to MLflow")
    tracking_uri: str | None = declared(
        None, Text(none=True), "default: MLFLOW_TRACKING_URI, else sqlite in the results dir"
    )
    experiment: str = declared("clipbench", Text(max_len=500), "the MLflow experiment (wandb: the project)")
    batch_every: int = declared(10, Range(1, MAX_STEPS), "optimizer steps per MLflow log_batch")
    sinks: list[str] = declared(
        factory=lambda: ["mlflow"],
        check=Each(Text(), choices=SINKS, unique=True),
        help="the mirrors: mlflow (unless mlflow: false), wandb, tensorboard (extras; clipbench.tracking.sinks)",
    )


@dataclass
class LaunchConfig:
    nproc_per_node: int = declared(
        1,
        Range(1, 4096),
        "processes per node: > 1 trains one run over N torchrun processes (FSDP2). Where a run computes, "
        "not what: outside the run's identity (config.identity.NOT_IN_ID), so a run may resume on another N",
    )
    preempt_signal: str = declared(
        "SIGTERM",
        help="SIGTERM asks a run to finish its optimizer step, checkpoint and stop (status preempted, "
        "resumable); SIGUSR1 / SIGUSR2 too when named here (SLURM: sbatch --signal=USR1@120)",
        choices=("SIGTERM", "SIGUSR1", "SIGUSR2"),  # clipbench.train.preempt.SIGNALS
    )
    gpu: str | None = declared(
        None,
        Text(none=True, max_len=100),
        "the GPU the recipe is written for (e.g. H200), shown with launch.gpu_memory by clipbench plan "
        "and rehearse; a label only, outside the run's identity",
    )
    gpu_memory: float | None = declared(
        None,
        Range(0.0, 1e6, lo_open=True, none=True),
        "GiB of memory of each of the recipe's GPUs (launch.nproc_per_node of them per node): what "
        "clipbench plan and rehearse plan on unless --gpu-memory (null: 80, clipbench.memory.plan). The "
        "recipe's target, not a check of this machine (the preflight plans on the GPU a run starts on); "
        "outside the run's identity",
    )


@dataclass
class RunConfig:
    seed: int = declared(0, Range(0, 2**63 - 1), "the run's seed (every random draw derives from it)")
    name: str | None = declared(
        None, Text(none=True, max_len=200), "display name; the run_id is a hash of the resolved config"
    )
    engine: str = declared(
        "builtin", help="which engine trains the run: `clipbench engines` (clipbench.engines) lists them"
    )
    trl: dict[str, Any] = declared(factory=dict, help="engine trl: extra GRPOConfig fields (deepspeed, vllm_mode, ...)")
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    objective: Slot = declared(
        factory=lambda: Slot("grpo"),
        help="the clipping rule: {name: <method>, <param>: ...} (a slot), its defaults from clipbench.objectives.METHODS",
    )
    plugins: list[str] = declared(
        factory=list,
        check=Each(Text()),
        help="user rule files (.py, relative to the recipe) or modules, imported before objective.name is checked",
    )
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def is_section(hint: Any) -> bool:
    """Whether a field's type is a section of the run config (a dataclass of fields), not a leaf
    (a value, or a component `Slot`)."""
    return is_dataclass(hint) and hint is not Slot


def declarations() -> dict[str, dict[str, Any]]:
    """{dotted leaf key: its declaration (check, choices, owner, help)}, in schema order."""

    out: dict[str, dict[str, Any]] = {}

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if is_section(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            else:
                out[prefix + f.name] = dict(f.metadata)

    walk(RunConfig, "")
    return out


# Derived from the declarations above (their one place): the checks and the schema's closed lists.
RANGES: dict[str, Range | Each | Text | Source] = {k: d["check"] for k, d in declarations().items() if d.get("check")}
CHOICES: dict[str, tuple[str, ...]] = {k: d["choices"] for k, d in declarations().items() if d.get("choices")}


@functools.lru_cache(maxsize=1)
def choices() -> dict[str, tuple[str, ...]]:
    """Every closed choice of the run config: the schema's own (`CHOICES`) and the lists owned by
    the packages a key configures (read from there, never copied; the `owner` of a declaration)."""
    # PLC0415, deferred: torch is heavy
    from clipbench.objectives import AGGREGATIONS  # noqa: PLC0415
    from clipbench.objectives.advantages import ADVANTAGES  # noqa: PLC0415

    return {
        **CHOICES,
        "task.name": tuple(TASK_NAMES),
        "task.template": tuple(TEMPLATE_CHOICES),
        "task.format": FORMATS,
        "train.agg": tuple(AGGREGATIONS),
        "train.advantage": tuple(ADVANTAGES),
    }


def value_at(cfg: RunConfig, key: str) -> Any:
    """The value at the dotted `key` of a RunConfig (``value_at(cfg, "train.lr")``)."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def leaf_keys() -> tuple[str, ...]:
    """Every dotted leaf key of RunConfig, in schema order (each component slot is one key, checked
    against its registry; 'trl' is one free-form mapping, TRL's GRPOConfig fields)."""
    return tuple(declarations())
