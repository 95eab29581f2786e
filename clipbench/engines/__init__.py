"""Engines: what trains a run. One table of them, one check of a run config against its engine, one
preflight every command runs, one `train_run`. Nothing below this package knows which engines exist.

    from clipbench.engines import ENGINES, check, preflight, train_run
    check(cfg, source)         # ConfigError: an unknown engine, or a key the run's engine refuses as set
    preflight(cfg)             # before anything is written: check, model, task, benchmarks, sleep mode, memory
    train_run(cfg, run_dir, resume=..., sink=..., progress=..., dist=...) -> summary

    builtin   clipbench's GRPO loop (clipbench.train.loop)
    trl       TRL's GRPOTrainer with the run's rule as its loss (engines/trl.py, integrations/trl.py)
    verl      one verl trainer command per run, submitted by `clipbench sweep --engine verl`
              (engines/verl.py; the losses in verl's registry: integrations/verl.py)

Which run-config keys each engine honours, maps or refuses is engines/keys.py; `clipbench engines`
prints it. `clipbench train`, `clipbench sweep` (before its manifest is written) and `clipbench
rehearse` all run `preflight`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clipbench.engines.keys import KEYS, refusals
from clipbench.errors import ConfigError, unknown_choice


@dataclass(frozen=True)
class Engine:
    name: str
    description: str
    in_process: bool  # trains inside a clipbench process (`engine: NAME` in a run config); else launched apart


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("builtin", "clipbench's GRPO loop: micro-batched, FSDP2 over torchrun, HF or vLLM sampling", True),
        Engine("trl", "TRL's GRPOTrainer with the run's rule as its loss, writing clipbench's results store", True),
        Engine("verl", "verl's trainer (`clipbench sweep --engine verl`: one verl command per run; GPUs, Ray)", False),
    )
}
RUN_ENGINES = tuple(name for name, e in ENGINES.items() if e.in_process)  # the values of a run config's `engine`


def check(cfg, source: str | None = None, *, engine: str | None = None) -> None:
    """ConfigError naming the key when `engine` (default: the run config's) cannot run `cfg` as set:
    an unknown engine, a refused key (engines/keys.py), or an engine's own check of several keys."""
    name = engine or cfg.engine
    if engine is None and name not in RUN_ENGINES:
        raise ConfigError(
            source,
            "engine",
            unknown_choice("engine", name, RUN_ENGINES)
            + (
                "; verl runs a sweep's runs as verl commands: clipbench sweep FILE --engine verl"
                if name == "verl"
                else ""
            ),
        )
    for key, reason in refusals(cfg, name):
        raise ConfigError(source, key, f"engine '{name}' cannot honour it: {reason}")
    if name == "trl":
        from clipbench.engines.trl import check_config

        check_config(cfg, source)


def preflight(cfg, source: str | None = None) -> None:
    """Everything that can fail before a run writes anything, one UserError (exit 2) naming what:
    the engine's keys, sleep mode (CUDA), the sampler backend (vllm installed), the model's config,
    the task, the benchmarks, and on a GPU whether the run fits its memory over
    launch.nproc_per_node ranks (vLLM on every rank included)."""
    import torch

    from clipbench.eval.suite import eval_suite
    from clipbench.memory.estimator import GIB
    from clipbench.memory.plan import check_fits
    from clipbench.models import check_model_config, is_moe, resolve_model_name
    from clipbench.rollout import check_backend, check_sleep_mode, resolve_backend
    from clipbench.tasks import build_run_task

    check(cfg, source)
    check_sinks(cfg)
    check_plugin_code(cfg)
    backend = resolve_backend(cfg.sampler.backend)
    check_sleep_mode(cfg.sampler.sleep_mode, backend)  # the GPU-only part first: one line on a CPU machine
    check_backend(backend)
    check_model_config(cfg.model.name)
    check_routing_replay(cfg, source, backend)
    if cfg.train.router_aux_loss_coef and not is_moe(cfg.model.name):
        raise ConfigError(
            source,
            "train.router_aux_loss_coef",
            f"'{cfg.model.name}' is a dense model (no router "
            f"to balance); set it to 0 or train a mixture-of-experts model",
        )
    eval_suite(cfg, build_run_task(cfg))
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        check_fits(
            cfg,
            resolve_model_name(cfg.model.name),
            world_size=cfg.launch.nproc_per_node,
            device_gib=total / GIB,
            backend=backend,
        )


def check_plugin_code(cfg) -> None:
    """The run's own rule and sampler correction, when they are plugins, called once on a tiny batch
    (4 rows of 3 tokens, a gradient through the rule): one that raises or returns the wrong shape
    fails here in one line naming it and its file, before anything is written (the built-ins are
    the test suite's)."""
    import torch

    from clipbench.config.load import slot
    from clipbench.objectives import METHODS, policy_loss
    from clipbench.objectives.corrections import NONE, apply_correction, get_correction

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 3, generator=g)  # (B, T)
    logp = (old + 0.3 * torch.randn(4, 3, generator=g)).requires_grad_(True)
    mask, A = torch.ones(4, 3), torch.tensor([1.0, -1.0, 0.5, -0.5])  # (B,)
    rule = slot(cfg, "objective")
    if METHODS[rule.name].origin is not None:
        out = policy_loss(
            rule.name,
            logp,
            old,
            A,
            mask,
            generator=g,
            rewards=A,
            entropy=torch.rand(4, 3, generator=g),
            groups=torch.tensor([0, 0, 1, 1]),
            **rule.params,
        )
        out.loss.backward()
    correction = slot(cfg, "correction")
    if correction.name != NONE and get_correction(correction.name).origin is not None:
        apply_correction({"name": correction.name, **correction.params}, old, logp.detach(), mask)


