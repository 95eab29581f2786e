"""`clipbench sweep FILE [key=value ...]`: expand, freeze, run (resumable), report what happened.

    clipbench sweep sweeps/nsr_vs_decay.yaml --dry-run          # the plan; writes nothing
    clipbench sweep sweeps/nsr_vs_decay.yaml --json             # one JSON object per run (implies --dry-run)
    clipbench sweep sweeps/nsr_vs_decay.yaml train.steps=10     # overrides for every run
    clipbench sweep sweeps/nsr_vs_decay.yaml --jobs 4           # 4 local worker processes
    clipbench sweep sweeps/nsr_vs_decay.yaml --launcher submitit_slurm hydra.launcher.partition=gpu

Rerunning the same command skips finished runs, resumes interrupted ones from their checkpoints and
reruns failed ones only with --retry-failed. Exit code: 0, 1 when a run failed in this invocation,
2 for bad input (nothing written), 130 when interrupted (rerun to resume).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from clipbench.errors import UserError, unknown_choice
from clipbench.sweep.execute import RunTask, checkpoint_step, classify, run_parallel, run_sequential
from clipbench.sweep.expand import Expansion, expand, iter_summary, label, run_label
from clipbench.sweep.manifest import freeze, manifest_path, manifest_runs, merge, read_manifest
from clipbench.sweep.spec import SweepSpec, load_sweep
from clipbench.tracking.lock import manifest_lock
from clipbench.tracking.store import RunDir
from clipbench.sweep.expand import format_value


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(run-config overrides, Hydra launcher overrides `hydra.*` / `hydra/...`)."""
    run, hyd = [], []
    for o in overrides:
        key = o.lstrip("+~")
        (hyd if key.startswith("hydra.") or key.startswith("hydra/") else run).append(o)
    return run, hyd


def plan(file: str | Path, overrides: list[str] = (), plugins: list[str] = ()) -> tuple[SweepSpec, Expansion]:
    """Parse and expand a sweep file (pure; ConfigError on bad input)."""
    spec = load_sweep(file, list(overrides), list(plugins))
    return spec, expand(spec)


ENGINES = ("builtin", "trl", "verl")


