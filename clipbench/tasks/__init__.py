"""Tasks: problems, prompts and rewards.

``build_run_task(run_config)`` is the one way a run's task is built (the trainer, its evaluation and
``clipbench eval <run_dir>`` all call it, so they see the same splits); ``build_task(task_cfg, seed=)``
builds one from a ``task`` section alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from clipbench.errors import ConfigError
from clipbench.registry import Registry
from clipbench.tasks.arith import ArithKnobs, ArithTask
from clipbench.tasks.base import Problem, Task

__all__ = ["Problem", "Task", "TASKS", "TASK_NAMES", "build_run_task", "build_task"]


def _get(cfg: Any, key: str, default=None):
    """``cfg.key`` or ``cfg[key]`` (dataclass, DictConfig or mapping); ``default`` when absent/None."""
    if isinstance(cfg, Mapping):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def build_run_task(config: Any) -> Task:
    """The task of a run: its ``task`` section drawn with the run's ``seed``. ``config`` is a
    ``RunConfig`` or its dict (a run directory's ``config.yaml``); missing keys take their defaults."""
    return build_task(_get(config, "task", {}), seed=_get(config, "seed", 0))


def build_task(task_cfg: Any, *, seed: int | None = None) -> Task:
    """The task named by ``task_cfg.name``. ``seed`` (the run seed) draws arith's problems and
    math's held-out slice (0 when not given). Prefer ``build_run_task`` for a run."""
    return TASKS.lookup(_get(task_cfg, "name"))(task_cfg, seed or 0)


def build_arith(task_cfg: Any, seed: int) -> Task:
    knobs = {k: _get(task_cfg, k) for k in ArithKnobs.names()}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    try:
        return ArithTask(seed=seed, **knobs)
    except ValueError as e:
        raise ConfigError(None, "task", str(e)) from None


def build_math(task_cfg: Any, seed: int) -> Task:
    from clipbench.tasks.math import MathTask  # noqa: PLC0415 - tasks.math pulls in numpy

    path = _get(task_cfg, "path")
    if not path:
        raise ConfigError(
            None,
            "task.path",
            "required for task 'math' (a .jsonl/.json/.parquet file, a directory, or a Hugging Face dataset name)",
        )
    kwargs = {k: _get(task_cfg, k) for k in ("split", "template", "limit", "config", "holdout")}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return MathTask.from_source(path, seed=seed, **kwargs)


# `task.name`: name -> builder(task section, run seed) -> Task.
TASKS: Registry[Callable[[Any, int], Task]] = Registry("task")
TASKS.register("arith", build_arith)
TASKS.register("math", build_math)
TASK_NAMES = TASKS.names()