def check_sinks(cfg) -> None:
    """UserError naming the fix when a mirror in tracking.sinks is not installed here (never ignored)."""
    from clipbench.errors import UserError
    from clipbench.tracking.sinks import missing_package

    for name in cfg.tracking.sinks:
        fix = missing_package(name)
        if fix:
            raise UserError(f"tracking.sinks: '{name}' is not installed here; {fix} (or drop it from tracking.sinks)")


def check_routing_replay(cfg, source: str | None, backend: str) -> None:
    """model.routing_replay: a model whose routers it knows; r3 with a sampler that reports routes."""
    from clipbench.models import text_config
    from clipbench.models.routing import REPLAY_TYPES

    mode = cfg.model.routing_replay
    if mode == "none":
        return
    model_type = getattr(text_config(cfg.model.name), "model_type", None)
    if model_type not in REPLAY_TYPES:
        raise ConfigError(
            source,
            "model.routing_replay",
            f"'{cfg.model.name}' ({model_type}) has no router it knows: "
            f"routing replay runs on the mixture-of-experts models {', '.join(REPLAY_TYPES)}",
        )
    if mode == "r3" and backend == "vllm":
        from clipbench.rollout.vllm_engine import routed_experts_error

        if why := routed_experts_error():
            raise ConfigError(source, "model.routing_replay", why)


def train_run(
    cfg,
    run_dir: Path,
    *,
    resume: bool = False,
    sink=None,
    progress: Callable[[dict], None] | None = None,
    dist=None,
    stop=None,
) -> dict:
    """Train one run into `run_dir` with its engine; returns the run's summary (see run_training).
    `dist`: this process's place in a torchrun launch (clipbench.train.distributed; the built-in loop);
    `stop`: its preemption request (clipbench.train.preempt; the built-in loop)."""
    if cfg.engine == "trl":
        from clipbench.engines.trl import run_trl

        return run_trl(cfg, run_dir, resume=resume, sink=sink, progress=progress)
    from clipbench.train.loop import run_training
    from clipbench.train.preempt import NO_STOP

    return run_training(cfg, run_dir, resume=resume, sink=sink, progress=progress, dist=dist, stop=stop or NO_STOP)


__all__ = ["ENGINES", "Engine", "KEYS", "RUN_ENGINES", "check", "preflight", "train_run"]
