"""`engine: builtin`: clipbench's own GRPO loop (clipbench.train.loop), registered in engines/__init__.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from clipbench.integrations.feeds import GROUPS, Feeds

# What the loop feeds clipbench's loss (integrations/feeds.py): the given rule inputs of the rollout
# (rewards and the sampler's log-probs: train/step.py StepInputs, filled by train/loop.py rule_inputs)
# and of each micro-batch's own forward (the entropy: step.accumulate_gradients), each row's prompt
# group; clipbench's own aggregation, correction and advantage code runs every registered one.
FEEDS = Feeds("the built-in loop", passes=("reward", "entropy", "rollout_logp", GROUPS))


def train(
    cfg,
    run_dir: Path,
    *,
    resume: bool = False,
    sink=None,
    progress: Callable[[dict], None] | None = None,
    dist=None,
    stop=None,
) -> dict:
    """`run_training` of the run: every process of a torchrun launch (`dist`), stopped at a safe point
    with a checkpoint by its preemption request (`stop`)."""
    # PLC0415, deferred: torch is heavy
    from clipbench.train.loop import run_training  # noqa: PLC0415
    from clipbench.train.preempt import NO_STOP  # noqa: PLC0415

    return run_training(cfg, run_dir, resume=resume, sink=sink, progress=progress, dist=dist, stop=stop or NO_STOP)
