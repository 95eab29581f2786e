"""`clipbench sync [SWEEP]`: make MLflow mirror the results store again, without duplicates.

First every run of the sweep(s) is read from the store (config, status, metrics, evaluations): a
damaged file is one line (StoreError) before anything is sent or written. Then, for each run:
  1. find its child run by tags (sweep, run_id), or create it nested under the sweep's parent run,
     with the name the sweep gave it (recorded in mlflow.json) and the start time of the run;
  2. log the params it lacks and the (metric, step) points MLflow lacks: rows built by the same
     functions the live sink uses (`clipbench.tracking.mirror`), so nothing differs from a live run;
  3. upload missing artifacts (config.yaml, hist/log_ratio.jsonl, eval/step_*/<benchmark>.json; a
     file whose size differs is uploaded again) and the manifest to the parent run;
  4. set the child's status from the store with the run's own end time (never "now": a replayed
     run keeps its real duration), and record its id in mlflow.json.
Then the sweep's parent run is closed (FINISHED when every run finished, FAILED when one failed,
KILLED when the sweep stopped early) at its last run's end, unless a live process holds a run.
Runs locked by a live training process are skipped (their own sink is still logging).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipbench.config.stored import setting
from clipbench.tracking.files import read_json
from clipbench.tracking.lock import LOCK_DIR, run_locked_elsewhere, try_run_lock
from clipbench.tracking.mirror import expected_artifacts, expected_metrics, expected_params, run_tags
from clipbench.tracking.mlflow_client import (
    _mlflow_json,
    artifact_location,
    client_for,
    find_runs,
    get_or_create_experiment,
    metric_steps,
    record_mlflow_run,
    send_missing_artifacts,
    send_params,
    send_points,
)
from clipbench.tracking.mlflow_sink import parent_run
from clipbench.tracking.store import RunDir, RunState, list_run_dirs, list_sweeps
from clipbench.tracking.store_format import read_format

STATUS = {
    RunState.FINISHED: "FINISHED",
    RunState.FAILED: "FAILED",
    RunState.PREEMPTED: "KILLED",
}  # preempted: resumed later


@dataclass
class StoredRun:
    """One run as read (and checked) from the store before anything is sent."""

    rd: RunDir
    sweep: str
    config: dict
    status: dict
    rows: list[dict]
    evals: dict[int, dict[str, dict]]

    @property
    def start_ms(self) -> int | None:
        """When the run started: status.json's `started`, else when its config.yaml was written."""
        t = self.status.get("started")
        if t is None and self.rd.config_path.is_file():
            t = self.rd.config_path.stat().st_mtime
        return int(float(t) * 1000) if t is not None else None

    @property
    def end_ms(self) -> int | None:
        """When the run finished or failed: status.json's time, else when status.json was last written."""
        t = self.status.get("finished") or self.status.get("failed_at")
        if t is None and self.rd.status_path.is_file():
            t = self.rd.status_path.stat().st_mtime
        return int(float(t) * 1000) if t is not None else None


def read_run(rd: RunDir, sweep: str) -> StoredRun:
    """Every file sync reads, read now: a damaged one raises StoreError naming it."""
    return StoredRun(
        rd=rd,
        sweep=sweep,
        config=rd.read_config() or {},
        status=rd.status(),
        rows=rd.read_metrics(),
        evals=rd.read_evals(),
    )


def recorded_name(rd: RunDir, uri: str) -> str | None:
    """The MLflow run name the sweep gave this run (for this URI, else for any)."""
    data = _mlflow_json(rd)
    names = [data.get(uri, {}).get("run_name")] + [v.get("run_name") for v in data.values() if isinstance(v, dict)]
    return next((n for n in names if n), None)


# ---------------------------------------------------------------------------------------------


