"""A rollout step's metrics: statistics all-reduced over ranks and brought to the host once, one row
per optimizer step; rank 0 writes them to metrics.jsonl and the sink (train/loop.py calls these with
its Trainer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from clipbench.objectives import histogram_dict, reduce_sums
from clipbench.objectives.corrections import is_batch_metric
from clipbench.objectives.staleness import is_staleness_sum
from clipbench.train.batch import RolloutBatch
from clipbench.train.distributed import Dist
from clipbench.train.step import StepStats


def metric_rows(
    trainer, step: int, batch: RolloutBatch, done: list[dict], seconds: float, mismatch: dict | None = None
) -> list[dict]:
    """One row per optimizer step: the statistics all-reduced over ranks (one collective per
    reduction kind for every step) and brought to the host in one transfer per kind, finalised.
    `mismatch`: the rollout batch's, measured before an interruption (a resumed rollout step)."""
    reduced = reduce_sums([d["stats"].sums() for d in done], trainer.dist.all_reduce_, to="cpu")
    norms = torch.stack([d["grad_norm"] for d in done]).cpu().tolist()
    if mismatch is None:
        mismatch = {k: v for k, v in StepStats.metrics(reduced[0]).items() if rollout_metric(k)}
    return [
        {
            "step": step,
            "opt_step": d["opt_step"],
            "epoch": d["epoch"],
            "mini_batch": d["mini_batch"],
            "micro_batches": d["micro_batches"],
            **batch.metrics,
            **StepStats.metrics(r),
            "grad_norm": norm,
            "lr": d["lr"],
            "skipped_nonfinite": d["skipped_nonfinite"],
            "old_logp_source": 1 if trainer.cfg.sampler.old_logp == "sampler" else 0,
            **mismatch,  # the rollout batch's mismatch, correction and staleness, on each of its rows
            "time/update": seconds,
        }
        for d, r, norm in zip(done, reduced, norms)
    ]


def rollout_metric(key: str) -> bool:
    """A logged metric of the rollout batch as a whole (measured once, logged on each of its rows):
    the sampler/trainer mismatch and correction, the staleness (`offpolicy/*`)."""
    return is_batch_metric(key) or is_staleness_sum(key)


def sum_histogram(counts: torch.Tensor | None, dist: Dist) -> dict | None:
    """A rollout step's log-ratio counts summed over ranks, as the artifact's row (one transfer)."""
    if counts is None:
        return None
    return histogram_dict(dist.all_reduce_(counts.to(torch.float64)).round().long())


def log_step(trainer, step: int, rows: list[dict], hist: dict | None, progress: Callable[[dict], None] | None) -> None:
    """Rank 0: rows to metrics.jsonl and the sink, the histogram, the progress line."""
    if not trainer.dist.main:
        return
    trainer.rd.append_metrics(rows)
    if hist is not None:
        trainer.rd.append_hist([{"step": step, "opt_step": trainer.state["opt_step"], **hist}])
    for row in rows:
        trainer.sink.log_metrics(row["opt_step"], {k: v for k, v in row.items() if isinstance(v, (int, float))})
    if progress:
        progress(
            {
                "step": step + 1,
                "steps": trainer.cfg.train.steps,
                "reward": rows[-1]["reward/mean"],
                "entropy": rows[-1]["entropy"],
                "clip_events": sum(r.get("clip_events", 0) for r in rows),
                "accuracy": rows[-1]["accuracy"],
                "skipped": trainer.state["skipped_nonfinite"],
            }
        )
