"""`clipbench train RECIPE [key=value ...]`: validate, then one run into <results>/train/<run_id>/."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from clipbench.config import load_run_config, run_id
from clipbench.memory.plan import preflight as memory_preflight
from clipbench.tracking.store import RunDir, check_writable_dir
from clipbench.train.base_model import resolve_model_name
from clipbench.train.checkpoint import find_checkpoint


def train_command(recipe: Path, overrides: list[str], *, resume: bool, results_dir: Path,
                  tracking_uri: str | None, plugins: list[str] = ()) -> dict:
    from clipbench.integrations import preflight, train_run  # the run's engine (builtin loop or TRL)

    console = Console(stderr=True)
    # raises ConfigError before anything is written; imports the run's plugins (recipe + --plugin)
    cfg = load_run_config(recipe, overrides, plugins=plugins)
    rd = RunDir(Path(results_dir) / "train" / run_id(cfg))
    if resume and find_checkpoint(rd.checkpoint_dir) is None:
        console.print(f"[yellow]no checkpoint in {rd.path}; starting from step 0[/]")
    check_writable_dir(results_dir)  # a file, or not writable: one line, not a traceback
    rd.status(), rd.read_config()  # a damaged store file of this run: one line (StoreError) before any write
    memory_preflight(cfg, resolve_model_name(cfg.model.name))  # sleep mode runs here; GPU: the run fits
    preflight(cfg)  # engine checks, then model, task and benchmarks load: still nothing written
    sink = _sink(cfg, results_dir, tracking_uri, rd, resume)
    console.print(f"run {rd.run_id}: {cfg.objective['method']} on {cfg.task.name}, {cfg.train.steps} steps -> {rd.path}")

    def progress(ev: dict) -> None:
        console.print(f"  step {ev['step']:>4}/{ev['steps']}  reward {ev['reward']:.3f}  acc {ev['accuracy']:.3f}  "
                      f"entropy {ev['entropy']:.3f}  clip events {int(ev['clip_events'])}")

    status = "FAILED"
    try:
        summary = train_run(cfg, rd.path, resume=resume, sink=sink, progress=progress)
        status = "FINISHED"
    except BaseException:
        if rd.status_path.exists():
            rd.set_status("failed")
        raise
    finally:
        sink.close(status)
    evals = {k: v for k, v in summary.items() if k.startswith("eval/")}
    for k, v in sorted(evals.items()):
        console.print(f"  {k} = {v:.4f}")
    console.print(f"finished: {rd.path}")
    return summary


def _sink(cfg, results_dir: Path, tracking_uri: str | None, rd: RunDir, resume: bool):
    from clipbench.tracking.sink import NullSink

    if not cfg.tracking.mlflow or int(os.environ.get("RANK", "0")) != 0:  # one MLflow run: rank 0's
        return NullSink()
    from clipbench.tracking.mlflow_sink import run_sink

    return run_sink(cfg, rd, results_dir=results_dir, sweep="train", tracking_uri=tracking_uri, resume=resume)
