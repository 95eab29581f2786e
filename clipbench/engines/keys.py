"""Which run-config keys each engine honours, maps (to which of its own settings) or refuses: one table.

    KEYS["trl"]["train.lr"]           -> mapped: GRPOConfig.learning_rate
    refusals(cfg, "trl")              -> [(key, reason)] for the keys the engine cannot honour as set
    rows()                            -> (key, {engine: Support}) for `clipbench engines` and the docs
    feeds_rows()                      -> (what, {engine: text}): what each engine feeds clipbench's loss

Kinds:
    honoured  the engine does what the key says (clipbench's own code runs it: task, evaluation, tracking)
    mapped    the engine's own setting(s) that mean the same (`to`: the settings' names first, separated
              by ", " or " / ", then an optional " = formula" or " (note)"); some values may have no
              counterpart (`refuse`: the values refused, with the reason). tests/test_engines.py checks
              that changing the key changes the settings named, and only settings the entry mentions
    refused   the engine has no counterpart: any value other than the schema default is refused, so a
              key a user sets is never silently ignored; the reason says what the engine does instead

A component key (config.schema.SLOTS: objective, sampler.correction, train.agg, train.advantage) is
judged by what the engine feeds clipbench's loss (`FEEDS`, each engine's one declaration:
integrations/feeds.py): its refusals and the facts `clipbench engines` shows are derived from that
declaration and the registries' metadata, so a component registered later that the engine cannot
feed is refused here, at the preflight, and never named in this file.

Every leaf of the run config has an entry for every engine (tests/test_engines.py walks the schema).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clipbench.config.schema import SLOTS, EvalConfig, RunConfig, TaskConfig, TrackingConfig, leaf_keys, value_at
from clipbench.engines.builtin import FEEDS as BUILTIN_FEEDS
from clipbench.integrations.feeds import Feeds
from clipbench.integrations.trl_settings import FEEDS as TRL_FEEDS
from clipbench.integrations.verl_settings import FEEDS as VERL_FEEDS

# Every task.* key: both engines hand the whole task to clipbench's own loader and grader.
TASK_KEYS = tuple(f.name for f in dataclasses.fields(TaskConfig))
# Every eval.* and tracking.* key: clipbench's own evaluation and results store run them on engine trl.
EVAL_KEYS = tuple(f.name for f in dataclasses.fields(EvalConfig))
TRACKING_KEYS = tuple(f.name for f in dataclasses.fields(TrackingConfig))


@dataclass(frozen=True)
class Support:
    """How one engine treats one key (see the module docstring)."""

    kind: str  # "honoured" | "mapped" | "refused"
    detail: str = ""  # honoured: how; mapped: the engine's setting(s); refused: why
    refuse: Callable[[Any], bool] | None = None  # mapped/honoured: values with no counterpart
    why: str = ""  # ... and why they are refused
    feeds: Feeds | None = None  # a component key: what the engine feeds clipbench's loss (judges its Slot)
    slot: str = ""  # ... and the key's slot (config.schema.SLOTS)

    def problem(self, value: Any, default: Any) -> str | None:
        """Why `value` cannot run on this engine, or None."""
        if self.kind == "refused":
            return None if value == default else self.detail
        if self.feeds is not None:
            return self.feeds.refusal(self.slot, value.name, value.params)
        if self.refuse is not None and self.refuse(value):
            return self.why
        return None

    def describe(self) -> str:
        text = {"honoured": "honoured", "mapped": f"mapped: {self.detail}", "refused": f"refused: {self.detail}"}[
            self.kind
        ]
        if self.kind == "honoured" and self.detail:
            text += f" ({self.detail})"
        if self.refuse is not None:
            text += f"; refused: {self.why}"
        derived = self.feeds.describe(self.slot) if self.feeds is not None and self.kind != "refused" else ""
        return f"{text}; {derived}" if derived else text


def honoured(how: str = "", *, refuse: Callable[[Any], bool] | None = None, why: str = "") -> Support:
    return Support("honoured", how, refuse, why)


def mapped(to: str, *, refuse: Callable[[Any], bool] | None = None, why: str = "") -> Support:
    return Support("mapped", to, refuse, why)


def refused(why: str) -> Support:
    return Support("refused", why)


_OWN = "clipbench's own code runs it"


_TASK = "clipbench builds the task: prompts, reward, held-out split"
_EVAL = "clipbench's evaluation of the model"
_TRACK = "clipbench's results store and MLflow mirror"
_HARDWARE = "the recipe's GPUs for clipbench plan and rehearse; training does not read it"

# --- builtin: clipbench's GRPO loop honours every key ----------------------------------------------
BUILTIN: dict[str, Support] = {key: honoured() for key in leaf_keys()}
BUILTIN["trl"] = refused("GRPOConfig settings apply to engine trl")

# --- trl: TRL's GRPOTrainer with the run's rule (clipbench.engines.trl.grpo_args) -------------------
G = "GRPOConfig."
TRL: dict[str, Support] = {
    "seed": mapped(G + "seed"),
    "name": honoured(_TRACK),
    "engine": honoured(),
    "trl": mapped("extra GRPOConfig fields (those clipbench derives are refused)"),
    "model.name": honoured("clipbench loads the model and hands it to TRL"),
    "model.dtype": mapped(G + "bf16 / fp16 (auto: bfloat16 on a GPU that supports it)"),
    "model.device": mapped(G + "use_cpu (TRL derives dataloader_pin_memory from it)"),
    "model.gradient_checkpointing": mapped(G + "gradient_checkpointing"),
    **{f"task.{k}": honoured(_TASK) for k in TASK_KEYS},
    "sampler.backend": mapped(G + "use_vllm (TRL's colocated vLLM; auto: vllm when installed with a GPU)"),
    "sampler.group_size": mapped(
        G + "num_generations (and generation_batch_size, per_device_train_batch_size: "
        "a rollout step is prompts_per_step x group_size sequences)"
    ),
    "sampler.max_new_tokens": mapped(G + "max_completion_length"),
    "sampler.temperature": mapped(G + "temperature"),
    "sampler.top_p": mapped(G + "top_p"),
    "sampler.old_logp": honoured(
        "recompute: TRL recomputes the old log-probs",
        refuse=lambda v: v == "sampler",
        why="TRL recomputes the old log-probs itself (its importance-sampling correction is sampler.correction)",
    ),
    "sampler.prompts_per_call": refused("TRL samples a whole generation batch in one call"),
    "sampler.lag": refused(
        "TRL's GRPOTrainer samples each generation batch with the current policy (steps_per_generation "
        "reuses a batch, it does not sample it with an older policy)"
    ),
    "sampler.gpu_memory_utilization": mapped(G + "vllm_gpu_memory_utilization"),
    "sampler.sleep_mode": mapped(G + "vllm_enable_sleep_mode"),
    "sampler.correction": mapped(
        G
        + "vllm_importance_sampling_correction / "
        + G
        + "vllm_importance_sampling_mode / "
        + G
        + "vllm_importance_sampling_clip_min / "
        + G
        + "vllm_importance_sampling_clip_max (tis: "
        "token_truncate, sequence_truncate with clip_min = floor, clip_max = cap; icepop: "
        "token_mask, sequence_mask with clip_min = low, clip_max = high; none: no correction; "
        "TRL's ratio has no +-20 clamp, which only moves weights below e^-20)",
    ),
    "train.steps": mapped(G + "max_steps = steps x mini_batches x epochs"),
    "train.prompts_per_step": mapped(
        G + "generation_batch_size = prompts_per_step x group_size (and "
        "per_device_train_batch_size = that / (mini_batches x processes x "
        "gradient_accumulation_steps))"
    ),
    "train.mini_batches": mapped(
        G + "steps_per_generation = mini_batches x gradient_accumulation_steps (and "
        "per_device_train_batch_size, max_steps, save_steps)"
    ),
    "train.epochs": mapped(G + "num_iterations (and max_steps, save_steps: per rollout step)"),
    "train.lr": mapped(G + "learning_rate"),
    "train.weight_decay": mapped(G + "weight_decay"),
    "train.betas": mapped(G + "adam_beta1, adam_beta2"),
    "train.warmup_steps": mapped(G + "warmup_steps (and lr_scheduler_type: constant_with_warmup when > 0)"),
    "train.lr_schedule": mapped(G + "lr_scheduler_type"),
    "train.advantage": mapped(G + "scale_rewards (group: 'group', group_mean: 'none')"),
    "train.agg": honoured("ClipbenchGRPOTrainer(agg=...): clipbench's aggregation is TRL's loss"),
    "train.beta": mapped(G + "beta"),
    "train.grad_clip": mapped(G + "max_grad_norm (0: no clipping in both)"),
    "model.routing_replay": refused("TRL's GRPOTrainer has no routing replay; use engine builtin"),
    "train.router_aux_loss_coef": mapped(
        G + "router_aux_loss_coef (0: none, not the model config's; TRL adds "
        "transformers' load-balancing loss per forward, as the built-in loop)"
    ),
    "train.max_skipped_frac": refused(
        "TRL applies every optimizer step (it skips none whose gradient norm is "
        "not finite), so there is no skipped-step budget to enforce"
    ),
    "train.micro_batch_tokens": refused(
        "TRL's micro-batches are a fixed number of rows "
        "(per_device_train_batch_size), not a token budget: no exact counterpart "
        "(rows x padded length varies per batch); set trl.gradient_accumulation_"
        "steps=K for K micro-batches per optimizer step"
    ),
    "train.dynamic_sampling": refused("TRL has no DAPO dynamic sampling; use engine builtin"),
    "train.max_resample_rounds": refused("dynamic sampling is the built-in loop's"),
    "train.overlong.enabled": refused("TRL has no overlong reward shaping here; use engine builtin"),
    "train.overlong.buffer": refused("overlong reward shaping is the built-in loop's"),
    "train.overlong.penalty": refused("overlong reward shaping is the built-in loop's"),
    "train.checkpoint_every": mapped(G + "save_steps = checkpoint_every x mini_batches x epochs"),
    "train.log_histograms": honoured("ClipbenchGRPOTrainer counts the log-ratio histograms"),
    "train.record.every": honoured(
        "ClipbenchGRPOTrainer(record=...): its loss hook records every N-th generation batch (TRL's rollout step)"
    ),
    "train.record.state": honoured(
        "token level only",
        refuse=lambda v: v in ("last", "all"),
        why="the TRL engine records the rule's inputs, not the policy's state "
        "(parameter-level replay needs engine builtin)",
    ),
    "train.record.max_mb": honoured("ClipbenchGRPOTrainer(record=...) size cap"),
    "plugins": honoured("imported in every process"),
    **{f"eval.{k}": honoured(_EVAL) for k in EVAL_KEYS},
    **{f"tracking.{k}": honoured(_TRACK) for k in TRACKING_KEYS},
    "launch.nproc_per_node": honoured("torchrun processes (TRL's accelerate reads their environment)"),
    "launch.gpu": honoured(_HARDWARE),
    "launch.gpu_memory": honoured(_HARDWARE),
    "launch.preempt_signal": refused(
        "TRL's trainer has no preemption checkpoint (its generation buffer is not "
        "saved): a signal stops it; it resumes from its last checkpoint"
    ),
    "objective": honoured(
        "the rule is TRL's loss (ClipbenchGRPOTrainer); a rule's mini-batch statistic (bapo, "
        "m2po) is computed per TRL micro-batch, as the rules' sources do"
    ),
}

# --- verl: one verl trainer command per run (clipbench.engines.verl.verl_overrides) -----------------
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
_VERL_LOGS = "verl logs through its own loggers (the results store keeps the run's config and submission)"
VERL: dict[str, Support] = {
    "seed": mapped("data.seed, " + A + "data_loader_seed, " + R + "seed"),
    "name": honoured("the sweep's run labels"),
    "engine": honoured(),
    "trl": refused("GRPOConfig settings apply to engine trl"),
    "model.name": mapped("actor_rollout_ref.model.path"),
    "model.dtype": mapped(A + "fsdp_config.dtype, " + R + "dtype (auto: bfloat16)"),
    "model.device": honoured("verl's GPU workers", refuse=lambda v: v == "cpu", why="verl's trainer runs on GPUs"),
    "model.gradient_checkpointing": mapped("actor_rollout_ref.model.enable_gradient_checkpointing"),
    **{
        f"task.{k}": honoured("clipbench exports the task to verl's parquet format, graded by clipbench's reward")
        for k in TASK_KEYS
    },
    "sampler.backend": honoured(
        R + "name=vllm (auto: vllm on verl's GPUs)", refuse=lambda v: v == "hf", why="verl samples with vLLM"
    ),
    "sampler.group_size": mapped(R + "n"),
    "sampler.max_new_tokens": mapped(
        "data.max_response_length (and " + A + "loss_scale_factor, the fixed length of seq-mean-token-sum-norm)"
    ),
    "sampler.temperature": mapped(R + "temperature"),
    "sampler.top_p": mapped(R + "top_p"),
    "sampler.old_logp": honoured(
        "recompute: verl recomputes the old log-probs",
        refuse=lambda v: v == "sampler",
        why="not wired to verl's rollout-correction bypass mode",
    ),
    "sampler.prompts_per_call": refused("verl samples a whole batch per call"),
    "sampler.lag": refused(
        "verl's PPO trainer samples with the current policy; its asynchronous trainers (one-step-off-policy, "
        "fully-async) are other entry points, not launched by clipbench"
    ),
    "sampler.gpu_memory_utilization": mapped(R + "gpu_memory_utilization"),
    "sampler.sleep_mode": mapped(R + "free_cache_engine"),
    "sampler.correction": mapped(
        "algorithm.rollout_correction.rollout_is / algorithm.rollout_correction."
        "rollout_is_threshold (tis: level, cap; icepop: level, 'low_high'; kl_rs: "
        "algorithm.rollout_correction.rollout_rs, rollout_rs_threshold: <level>_<estimator>, "
        "'low_high' or max_kl); verl floors a token's weight at e^-20",
    ),
    "train.steps": mapped("trainer.total_training_steps"),
    "train.prompts_per_step": mapped(
        "data.train_batch_size (and " + A + "ppo_mini_batch_size = prompts_per_step / mini_batches)"
    ),
    "train.mini_batches": mapped(A + "ppo_mini_batch_size = prompts_per_step / mini_batches"),
    "train.epochs": mapped(A + "ppo_epochs"),
    "train.lr": mapped(A + "optim.lr"),
    "train.weight_decay": mapped(A + "optim.weight_decay"),
    "train.betas": mapped(A + "optim.betas"),
    "train.warmup_steps": mapped(A + "optim.lr_warmup_steps"),
    "train.lr_schedule": mapped(A + "optim.lr_scheduler_type"),
    "train.advantage": mapped("algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo"),
    "train.agg": mapped(A + "loss_agg_mode"),
    "train.beta": mapped(A + "use_kl_loss, " + A + "kl_loss_coef (kl_loss_type=low_var_kl: k3)"),
    "train.grad_clip": mapped(A + "grad_clip"),
    "model.routing_replay": refused(
        "verl's router replay (router_replay.mode) is for its Megatron and VeOmni "
        "engines; clipbench drives its FSDP actor: use engine builtin"
    ),
    "train.router_aux_loss_coef": refused(
        "not wired to verl: its FSDP actor gets no load-balancing loss from "
        "clipbench (0, verl's RL default, is what runs)"
    ),
    "train.max_skipped_frac": refused(
        "verl skips a step whose gradient norm is not finite but never fails a run for it"
    ),
    "train.micro_batch_tokens": mapped(
        A + "ppo_max_token_len_per_gpu (use_dynamic_bsz; not exact: verl "
        "counts the real tokens of a micro-batch, clipbench rows x padded length, "
        "so verl's micro-batches hold at least as many rows; 0: verl's default "
        "16,384)"
    ),
    "train.dynamic_sampling": refused("not wired to verl's DAPO recipe"),
    "train.max_resample_rounds": refused("dynamic sampling is the built-in loop's"),
    "train.overlong.enabled": refused("not wired to verl's DAPO overlong buffer"),
    "train.overlong.buffer": refused("overlong reward shaping is the built-in loop's"),
    "train.overlong.penalty": refused("overlong reward shaping is the built-in loop's"),
    "train.checkpoint_every": mapped("trainer.save_freq"),
    "train.log_histograms": refused(_VERL_LOGS),
    "train.record.every": mapped(
        "CLIPBENCH_RECORD_DIR (the run's record/) and CLIPBENCH_RECORD_MAX_MB: the registered loss records every call",
        refuse=lambda v: v not in (0, 1),
        why="verl's loss sees micro-batches, not rollout steps: 1 records every one",
    ),
    "train.record.state": honoured(
        "token level only",
        refuse=lambda v: v in ("last", "all"),
        why="verl's loss records the rule's inputs, not the policy's state "
        "(parameter-level replay needs engine builtin)",
    ),
    "train.record.max_mb": honoured("CLIPBENCH_RECORD_MAX_MB, set with train.record.every: 1"),
    "plugins": mapped("CLIPBENCH_PLUGINS (the workers' environment)"),
    "eval.every": mapped("trainer.test_freq"),
    "eval.benchmarks": honoured("exported as verl's validation set"),
    "eval.n": mapped(R + "val_kwargs.n"),
    "eval.n_ends": refused("verl validates every time with one n (eval.n)"),
    "eval.limit": honoured("exported as verl's validation set"),
    "eval.data_dir": honoured("exported as verl's validation set"),
    "eval.temperature": mapped(R + "val_kwargs.temperature"),
    "eval.top_p": mapped(R + "val_kwargs.top_p"),
    "eval.max_new_tokens": refused("verl validates with data.max_response_length (sampler.max_new_tokens)"),
    "eval.at_start": mapped("trainer.val_before_train"),
    "tracking.mlflow": mapped("trainer.logger (console, mlflow)"),
    "tracking.sinks": mapped("trainer.logger (console + mlflow, wandb, tensorboard: verl's own loggers)"),
    "tracking.tracking_uri": mapped("MLFLOW_TRACKING_URI (the workers' environment)"),
    "tracking.experiment": mapped("trainer.project_name"),
    "tracking.batch_every": refused(_VERL_LOGS),
    "launch.nproc_per_node": mapped("trainer.n_gpus_per_node"),
    "launch.gpu": honoured(_HARDWARE),
    "launch.gpu_memory": honoured(_HARDWARE),
    "launch.preempt_signal": refused(
        "verl's trainer handles signals itself (it resumes from its own checkpoints: trainer.resume_mode=auto)"
    ),
    "objective": mapped(
        A + "policy_loss.loss_mode, CLIPBENCH_RULE_PARAMS (loss_mode=clipbench.<method>; the "
        "parameters as JSON in the workers' environment, and verl's own fields where they mean the "
        "same: clip_ratio_low, clip_ratio_high, clip_ratio_c, clip_ratio (cfpo's eps), tau_pos, tau_neg, dro_beta, "
        "clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef; a rule's mini-batch "
        "statistic per verl micro-batch, as the rules' sources do)",
    ),
}

# What each engine feeds clipbench's loss: its one declaration (integrations/feeds.py), beside its loss call.
FEEDS: dict[str, Feeds] = {"builtin": BUILTIN_FEEDS, "trl": TRL_FEEDS, "verl": VERL_FEEDS}


def _judged(table: dict[str, Support], feeds: Feeds) -> dict[str, Support]:
    """The table with each component key (config.schema.SLOTS) judged by what the engine feeds."""
    slot_of = {decl.key: decl.slot for decl in SLOTS.values()}
    return {
        key: dataclasses.replace(support, feeds=feeds, slot=slot_of[key]) if key in slot_of else support
        for key, support in table.items()
    }


KEYS: dict[str, dict[str, Support]] = {
    name: _judged(table, FEEDS[name]) for name, table in (("builtin", BUILTIN), ("trl", TRL), ("verl", VERL))
}


def refusals(cfg: RunConfig, engine: str) -> list[tuple[str, str]]:
    """[(key, reason)] for every key of a resolved run config that `engine` cannot honour (a
    component's entry judges its `Slot`)."""
    defaults = RunConfig()
    out = []
    for key, support in KEYS[engine].items():
        problem = support.problem(value_at(cfg, key), value_at(defaults, key))
        if problem:
            out.append((key, problem))
    return out


def settings(support: Support) -> list[str]:
    """The engine settings a mapped entry names: its text up to " = ", " (" or ";", split on ", " and
    " / ", each without the "GRPOConfig." prefix or a "=value" suffix."""
    head = support.detail.split(" = ")[0].split(" (")[0].split(";")[0]
    names = [n.strip() for part in head.split(", ") for n in part.split(" / ")]
    return [n.removeprefix("GRPOConfig.").split("=")[0] for n in names if n]


def rows() -> list[tuple[str, dict[str, Support]]]:
    """One row per run-config key: {engine: how it treats the key} (objective: every engine runs
    clipbench's own rule)."""
    return [(key, {name: table[key] for name, table in KEYS.items()}) for key in leaf_keys()]


def feeds_rows() -> list[tuple[str, dict[str, str]]]:
    """What each engine feeds clipbench's loss, derived from its declaration (`FEEDS`) and the
    registries: the loss call, what it passes, and per component slot clipbench's own code or the
    engine's counterparts (what it has, what it refuses)."""
    out = [
        ("loss call", {name: feeds.call for name, feeds in FEEDS.items()}),
        ("passes (given rule inputs, prompt groups)", {name: feeds.passes_line() for name, feeds in FEEDS.items()}),
    ]
    for decl in SLOTS.values():
        cells = {}
        for name, feeds in FEEDS.items():
            mapped = feeds.mapped(decl.slot)
            whose = "clipbench's own" if mapped is None else mapped.setting
            derived = feeds.describe(decl.slot)
            sep = "; " if mapped is None else ": "  # clipbench's own; refused: ... | the engine's: has ...
            cells[name] = f"{whose}{sep}{derived}" if derived else f"{whose}: every registered one"
        out.append((f"{decl.key} ({decl.noun}s)", cells))
    return out
