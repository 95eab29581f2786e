"""`clipbench sync [SWEEP] [--tracking-uri URI] [--sink mlflow|wandb|tensorboard]`: replay to a mirror
(MLflow by default) what the store holds and the mirror lacks.

The replay itself is clipbench.tracking.sync's (it reads the whole store first, then sends); this
command checks the server answers, runs it and prints one row per run.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from clipbench.config.schema import SINKS
from clipbench.config.stored import setting
from clipbench.errors import UserError, did_you_mean
from clipbench.tracking.files import check_store_dir
from clipbench.tracking.mirror import run_name_of
from clipbench.tracking.mlflow_client import client_for, damaged_database_line, resolve_tracking_uri
from clipbench.tracking.sinks import missing_package, replay_sink
from clipbench.tracking.store import list_sweeps
from clipbench.tracking.sync import load_sweeps, sync_sweeps


def sync_command(
    sweep: str | None, *, results_dir: Path = Path("results"), tracking_uri: str | None = None, sink: str = "mlflow"
) -> list[dict]:
    if sink not in SINKS:
        raise UserError(f"--sink: unknown sink '{sink}'{did_you_mean(sink, SINKS)}; valid: {', '.join(SINKS)}")
    results_dir = check_store_dir(results_dir)
    sweeps = list_sweeps(results_dir)
    if sweep is not None:
        if sweep not in sweeps:
            raise UserError(
                f"no runs for sweep '{sweep}' in {results_dir}{did_you_mean(sweep, sweeps)}; "
                f"sweeps with runs: {', '.join(sweeps) or '(none)'}"
            )
        sweeps = [sweep]
    if not sweeps:
        raise UserError(f"nothing to sync: no runs in {results_dir}")
    loaded = load_sweeps(results_dir, sweeps)  # read (and check) everything before anything is sent or written
    if sink != "mlflow":
        return _sync_sink(sink, loaded)
    first = next((r.config for runs, _ in loaded.values() for r in runs), {})
    uri = resolve_tracking_uri(tracking_uri, setting(first, "tracking.tracking_uri"), results_dir)
    try:
        client = client_for(uri)
        client.search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001
        if (damaged := damaged_database_line(uri, results_dir, e)) is not None:
            raise UserError(damaged) from None
        raise UserError(
            f"cannot reach MLflow at {uri}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        ) from None
    rows = sync_sweeps(sweeps, results_dir=results_dir, uri=uri, client=client, loaded=loaded)

    t = Table(title=f"clipbench sync -> {uri}", title_justify="left")
    for col in ("sweep", "run_id", "mlflow run", "new run", "+params", "+metrics", "+artifacts", "state"):
        t.add_column(col)
    for r in rows:
        if "skipped" in r:
            t.add_row(r["sweep"], r["run_id"], "", "", "", "", "", r["skipped"])
        else:
            t.add_row(
                r["sweep"],
                r["run_id"],
                r["mlflow_run_id"][:12],
                "yes" if r["created"] else "",
                str(r["params"]),
                str(r["metrics"]),
                str(r["artifacts"]),
                r["state"],
            )
    Console(stderr=True).print(t)
    return rows


def _sync_sink(name: str, loaded: dict) -> list[dict]:
    """Every run of the sweeps into its W&B run or TensorBoard directory (continued), what it lacks."""

    fix = missing_package(name)
    if fix:
        raise UserError(f"--sink {name}: not installed here; {fix}")
    rows = []
    for sweep, (runs, _) in loaded.items():
        for r in runs:
            name_ = run_name_of(r.config, r.rd.run_id)
            n = replay_sink(name, r.config, r.rd, sweep=sweep, run_name=name_)
            rows.append({"sweep": sweep, "run_id": r.rd.run_id, "points": n, "state": r.status.get("state", "pending")})
    t = Table(title=f"clipbench sync -> {name}", title_justify="left")
    for col in ("sweep", "run_id", "+points", "state"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["sweep"], r["run_id"], str(r["points"]), r["state"])
    Console(stderr=True).print(t)
    return rows
