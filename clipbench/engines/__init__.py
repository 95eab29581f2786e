"""Engines: what trains a run. Each engine is one registered object (:class:`Engine`, in ``ENGINES``)
with one interface; nothing outside this package branches on an engine's name.

    from clipbench.engines import ENGINES, check, preflight, train_run
    check(cfg, source)         # ConfigError: an unknown engine, or a key the run's engine refuses as set
    preflight(cfg)             # before anything is written: check, model, task, benchmarks, sleep mode, memory
    train_run(cfg, run_dir, resume=..., sink=..., progress=..., dist=...) -> summary
    ENGINES.lookup("verl").submits   # launched apart: plan_runs / shell_line / check_launch / submit

    builtin   clipbench's GRPO loop (engines/builtin.py -> clipbench.train.loop)
    trl       TRL's GRPOTrainer with the run's rule as its loss (engines/trl.py, integrations/trl.py)
    verl      one verl trainer command per run, submitted by `clipbench sweep --engine verl`
              (engines/verl.py; the losses in verl's registry: integrations/verl.py)

An engine is a module (imported on first use, so `clipbench engines` imports no trainer) and one
registration below: its keys table (engines/keys.py), what its loss call feeds clipbench's loss
(its one `FEEDS` declaration, collected in engines/keys.py), and in its module either ``train(cfg, run_dir,
*, resume, sink, progress, dist, stop) -> summary`` (it trains inside a clipbench process: a run
config's ``engine`` may name it) or ``check_can_launch``, ``plan_runs``, ``shell_line`` and
``submit`` (it is launched apart: ``clipbench sweep --engine NAME``), and optionally
``check_config(cfg, source)``, its own check of several keys. docs/architecture.md, "Adding an
engine / a registry entry". `clipbench train`, `clipbench sweep` (before its manifest is written)
and `clipbench rehearse` all run `preflight`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from clipbench.engines.keys import FEEDS, KEYS, Support, refusals
from clipbench.errors import ConfigError, UserError, unknown_choice
from clipbench.registry import Registry
from clipbench.rollout import check_backend, check_sleep_mode, resolve_backend
from clipbench.tasks import build_run_task


@dataclass(frozen=True)
class Engine:
    """One engine: its name and description, the module that implements it (imported on first use),
    whether it trains inside a clipbench process, whether a signal stops it at a checkpoint (the
    run's launch.preempt_signal), and what to say when a run config names a launched-apart engine."""

    name: str
    description: str
    module: str
    in_process: bool  # trains inside a clipbench process (`engine: NAME` in a run config); else launched apart
    preemptible: bool = False  # a signal stops it at a safe point with a checkpoint (clipbench.train.preempt)
    hint: str = ""  # a run config that names a launched-apart engine: how to run it instead

    @property
    def keys(self) -> Mapping[str, Support]:
        """How it treats each run-config key (engines/keys.py)."""
        return KEYS[self.name]

    @property
    def feeds(self):
        """What its loss call feeds clipbench's loss (its one declaration: integrations/feeds.py)."""
        return FEEDS[self.name]

    @property
    def impl(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def submits(self) -> bool:
        """Launched apart: `clipbench sweep --engine NAME` plans its commands and submits them."""
        return not self.in_process

    def check(self, cfg, source: str | None = None) -> None:
        """ConfigError naming the key when this engine cannot run `cfg` as set: a refused key
        (engines/keys.py), or the engine's own check of several keys."""
        for key, reason in refusals(cfg, self.name):
            raise ConfigError(source, key, f"engine '{self.name}' cannot honour it: {reason}")
        own = getattr(self.impl, "check_config", None)
        if own is not None:
            own(cfg, source)

    def train(self, cfg, run_dir: Path, **kwargs: Any) -> dict:
        """Train one run into `run_dir` (see `train_run`)."""
        return self.impl.train(cfg, run_dir, **kwargs)

    # launched apart (submits): the verl engine's module
    def check_launch(self, launcher: str | None) -> None:
        self.impl.check_can_launch(launcher)

    def plan_runs(self, runs, **kwargs: Any) -> list[dict]:
        return self.impl.plan_runs(runs, **kwargs)

    def shell_line(self, cmd: list[str], env: dict[str, str], sep: str = " ") -> str:
        return self.impl.shell_line(cmd, env, sep)

    def submit(self, plans: list[dict], **kwargs: Any) -> list[dict]:
        return self.impl.submit(plans, **kwargs)


ENGINES: Registry[Engine] = Registry("engine")
for _e in (
    Engine(
        "builtin",
        "clipbench's GRPO loop: micro-batched, FSDP2 over torchrun, HF or vLLM sampling",
        "clipbench.engines.builtin",
        in_process=True,
        preemptible=True,
    ),
    Engine(
        "trl",
        "TRL's GRPOTrainer with the run's rule as its loss, writing clipbench's results store",
        "clipbench.engines.trl",
        in_process=True,
    ),
    Engine(
        "verl",
        "verl's trainer (`clipbench sweep --engine verl`: one verl command per run; GPUs, Ray)",
        "clipbench.engines.verl",
        in_process=False,
        hint="verl runs a sweep's runs as verl commands: clipbench sweep FILE --engine verl",
    ),
):
    ENGINES.register(_e.name, _e)
RUN_ENGINES = tuple(name for name, e in ENGINES.items() if e.in_process)  # the values of a run config's `engine`


def engine_of(cfg) -> Engine:
    """The engine a run config names (validated by `check`)."""
    return ENGINES.lookup(cfg.engine)


def check(cfg, source: str | None = None, *, engine: str | None = None) -> None:
    """ConfigError naming the key when `engine` (default: the run config's) cannot run `cfg` as set:
    an unknown engine, a refused key (engines/keys.py), or an engine's own check of several keys."""
    if engine is not None:
        ENGINES.lookup(engine).check(cfg, source)
        return
    found = ENGINES.get(cfg.engine)
    if found is None or not found.in_process:
        hint = f"; {found.hint}" if found is not None and found.hint else ""
        raise ConfigError(source, "engine", unknown_choice("engine", cfg.engine, RUN_ENGINES) + hint)
    found.check(cfg, source)


def preflight(cfg, source: str | None = None) -> None:
    """Everything that can fail before a run writes anything, one UserError (exit 2) naming what:
    the engine's keys, sleep mode (CUDA), the sampler backend (vllm installed), the model's config,
    the task, the benchmarks, and on a GPU whether the run fits its memory over
    launch.nproc_per_node ranks (vLLM on every rank included)."""
    # PLC0415, deferred: torch is heavy
    import torch  # noqa: PLC0415

    from clipbench.eval.suite import eval_suite  # noqa: PLC0415
    from clipbench.memory.estimator import GIB  # noqa: PLC0415
    from clipbench.memory.plan import check_fits  # noqa: PLC0415
    from clipbench.models import check_model_config, is_moe, resolve_model_name  # noqa: PLC0415

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
    import torch  # noqa: PLC0415 - torch is heavy

    # PLC0415, deferred: torch is heavy
    from clipbench.objectives import METHODS, RuleError, RuleInputs, bind  # noqa: PLC0415
    from clipbench.objectives.corrections import NONE, apply_correction, get_correction  # noqa: PLC0415
    from clipbench.objectives.inputs import GIVEN, TOKEN  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 3, generator=g)  # (B, T)
    logp = (old + 0.3 * torch.randn(4, 3, generator=g)).requires_grad_(True)
    mask, A = torch.ones(4, 3), torch.tensor([1.0, -1.0, 0.5, -0.5])  # (B,)
    rule = cfg.objective
    if METHODS[rule.name].origin is not None:
        given = {  # every given input (objectives.inputs.GIVEN), by its keyword: (B, T) or (B,)
            spec["keyword"]: torch.rand(4, 3, generator=g) if spec["shape"] == TOKEN else torch.rand(4, generator=g)
            for spec in GIVEN.values()
        }
        every_input = RuleInputs.of(
            logp=logp, old_logp=old, advantages=A, mask=mask, generator=g, groups=torch.tensor([0, 0, 1, 1]), **given
        )
        loss = bind(rule.name, rule.params)(every_input).loss
        if not torch.isfinite(loss):
            raise RuleError(
                f"rule '{rule.name}' ({METHODS[rule.name].where}) returned a non-finite loss ({float(loss.detach())}) on a "
                "small batch of ratios near 1 (4 rows of 3 tokens): training would skip every such step"
            )
        loss.backward()
    correction = cfg.sampler.correction
    if correction.name != NONE and get_correction(correction.name).origin is not None:
        apply_correction(correction.one_form(), old, logp.detach(), mask, advantages=A)


def check_sinks(cfg) -> None:
    """UserError naming the fix when a mirror in tracking.sinks is not installed here (never ignored)."""
    from clipbench.tracking.sinks import missing_package  # noqa: PLC0415 - tracking.sinks pulls in torch

    for name in cfg.tracking.sinks:
        fix = missing_package(name)
        if fix:
            raise UserError(f"tracking.sinks: '{name}' is not installed here; {fix} (or drop it from tracking.sinks)")


def check_routing_replay(cfg, source: str | None, backend: str) -> None:
    """model.routing_replay: a model whose routers it knows; r3 with a sampler that reports routes."""
    # PLC0415, deferred: torch is heavy
    from clipbench.models import text_config  # noqa: PLC0415
    from clipbench.models.routing import REPLAY_TYPES  # noqa: PLC0415

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
        # PLC0415, deferred: rollout.vllm_engine pulls in torch
        from clipbench.rollout.vllm_engine import routed_experts_error  # noqa: PLC0415

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
    return engine_of(cfg).train(cfg, run_dir, resume=resume, sink=sink, progress=progress, dist=dist, stop=stop)


__all__ = [
    "ENGINES",
    "Engine",
    "KEYS",
    "RUN_ENGINES",
    "check",
    "check_plugin_code",
    "engine_of",
    "preflight",
    "train_run",
]
