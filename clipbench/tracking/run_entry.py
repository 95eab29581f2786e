"""A run's own entry in the results store, written by the run whatever its engine trains it (the
built-in loop, train/loop.py; TRL, engines/trl.py): the writing process (rank 0) calls each once.

    run_started(cfg, rd, sink, engine="trl", backend="hf", world_size=1, device="cpu", step=0, fresh=True)
    ... training: metrics, checkpoints (status running at each), evaluations ...
    run_finished(cfg, rd, sink, skipped_nonfinite=0)      # status finished (+ the engine's extras)
    return run_summary(cfg, rd, final, last)              # every process: what train_run returns

run_started: config.yaml, status.json running (run id, step, steps, backend, engine, world size,
when it first started, the engine's extras), the sink's params (the config and the rule's effective
bounds, `tracking.mirror.run_params`), and this start's record in provenance.json (machine,
software, base-model sha256, `tracking.provenance.record_start`), mirrored as params too.
run_finished: the config and the log-ratio histograms as the sink's artifacts, status.json finished.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from clipbench.config import run_id, to_dict
from clipbench.tracking.mirror import run_params
from clipbench.tracking.provenance import provenance_params, record_start
from clipbench.tracking.sink import MetricSink
from clipbench.tracking.store import RunDir, RunState


def run_started(
    cfg,
    rd: RunDir,
    sink: MetricSink,
    *,
    engine: str,
    backend: str,
    world_size: int,
    device,
    step: int,
    fresh: bool,
    drop: Iterable[str] = (),
    **status: Any,
) -> None:
    """The start (or resume from rollout step `step`; `fresh`: from nothing) of run `cfg` in `rd`:
    its config, status running, provenance and the sink's params (see the module docstring).
    `status`: the engine's own status.json keys; `drop`: keys a previous start wrote that no longer hold."""
    stored = to_dict(cfg)
    rd.write_config(stored)
    rd.set_status(
        RunState.RUNNING,
        drop=drop,
        run_id=run_id(cfg),
        step=step,
        steps=cfg.train.steps,
        backend=backend,
        engine=engine,
        world_size=world_size,
        started=rd.status().get("started", time.time()),
        **status,
    )
    sink.log_params(run_params(stored, backend))  # config + effective clip bounds (rule.*)
    starts = record_start(
        rd, cfg.model.name, engine=engine, world_size=world_size, device=device, step=step, fresh=fresh
    )
    sink.log_params(provenance_params(starts))  # machine, software, base-model sha256


def run_finished(cfg, rd: RunDir, sink: MetricSink, **status: Any) -> None:
    """Run `cfg` finished its last step: its config and histograms to the sink, status finished
    (`status`: the engine's own keys)."""
    sink.log_artifact(rd.config_path)
    if rd.hist_path.exists():
        sink.log_artifact(rd.hist_path, "hist")
    rd.set_status(RunState.FINISHED, step=cfg.train.steps, finished=time.time(), **status)


def run_summary(cfg, rd: RunDir, final: Mapping[str, Any], last: Mapping[str, Any]) -> dict:
    """What training a run returns (`engines.train_run`): its id, directory and steps, the final
    evaluation's metrics (`final`) and the last metrics row's numbers (`last`)."""
    return {
        "run_id": run_id(cfg),
        "run_dir": str(rd.path),
        "steps": cfg.train.steps,
        **final,
        "last": {k: v for k, v in last.items() if isinstance(v, (int, float))},
    }