def sync_run(
    client, uri: str, run: StoredRun, *, results_dir: Path, experiments: dict[str, str], parents: dict[str, str | None]
) -> dict[str, Any]:
    from mlflow.entities import Metric  # noqa: PLC0415 - mlflow is heavy

    rd, sweep, config, status = run.rd, run.sweep, run.config, run.status
    exp_name = setting(config, "tracking.experiment")
    if exp_name not in experiments:
        experiments[exp_name] = get_or_create_experiment(client, exp_name, artifact_location(uri, results_dir))
    exp_id = experiments[exp_name]
    pkey = f"{exp_id}/{sweep}"
    if pkey not in parents:  # single `clipbench train` runs have no parent
        parents[pkey] = (
            None if sweep == "train" else parent_run(client, exp_id, sweep, rd.path.parent, attach_manifest=True)
        )
    parent = parents[pkey]

    rid = rd.run_id
    found = find_runs(client, exp_id, sweep=sweep, role="run", run_id=rid)
    created = not found
    if found:
        mlrun = found[0]
        for extra in found[1:]:  # never expected; keep the oldest
            client.delete_run(extra.info.run_id)
    else:
        tags = run_tags(config, sweep=sweep, run_id=rid)
        if parent:
            tags["mlflow.parentRunId"] = parent
        name = recorded_name(rd, uri) or f"{tags['method']} seed={tags['seed']} {rid}"
        mlrun = client.create_run(exp_id, start_time=run.start_ms, tags=tags, run_name=name)
    mid = mlrun.info.run_id
    if parent and mlrun.data.tags.get("mlflow.parentRunId") != parent and not created:
        client.set_tag(mid, "mlflow.parentRunId", parent)

    # params and metrics: only what MLflow lacks, built as the live sink builds them
    have_params = dict(mlrun.data.params) if not created else {}
    want = expected_params(rd, config, status, run.evals)
    n_params = send_params(client, mid, {k: v for k, v in want.items() if k not in have_params})
    expected = expected_metrics(rd, run.rows, run.evals)
    have_keys = set(mlrun.data.metrics) if not created else set()
    have = metric_steps(client, mid, [k for k in expected if k in have_keys])
    ts = run.start_ms or 0
    todo = [
        Metric(name, val, ts, step)
        for name, steps in expected.items()
        for step, val in steps.items()
        if step not in have.get(name, {})
    ]
    send_points(client, mid, todo)
    dupes = sum(c - 1 for steps in have.values() for c in steps.values() if c > 1)

    n_art = send_missing_artifacts(client, mid, rd, {} if created else None)

    state = status.get("state", "pending")
    if state in STATUS and mlrun.info.status != STATUS[state]:
        client.set_terminated(mid, STATUS[state], end_time=run.end_ms)
    record_mlflow_run(
        rd,
        uri,
        experiment_id=exp_id,
        run_id=mid,
        parent_run_id=parent,
        offline=False,
        needs_sync=False,
        error=None,
        synced=True,
    )
    return {
        "run_id": rid,
        "mlflow_run_id": mid,
        "created": created,
        "params": n_params,
        "metrics": len(todo),
        "artifacts": n_art,
        "state": state,
        "duplicates_seen": dupes,
        "end_ms": run.end_ms,
    }


def close_parent(client, parent: str, runs: list[StoredRun], manifest_ids: Iterable[str]) -> str | None:
    """Terminate the sweep's parent from the store: FINISHED when every planned run finished, FAILED when
    one failed, KILLED when the sweep stopped early; at the last run's end. Left alone (None) while a
    live process holds one of its runs."""
    sweep_dir = runs[0].rd.path.parent
    if any(run_locked_elsewhere(sweep_dir, r.rd.run_id) for r in runs):
        return None
    states = {r.rd.run_id: r.status.get("state", "pending") for r in runs}
    planned = set(manifest_ids) | set(states)
    if all(states.get(rid) == RunState.FINISHED for rid in planned):
        status = "FINISHED"
    elif RunState.FAILED in states.values():
        status = "FAILED"
    else:
        status = "KILLED"
    ends = [r.end_ms for r in runs if r.end_ms is not None and states[r.rd.run_id] in STATUS]
    current = client.get_run(parent).info
    if current.status != status or (ends and current.end_time != max(ends)):
        client.set_terminated(parent, status, end_time=max(ends) if ends else None)
    return status


def load_sweeps(results_dir: Path, sweeps: Iterable[str]) -> dict[str, tuple[list[StoredRun], list[str]]]:
    """{sweep: (its runs read from the store, the run ids its manifest plans)}; StoreError when damaged."""
    out = {}
    for sweep in sweeps:
        path = results_dir / sweep / "manifest.json"
        manifest = read_format(path, read_json(path, {}, kind="manifest"))  # a newer store: refused here
        planned = manifest.get("runs") if isinstance(manifest.get("runs"), dict) else {}
        out[sweep] = ([read_run(rd, sweep) for rd in list_run_dirs(results_dir / sweep)], list(planned))
    return out


def sync_sweeps(
    sweeps: Iterable[str],
    *,
    results_dir: Path,
    uri: str,
    client=None,
    loaded: dict[str, tuple[list[StoredRun], list[str]]] | None = None,
) -> list[dict]:
    results_dir = Path(results_dir)
    loaded = loaded if loaded is not None else load_sweeps(results_dir, sweeps)
    client = client or client_for(uri)
    experiments: dict[str, str] = {}
    parents: dict[str, str | None] = {}
    out = []
    for sweep, (stored, planned) in loaded.items():
        sweep_dir = results_dir / sweep
        for run in stored:
            with try_run_lock(sweep_dir, run.rd.run_id) as got:
                if not got:
                    out.append({"sweep": sweep, "run_id": run.rd.run_id, "skipped": "in progress (locked)"})
                    continue
                out.append(
                    {
                        "sweep": sweep,
                        **sync_run(client, uri, run, results_dir=results_dir, experiments=experiments, parents=parents),
                    }
                )
        for key, pid in parents.items():
            if pid and key.endswith(f"/{sweep}") and stored:
                close_parent(client, pid, stored, planned)
    return out


__all__ = ["sync_sweeps", "sync_run", "read_run", "expected_metrics", "expected_artifacts", "list_sweeps", "LOCK_DIR"]
