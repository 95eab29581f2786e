"""clipbench inside the engines users already run, and the engines behind a run's `engine` key.

    clipbench.integrations.trl          ClipbenchGRPOTrainer: TRL's GRPOTrainer with a clipbench rule
    clipbench.integrations.trl_engine   `engine: trl`: a run trained by it, written to the results store
    clipbench.integrations.verl         every clipbench rule in verl's policy-loss registry

`train_run` is the one dispatch from a run config's `engine` to the code that trains it; `clipbench
train` and every sweep worker (local, joblib, Ray, submitit) call it. Nothing here imports TRL or verl
until an engine or integration that needs them is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def check_run(cfg, source: str | None = None) -> None:
    """Engine-specific checks of a validated RunConfig (ConfigError naming the key): the settings
    an engine cannot honour. Called before anything is written (train command, sweep expansion)."""
    if cfg.engine == "trl":
        from clipbench.integrations.trl_engine import check_config

        check_config(cfg, source)


def preflight(cfg) -> None:
    """Fail before anything is written: the engine's checks, then the model, task and benchmarks load."""
    from clipbench.train.loop import preflight as load_checks

    check_run(cfg)
    load_checks(cfg)


def train_run(cfg, run_dir: Path, *, resume: bool = False, sink=None,
              progress: Callable[[dict], None] | None = None, dist=None) -> dict:
    """Train one run into `run_dir` with its engine; returns the run's summary (see run_training).
    `dist`: this process's place in a torchrun launch (clipbench.train.distributed; the builtin loop)."""
    if cfg.engine == "trl":
        from clipbench.integrations.trl_engine import run_trl

        return run_trl(cfg, run_dir, resume=resume, sink=sink, progress=progress)
    from clipbench.train import loop

    return loop.run_training(cfg, run_dir, resume=resume, sink=sink, progress=progress, dist=dist)


__all__ = ["check_run", "preflight", "train_run"]