def sweep_command(file: Path, overrides: list[str], *, dry_run: bool = False, json_out: bool = False,
                  results_dir: Path = Path("results"), jobs: int = 1, launcher: str | None = None,
                  retry_failed: bool = False, tracking_uri: str | None = None,
                  plugins: list[str] = (), engine: str | None = None) -> dict[str, Any]:
    out = Console(highlight=False, soft_wrap=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    run_overrides, hydra_overrides = split_overrides(list(overrides))
    if hydra_overrides and not launcher:
        raise UserError(f"'{hydra_overrides[0]}' is a Hydra launcher setting; it needs --launcher")
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    if engine is not None and engine not in ENGINES:
        raise UserError("--engine: " + unknown_choice("engine", engine, ENGINES))
    if launcher and engine != "verl":
        from clipbench.sweep.hydra_app import check_launcher

        check_launcher(launcher)
    if engine in ("builtin", "trl"):  # the run config's own key, for every run
        run_overrides.append(f"engine={engine}")
    spec, exp = plan(file, run_overrides, plugins)
    results_dir = Path(results_dir)
    if engine == "verl":  # each run as a verl trainer command (clipbench.integrations.verl_launch)
        from clipbench.integrations.verl_launch import verl_sweep

        return verl_sweep(spec, exp, results_dir=results_dir, dry_run=dry_run, json_out=json_out, launcher=launcher,
                          hydra_overrides=hydra_overrides, tracking_uri=tracking_uri, retry_failed=retry_failed,
                          err=err)
    mpath = manifest_path(results_dir, spec.name)

    if dry_run or json_out:
        existing = read_manifest(mpath) if mpath.is_file() else None
        mg = merge(existing, spec, exp)
        for w in list(exp.warnings) + mg.warnings:
            err.print(f"[yellow]warning:[/] {w}")
        if json_out:
            for rid, cfg, _ in manifest_runs(mg.manifest):
                sys.stdout.write(json.dumps({"run_id": rid, "config": cfg}) + "\n")
            sys.stdout.flush()
        else:
            out.print(plan_table(spec, exp, mg.manifest, results_dir, existing is not None, set(mg.new)))
            out.print(_plan_line(spec, exp, mg.manifest, results_dir))
        return {"sweep": spec.name, "runs": list(mg.manifest["runs"]), "written": False}

    mg = freeze(results_dir, spec, exp)  # the first write of this command
    for w in list(exp.warnings) + mg.warnings:
        err.print(f"[yellow]warning:[/] {w}")
    runs = manifest_runs(mg.manifest)
    tasks_all = [RunTask(results_dir=str(results_dir), sweep=spec.name, run_id=rid, config=cfg,
                         label=run_label(cfg, point), retry_failed=retry_failed, tracking_uri=tracking_uri)
                 for rid, cfg, point in runs]
    states = {t.run_id: classify(t.run_dir, retry_failed) for t in tasks_all}
    counts = {s: sum(1 for v in states.values() if v == s) for s in ("finished", "failed", "resume", "start")}
    err.print(f"sweep [bold]{spec.name}[/]: {len(runs)} runs -> {results_dir / spec.name}  "
              f"({counts['finished']} finished, {counts['resume']} to resume, {counts['start']} to start"
              + (f", {counts['failed']} failed: skipped (rerun them with --retry-failed)" if counts["failed"] else "")
              + ")")

    with manifest_lock(mpath.parent):  # two sweep processes starting together make one parent run
        parent, uri = _parent_run(spec, runs, results_dir, tracking_uri, mpath)
    tasks = [replace(t, parent_run_id=parent) for t in tasks_all
             if states[t.run_id] in ("resume", "start")]

    from clipbench.sweep.progress import SweepProgress

    results: list[dict] = []
    launcher_rc = 0
    try:
        if not tasks:
            pass
        elif launcher:
            from clipbench.sweep.hydra_app import launch
            from clipbench.sweep.execute import threads_per_worker

            launcher_rc = launch(mpath, [t.run_id for t in tasks], launcher=launcher,
                                 nprocs={t.run_id: t.config.get("launch", {}).get("nproc_per_node", 1) for t in tasks},
                                 jobs=jobs if jobs > 1 else None, hydra_overrides=hydra_overrides,
                                 retry_failed=retry_failed, tracking_uri=tracking_uri, parent_run_id=parent,
                                 threads=threads_per_worker(jobs) if launcher == "joblib" else None,
                                 sweep_dir=mpath.parent)
            results = [_outcome_from_store(t) for t in tasks]
        else:
            with SweepProgress(len(tasks), console=err, title=spec.name) as ui:
                results = run_parallel(tasks, jobs, ui) if jobs > 1 else run_sequential(tasks, ui)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: finished runs are kept; rerun the same command to resume")
        _finish_parent(parent, uri, "KILLED")
        raise SystemExit(130) from None

    by_id = {r["run_id"]: r for r in results}
    final = {t.run_id: classify(t.run_dir) for t in tasks_all}
    all_done = all(s == "finished" for s in final.values())
    _finish_parent(parent, uri, "FINISHED" if all_done else ("FAILED" if any(
        r["outcome"] in ("failed", "crashed") for r in results) else "RUNNING"))
    if results:
        err.print(summary_table(tasks_all, by_id))
    failed = [r for r in results if r["outcome"] in ("failed", "crashed")]
    locked = [r for r in results if r["outcome"] == "locked"]
    n_fin = sum(1 for s in final.values() if s == "finished")
    err.print(f"{n_fin}/{len(runs)} runs finished" + (f"; {len(locked)} locked by another process" if locked else "")
              + (f"; {len(failed)} failed (see status.json; rerun with --retry-failed)" if failed else ""))
    if any(r.get("mlflow_offline") for r in results):
        err.print(f"[yellow]MLflow was unreachable for some runs[/]: replay them with "
                  f"`clipbench sync {spec.name} --results-dir {results_dir}`")
    incomplete = [r for r in results if r["outcome"] == "incomplete"]
    if launcher_rc and incomplete:  # the launcher itself failed (bad hydra.* setting, cluster unreachable)
        err.print(f"[red]error[/]: the {launcher} launcher exited with code {launcher_rc} and {len(incomplete)} "
                  "run(s) did not finish (its log is above); rerun the same command to resume them")
    if results:
        _warm_metrics_cache(results_dir, spec.name)
    summary = {"sweep": spec.name, "runs": list(mg.manifest["runs"]), "results": results, "written": True,
               "finished": n_fin}
    if failed or (launcher_rc and incomplete):
        raise SystemExit(1)
    return summary


# ---------------------------------------------------------------------------------------------


def _parent_run(spec: SweepSpec, runs, results_dir: Path, tracking_uri: str | None, mpath: Path):
    if not runs or not any(cfg.get("tracking", {}).get("mlflow", True) for _, cfg, _ in runs):
        return None, None
    from clipbench.tracking.mlflow_sink import resolve_tracking_uri, sweep_parent_run

    tr = runs[0][1].get("tracking", {})
    uri = resolve_tracking_uri(tracking_uri, tr.get("tracking_uri"), results_dir)
    pid = sweep_parent_run(results_dir=results_dir, sweep=spec.name, experiment=tr.get("experiment", "clipbench"),
                           tracking_uri=tracking_uri, config_uri=tr.get("tracking_uri"), manifest_path=mpath)
    return pid, uri


def _finish_parent(parent: str | None, uri: str | None, status: str) -> None:
    if parent and uri and status != "RUNNING":
        from clipbench.tracking.mlflow_sink import finish_parent_run

        finish_parent_run(parent, status, uri=uri)


def _warm_metrics_cache(results_dir: Path, sweep: str) -> None:
    """Parse the new metrics once now, so the report that follows reads the sweep's cache."""
    try:
        from clipbench.tracking.store import load_sweep_metrics

        load_sweep_metrics(results_dir, sweep)
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


def _outcome_from_store(task: RunTask) -> dict:
    st = task.run_dir.status()
    state = st.get("state", "pending")
    outcome = {"finished": "resumed" if st.get("resumed_from") is not None else "finished",
               "failed": "failed"}.get(state, "incomplete")
    return {"run_id": task.run_id, "label": task.label, "outcome": outcome, "error": st.get("error")}


def _state(rd: RunDir) -> str:
    st = rd.status() if rd.status_path.exists() else None
    if st is None:
        return "pending"
    state = st.get("state", "pending")
    if state in ("running", "pending"):
        ck = checkpoint_step(rd)
        return f"interrupted (ckpt {ck})" if ck is not None else "interrupted"
    return state


def plan_table(spec: SweepSpec, exp: Expansion, manifest: dict, results_dir: Path, show_state: bool,
               new: set[str]) -> Table:
    from clipbench.objectives import METHODS

    t = Table(title=f"sweep {spec.name} ({spec.file})", title_justify="left")
    for col in ("run_id", "method", "parameters", "seed", "steps"):
        t.add_column(col, justify="right" if col in ("seed", "steps") else "left")
    rows = list(iter_summary(manifest["runs"], manifest.get("points", {})))
    other = any(r["other"] for r in rows)
    if other:
        t.add_column("other axes")
    if show_state:
        t.add_column("state")
    for r in rows:
        defaults = METHODS[r["method"]].defaults if r["method"] in METHODS else {}
        on_axis = {k[len("objective."):] for k in manifest.get("points", {}).get(r["run_id"], {})}
        params = " ".join(f"{k}={format_value(v)}" for k, v in r["params"].items()
                          if k in on_axis or defaults.get(k) != v) or "(defaults)"
        cells = [r["run_id"], r["method"], params, str(r["seed"]), str(r["steps"])]
        if other:
            cells.append(" ".join(f"{k}={format_value(v)}" for k, v in r["other"].items()))
        if show_state:
            cells.append("new" if r["run_id"] in new else _state(RunDir(results_dir / spec.name / r["run_id"])))
        t.add_row(*cells)
    return t


def _plan_line(spec: SweepSpec, exp: Expansion, manifest: dict, results_dir: Path) -> str:
    n = len(manifest["runs"])
    dropped = exp.combos - exp.excluded - len(exp.runs)
    why = []
    if exp.excluded:
        why.append(f"{exp.excluded} excluded")
    if dropped:
        why.append(f"{dropped} dropped as duplicates (objective parameters a method does not have)")
    return (f"{n} runs from {exp.combos} grid points" + (f" ({'; '.join(why)})" if why else "")
            + f" -> {results_dir / spec.name} (dry run: nothing written)")


def summary_table(tasks: list[RunTask], by_id: dict[str, dict]) -> Table:
    t = Table(title="runs", title_justify="left")
    for col in ("run_id", "run", "outcome", "time", "eval"):
        t.add_column(col)
    for task in tasks:
        r = by_id.get(task.run_id)
        if r is None:
            continue
        ev = " ".join(f"{k.split('/', 1)[1]}={v:.3f}" for k, v in (r.get("evals") or {}).items()
                      if k.endswith("/avg@n"))
        t.add_row(task.run_id, task.label, r["outcome"], f"{r['seconds']:.0f}s" if r.get("seconds") else "", ev)
    return t


__all__ = ["sweep_command", "plan", "plan_table", "split_overrides", "label"]
