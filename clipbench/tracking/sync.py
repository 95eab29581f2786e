"""`clipbench sync [SWEEP]`: make MLflow mirror the results store again, without duplicates.

For each run directory of the sweep(s):
  1. find its child run by tags (sweep, run_id) -- or create it, nested under the sweep's parent run;
  2. log the params it lacks (flattened config + rule semantics, as the trainer logs them);
  3. compare metric histories by step and log only the (metric, step) points MLflow lacks: the
     per-optimizer-step rows of metrics.jsonl (step = opt_step) and the evaluation summaries
     (`eval/<benchmark>/<stat>`, step = rollout step), exactly what the trainer sends live;
  4. upload missing artifacts (config.yaml, hist/log_ratio.jsonl, eval/step_*/<benchmark>.json; a
     file whose size differs is uploaded again) and the manifest to the parent run;
  5. set the child's status from the store (finished/failed) and record its id in mlflow.json.
Runs locked by a live training process are skipped (their own sink is still logging).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table

from clipbench.errors import UserError, did_you_mean
from clipbench.tracking.lock import LOCK_DIR, manifest_lock, try_run_lock
from clipbench.tracking.mlflow_sink import (MAX_METRICS_PER_BATCH, MAX_PARAMS_PER_BATCH, ROLE_TAG, artifact_location,
                                            client_for, find_runs, get_or_create_experiment, metric_name,
                                            metric_steps, metric_value, param_value, record_mlflow_run,
                                            resolve_tracking_uri, run_params, run_tags)
from clipbench.tracking.store import RunDir, list_run_dirs, read_jsonl

NOT_SWEEPS = ("reports", "bench", "mlartifacts", "eval")
STATUS = {"finished": "FINISHED", "failed": "FAILED"}


def list_sweeps(results_dir: str | Path) -> list[str]:
    root = Path(results_dir)
    if not root.is_dir():
        return []
    return [d.name for d in sorted(root.iterdir())
            if d.is_dir() and d.name not in NOT_SWEEPS and not d.name.startswith(".") and list_run_dirs(d)]


# ---------------------------------------------------------------------------------------------
# What MLflow should hold for a run (from the store alone)


def expected_metrics(rd: RunDir) -> dict[str, dict[int, float]]:
    """{metric name: {step: value}} as the trainer sends them live (see module docstring)."""
    out: dict[str, dict[int, float]] = {}
    for row in read_jsonl(rd.metrics_path):
        step = row.get("opt_step", row.get("step"))
        if step is None:
            continue
        for k, v in row.items():
            val = metric_value(v)
            if val is not None:
                out.setdefault(metric_name(k), {}).setdefault(int(step), val)
    for step, per_bench in rd.read_evals().items():
        for bench, payload in per_bench.items():
            for k, v in (payload.get("summary") or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out.setdefault(metric_name(f"eval/{bench}/{k}"), {}).setdefault(int(step), float(v))
    return out


def expected_artifacts(rd: RunDir) -> list[tuple[Path, str | None]]:
    """[(local file, artifact dir)] -- the layout the trainer uses."""
    files: list[tuple[Path, str | None]] = []
    if rd.config_path.is_file():
        files.append((rd.config_path, None))
    if rd.hist_path.is_file():
        files.append((rd.hist_path, "hist"))
    root = rd.path / "eval"
    if root.is_dir():
        for d in sorted(root.glob("step_*")):
            for f in sorted(d.glob("*.json")):
                files.append((f, f"eval/{d.name}"))
    return files


def _artifact_sizes(client, mlflow_run_id: str, path: str | None = None) -> dict[str, int]:
    out: dict[str, int] = {}
    for fi in client.list_artifacts(mlflow_run_id, path):
        if fi.is_dir:
            out.update(_artifact_sizes(client, mlflow_run_id, fi.path))
        else:
            out[fi.path] = fi.file_size or 0
    return out


# ---------------------------------------------------------------------------------------------


def _parent(client, exp_id: str, sweep: str, sweep_dir: Path) -> str | None:
    if sweep == "train":  # single `clipbench train` runs have no parent
        return None
    found = find_runs(client, exp_id, sweep=sweep, role="sweep")
    pid = found[0].info.run_id if found else client.create_run(
        exp_id, tags={"sweep": sweep, ROLE_TAG: "sweep"}, run_name=sweep).info.run_id
    manifest = sweep_dir / "manifest.json"
    if manifest.is_file():
        have = _artifact_sizes(client, pid)
        if have.get("manifest.json") != manifest.stat().st_size:
            client.log_artifact(pid, str(manifest))
    return pid


def sync_run(client, uri: str, rd: RunDir, *, sweep: str, results_dir: Path,
             experiments: dict[str, str], parents: dict[str, str | None]) -> dict[str, Any]:
    from mlflow.entities import Metric, Param

    config = rd.read_config() or {}
    status = rd.status()
    tracking = config.get("tracking", {})
    exp_name = tracking.get("experiment", "clipbench")
    if exp_name not in experiments:
        experiments[exp_name] = get_or_create_experiment(client, exp_name, artifact_location(uri, results_dir))
    exp_id = experiments[exp_name]
    pkey = f"{exp_id}/{sweep}"
    if pkey not in parents:
        with manifest_lock(rd.path.parent):  # the sweep command creates parents under the same lock
            parents[pkey] = _parent(client, exp_id, sweep, rd.path.parent)
    parent = parents[pkey]

    rid = rd.run_id
    found = find_runs(client, exp_id, sweep=sweep, role="run", run_id=rid)
    created = not found
    if found:
        run = found[0]
        if len(found) > 1:  # never expected; keep the oldest
            for extra in found[1:]:
                client.delete_run(extra.info.run_id)
    else:
        tags = run_tags(config, sweep=sweep, run_id=rid)
        if parent:
            tags["mlflow.parentRunId"] = parent
        method, seed = tags["method"], tags["seed"]
        run = client.create_run(exp_id, tags=tags, run_name=f"{method} seed={seed} {rid}")
    mid = run.info.run_id
    if parent and run.data.tags.get("mlflow.parentRunId") != parent and not created:
        client.set_tag(mid, "mlflow.parentRunId", parent)

    # params
    have_params = dict(run.data.params) if not created else {}
    want = {metric_name(k): param_value(v) for k, v in run_params(config, status.get("backend")).items()}
    new_params = [Param(k, v) for k, v in want.items() if k not in have_params]
    for i in range(0, len(new_params), MAX_PARAMS_PER_BATCH):
        client.log_batch(mid, params=new_params[i:i + MAX_PARAMS_PER_BATCH], synchronous=True)

    # metrics: only the (name, step) points MLflow lacks
    expected = expected_metrics(rd)
    have_keys = set(run.data.metrics) if not created else set()
    have = metric_steps(client, mid, [k for k in expected if k in have_keys])
    ts = int(status.get("started", 0) * 1000) or 0
    todo = [Metric(name, val, ts, step) for name, steps in expected.items()
            for step, val in steps.items() if step not in have.get(name, {})]
    for i in range(0, len(todo), MAX_METRICS_PER_BATCH):
        client.log_batch(mid, metrics=todo[i:i + MAX_METRICS_PER_BATCH], synchronous=True)
    dupes = sum(c - 1 for steps in have.values() for c in steps.values() if c > 1)

    # artifacts
    sizes = _artifact_sizes(client, mid) if not created else {}
    n_art = 0
    for f, where in expected_artifacts(rd):
        key = f"{where}/{f.name}" if where else f.name
        if sizes.get(key) != f.stat().st_size:
            client.log_artifact(mid, str(f), where)
            n_art += 1

    state = status.get("state", "pending")
    if state in STATUS and run.info.status != STATUS[state]:
        client.set_terminated(mid, STATUS[state])
    record_mlflow_run(rd, uri, experiment_id=exp_id, run_id=mid, parent_run_id=parent, offline=False, error=None,
                      synced=True)
    return {"run_id": rid, "mlflow_run_id": mid, "created": created, "params": len(new_params), "metrics": len(todo),
            "artifacts": n_art, "state": state, "duplicates_seen": dupes}


def sync_sweeps(sweeps: Iterable[str], *, results_dir: Path, uri: str, client=None) -> list[dict]:
    client = client or client_for(uri)
    experiments: dict[str, str] = {}
    parents: dict[str, str | None] = {}
    out = []
    for sweep in sweeps:
        sweep_dir = results_dir / sweep
        for rd in list_run_dirs(sweep_dir):
            with try_run_lock(sweep_dir, rd.run_id) as got:
                if not got:
                    out.append({"sweep": sweep, "run_id": rd.run_id, "skipped": "in progress (locked)"})
                    continue
                out.append({"sweep": sweep, **sync_run(client, uri, rd, sweep=sweep, results_dir=results_dir,
                                                       experiments=experiments, parents=parents)})
    return out


def sync_command(sweep: str | None, *, results_dir: Path = Path("results"), tracking_uri: str | None = None) -> list[dict]:
    results_dir = Path(results_dir)
    sweeps = list_sweeps(results_dir)
    if sweep is not None:
        if sweep not in sweeps:
            raise UserError(f"no runs for sweep '{sweep}' in {results_dir}{did_you_mean(sweep, sweeps)}; "
                            f"sweeps with runs: {', '.join(sweeps) or '(none)'}")
        sweeps = [sweep]
    if not sweeps:
        raise UserError(f"nothing to sync: no runs in {results_dir}")
    first = list_run_dirs(results_dir / sweeps[0])[0].read_config() or {}
    uri = resolve_tracking_uri(tracking_uri, first.get("tracking", {}).get("tracking_uri"), results_dir)
    try:
        client = client_for(uri)
        client.search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot reach MLflow at {uri}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}") from None
    rows = sync_sweeps(sweeps, results_dir=results_dir, uri=uri, client=client)

    t = Table(title=f"clipbench sync -> {uri}", title_justify="left")
    for col in ("sweep", "run_id", "mlflow run", "new run", "+params", "+metrics", "+artifacts", "state"):
        t.add_column(col)
    for r in rows:
        if "skipped" in r:
            t.add_row(r["sweep"], r["run_id"], "", "", "", "", "", r["skipped"])
        else:
            t.add_row(r["sweep"], r["run_id"], r["mlflow_run_id"][:12], "yes" if r["created"] else "",
                      str(r["params"]), str(r["metrics"]), str(r["artifacts"]), r["state"])
    Console(stderr=True).print(t)
    return rows


__all__ = ["sync_command", "sync_sweeps", "sync_run", "expected_metrics", "expected_artifacts", "list_sweeps",
           "LOCK_DIR"]
