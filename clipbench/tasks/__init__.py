"""Tasks: problems, prompts and rewards. ``build_task(cfg.task)`` is the entry point."""

from __future__ import annotations

from typing import Any, Mapping

from clipbench.errors import ConfigError, UserError, unknown_choice
from clipbench.tasks.base import Problem, Task

TASK_NAMES = ("arith", "math")
ARITH_KNOBS = ("seed", "operands", "digits", "ops", "train_size", "test_size")

__all__ = ["Problem", "Task", "TASK_NAMES", "build_task"]


def _get(cfg: Any, key: str, default=None):
    """``cfg.key`` or ``cfg[key]`` (dataclass, DictConfig or mapping); ``default`` when absent/None."""
    if isinstance(cfg, Mapping):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def build_task(task_cfg: Any, *, seed: int | None = None) -> Task:
    """The task named by ``task_cfg.name``. ``seed`` (the run seed) is used when the task config
    has none: arith's problem draw, math's held-out slice."""
    name = _get(task_cfg, "name")
    seed = _get(task_cfg, "seed", seed)
    if name == "arith":
        from clipbench.tasks.arith import ArithTask  # lazy: owned by the arith module

        knobs = {k: _get(task_cfg, k) for k in ARITH_KNOBS if k != "seed"}
        knobs = {k: v for k, v in knobs.items() if v is not None}
        if seed is not None:
            knobs["seed"] = seed
        try:
            return ArithTask(**knobs)
        except ValueError as e:
            raise ConfigError(None, "task", str(e)) from None
    if name == "math":
        from clipbench.tasks.math import MathTask

        path = _get(task_cfg, "path")
        if not path:
            raise ConfigError(None, "task.path", "required for task 'math' (a .jsonl/.json/.parquet "
                                                "file, a directory, or a Hugging Face dataset name)")
        kwargs = {k: _get(task_cfg, k) for k in ("split", "template", "limit", "config", "holdout")}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        return MathTask.from_source(path, seed=seed or 0, **kwargs)
    raise UserError(unknown_choice("task", name, TASK_NAMES))
