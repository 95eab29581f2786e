"""`clipbench sweep FILE [key=value ...]`: expand, freeze, run (resumable), report what happened.

    clipbench sweep sweeps/nsr_vs_decay.yaml --dry-run          # the plan; writes nothing
    clipbench sweep sweeps/nsr_vs_decay.yaml --json             # one JSON object per run (implies --dry-run)
    clipbench sweep sweeps/nsr_vs_decay.yaml train.steps=10     # overrides for every run
    clipbench sweep sweeps/nsr_vs_decay.yaml --jobs 4           # 4 local worker processes
    clipbench sweep sweeps/nsr_vs_decay.yaml --launcher submitit_slurm hydra.launcher.partition=gpu

Rerunning the same command skips finished runs, resumes interrupted ones from their checkpoints and
reruns failed ones only with --retry-failed. Exit code: 0, 1 when a run failed in this invocation,
2 for bad input (nothing written), 130 when interrupted (rerun to resume), 75 when preempted (SIGTERM
or a run's launch.preempt_signal: the running runs checkpointed; rerun to resume).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from clipbench.commands import sweep_start
from clipbench.commands.progress import SweepProgress
from clipbench.commands.sweep_show import plan_table, show_plan, start_line, summary_table, warn
from clipbench.config import from_dict
from clipbench.config.labels import label
from clipbench.config.stored import setting
from clipbench.engines import (
    ENGINES,
    check,  # the run's engine check (its keys, the components it can feed)
    check_plugin_code,
    preflight,  # the run's engine checks, then model, task, benchmarks, memory
)
from clipbench.errors import PREEMPTED_EXIT, StoreError, UserError, stop_exit_code
from clipbench.sweep.execute import (
    Next,
    RunTask,
    classify,
    mend_finished,
    outcome_from_store,
    run_sequential,
    run_task,
)
from clipbench.sweep.expand import Expansion, expand
from clipbench.sweep.hydra_app import check_launcher, launch
from clipbench.sweep.manifest import freeze, frozen_plan, manifest_path, manifest_runs, merge, read_manifest
from clipbench.sweep.pool import run_parallel, threads_per_worker
from clipbench.sweep.spec import SweepSpec, load_spec
from clipbench.sweep.submitted import plans_of, submit_plans
from clipbench.tracking.files import REMEDIES, check_writable_dir
from clipbench.tracking.lock import LOCK_DIR
from clipbench.tracking.metrics_table import load_sweep_metrics
from clipbench.tracking.mirror import sync_hint
from clipbench.tracking.mlflow_client import damaged_database_line, resolve_tracking_uri
from clipbench.tracking.mlflow_sink import finish_parent_run, sweep_parent_run
from clipbench.tracking.store import RunDir, check_run_path, list_run_dirs

if TYPE_CHECKING:
    from clipbench.engines import Engine


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(run-config overrides, Hydra launcher overrides `hydra.*` / `hydra/...`)."""
    run, hyd = [], []
    for o in overrides:
        key = o.lstrip("+~")
        (hyd if key.startswith("hydra.") or key.startswith("hydra/") else run).append(o)
    return run, hyd


def plan(file: str | Path, overrides: list[str] = (), plugins: list[str] = ()) -> tuple[SweepSpec, Expansion]:
    """Parse and expand a sweep file (pure; ConfigError on bad input)."""
    spec = load_spec(file, list(overrides), list(plugins))
    return spec, expand(spec)


def sweep_command(
    file: Path,
    overrides: list[str] | None = None,
    *,
    dry_run: bool = False,
    json_out: bool = False,
    results_dir: Path = Path("results"),
    jobs: int = 1,
    launcher: str | None = None,
    retry_failed: bool = False,
    tracking_uri: str | None = None,
    plugins: list[str] | None = None,
    engine: str | None = None,
    stage: sweep_start.Stage | None = None,
) -> dict[str, Any]:
    """Expand a declarative sweep into runs and execute them (resumable); the options are
    `clipbench sweep`'s (cli.py declares them). `stage`: the terminal's status line (erased before
    anything else is printed)."""
    plugins = list(plugins or [])
    stage = stage or sweep_start.Stage()
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    run_overrides, hydra_overrides = split_overrides(list(overrides or []))
    eng = check_options(hydra_overrides, jobs=jobs, launcher=launcher, engine=engine)
    if eng is not None and eng.in_process:  # the run config's own key, for every run
        run_overrides.append(f"engine={eng.name}")
    stage.say(f"sweep {file}: expanding its grid, validating each setting")
    spec = load_spec(file, run_overrides, plugins, missing_base_ok=True)
    # a plan writes nothing: a read-only store can show one
    results_dir = check_store_path(results_dir) if dry_run or json_out else check_writable_dir(results_dir)
    mpath = manifest_path(results_dir, spec.name)
    existing = read_manifest(mpath)  # a damaged store: one line (StoreError), before anything is written
    exp = frozen_plan(spec, existing) or expand(spec)
    check_frozen_configs(mpath, existing)
    check_run_files(mpath.parent, [*exp.runs, *(existing or {}).get("runs", {})])
    if not (dry_run or json_out):
        check_writable_store(mpath.parent)
    stage.done()
    if eng is not None and eng.submits:  # each run as the engine's own command (clipbench.sweep.submitted)
        return submitted_sweep(
            eng,
            spec,
            exp,
            existing,
            results_dir=results_dir,
            dry_run=dry_run,
            json_out=json_out,
            launcher=launcher,
            hydra_overrides=hydra_overrides,
            tracking_uri=tracking_uri,
            retry_failed=retry_failed,
            err=err,
        )
    if dry_run or json_out:
        return show_plan(spec, exp, existing, results_dir=results_dir, json_out=json_out, err=err)
    return run_sweep(
        spec,
        exp,
        existing,
        results_dir=results_dir,
        jobs=jobs,
        launcher=launcher,
        hydra_overrides=hydra_overrides,
        retry_failed=retry_failed,
        tracking_uri=tracking_uri,
        command_line=(list(overrides or []), plugins),
        stage=stage,
        err=err,
    )


def run_sweep(
    spec: SweepSpec,
    exp: Expansion,
    existing: dict | None,
    *,
    results_dir: Path,
    jobs: int,
    launcher: str | None,
    hydra_overrides: list[str],
    retry_failed: bool,
    tracking_uri: str | None,
    command_line: tuple[list[str], list[str]],
    stage: sweep_start.Stage,
    err: Console,
) -> dict[str, Any]:
    """Preflight the new runs, freeze the manifest, train what is left, say what happened; a sweep that
    ends with every run finished remembers its inputs (`command_line`: the overrides and --plugin as
    given) for a rerun that needs no expansion (commands/sweep_start.py)."""
    mpath = manifest_path(results_dir, spec.name)
    if not launcher:  # runs entering the manifest pass the preflight (a launcher's nodes may see other files)
        new = [cfg for rid, cfg in merge(existing, spec, exp).new_runs()]
        stage.say(f"sweep {spec.name}: preflight of {len(new)} new runs (engine keys, model, task, benchmarks, memory)")
        preflight_runs(new)
    mg = freeze(results_dir, spec, exp)  # the first write of this command
    stage.done()
    warn(err, list(exp.warnings) + mg.warnings)
    runs = manifest_runs(mg.manifest)
    run_dirs = {rid: RunDir(results_dir / spec.name / rid) for rid, _, _ in runs}
    states = {rid: classify(rd, retry_failed) for rid, rd in run_dirs.items()}
    err.print(start_line(spec.name, len(runs), results_dir, states))
    warn(err, mend_finished(run_dirs, {rid: cfg for rid, cfg, _ in runs}, states))
    trains = [rid for rid, _, _ in runs if states[rid].trains]
    parent = uri = experiment = None  # nothing to train: MLflow is left as it is (`clipbench sync` mends it)
    if trains:
        stage.say(f"sweep {spec.name}: opening its MLflow parent run")
        parent, uri, experiment = _parent_run(spec, runs, results_dir, tracking_uri, mpath)
        stage.done()
    tasks = [  # each run to train, its stored config read once
        run_task(
            results_dir,
            spec.name,
            rid,
            cfg,
            point,
            retry_failed=retry_failed,
            tracking_uri=tracking_uri,
            parent_run_id=parent,
        )
        for rid, cfg, point in runs
        if states[rid].trains
    ]
    try:
        results, launcher_rc = execute(
            tasks,
            mpath,
            spec.name,
            jobs=jobs,
            launcher=launcher,
            hydra_overrides=hydra_overrides,
            retry_failed=retry_failed,
            tracking_uri=tracking_uri,
            parent=parent,
            err=err,
        )
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: finished runs are kept; rerun the same command to resume")
        _finish_parent(parent, uri, experiment, spec.name, "KILLED")
        raise SystemExit(130) from None
    out = finish(
        spec.name,
        mg.manifest,
        run_dirs,
        tasks,
        results,
        launcher,
        launcher_rc,
        results_dir=results_dir,
        parent=parent,
        uri=uri,
        experiment=experiment,
        err=err,
    )
    if out["finished"] == len(runs):
        plugins = [r["path"] for r in mg.manifest.get("plugins", []) if Path(r["path"]).is_file()]
        stored = [mpath, *(rd.config_path for rd in run_dirs.values())]  # an edit or damage: the full path
        files = [spec.file, spec.base, *plugins, *stored]
        warnings = list(exp.warnings) + merge(mg.manifest, spec, exp).warnings  # what a rerun would say
        inputs = sweep_start.rerun_inputs(files, *command_line)
        sweep_start.remember_finished(results_dir, spec.name, inputs, list(mg.manifest["runs"]), warnings)
    return out


def check_store_path(results_dir: Path) -> Path:
    """--dry-run / --json: the results dir is only read (it need not exist, nor be writable)."""
    results_dir = Path(results_dir)
    if results_dir.exists() and not results_dir.is_dir():
        raise UserError(f"--results-dir {results_dir}: exists and is not a directory")
    return results_dir


def check_options(hydra_overrides: list[str], *, jobs: int, launcher: str | None, engine: str | None) -> Engine | None:
    """The command's own options, before anything is read: one line each (UserError). Returns the
    engine --engine names (None: each run's own)."""

    if hydra_overrides and not launcher:
        raise UserError(f"'{hydra_overrides[0]}' is a Hydra launcher setting; it needs --launcher")
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    if engine is not None and engine not in ENGINES:
        raise UserError("--engine: " + ENGINES.unknown(engine))
    eng = ENGINES[engine] if engine is not None else None
    if launcher and not (eng is not None and eng.submits):  # an engine launched apart checks its own
        check_launcher(launcher)
    return eng


def execute(
    tasks: list[RunTask],
    mpath: Path,
    sweep: str,
    *,
    jobs: int,
    launcher: str | None,
    hydra_overrides: list[str],
    retry_failed: bool,
    tracking_uri: str | None,
    parent: str | None,
    err: Console,
) -> tuple[list[dict], int]:
    """Run the tasks: here (one at a time, or `jobs` worker processes) or through a Hydra launcher.
    Returns (outcomes, the launcher's exit code)."""
    if not tasks:
        return [], 0
    if launcher:
        rc = launch(
            mpath,
            [t.run_id for t in tasks],
            launcher=launcher,
            nprocs={t.run_id: t.config.launch.nproc_per_node for t in tasks},
            jobs=jobs if jobs > 1 else None,
            hydra_overrides=hydra_overrides,
            retry_failed=retry_failed,
            tracking_uri=tracking_uri,
            parent_run_id=parent,
            threads=threads_per_worker(jobs) if launcher == "joblib" else None,
            sweep_dir=mpath.parent,
        )
        return [outcome_from_store(t) for t in tasks], rc
    with SweepProgress(len(tasks), console=err, title=sweep) as ui:
        return (run_parallel(tasks, jobs, ui) if jobs > 1 else run_sequential(tasks, ui)), 0


def finish(
    sweep: str,
    manifest: dict,
    run_dirs: dict[str, RunDir],
    tasks: list[RunTask],
    results: list[dict],
    launcher: str | None,
    launcher_rc: int,
    *,
    results_dir: Path,
    parent,
    uri,
    experiment,
    err: Console,
) -> dict[str, Any]:
    """Close the MLflow parent, print the outcomes of `tasks` (the runs this invocation trained) and
    the state of every run of the sweep (`run_dirs`); exit 1 when a run failed in this invocation."""
    by_id = {r["run_id"]: r for r in results}
    final = {rid: classify(rd) for rid, rd in run_dirs.items()}
    all_done = all(s is Next.FINISHED for s in final.values())
    failed = [r for r in results if r["outcome"] in ("failed", "crashed", "killed")]
    # failures the same command resumes (a memory limit, a killed worker): not "--retry-failed"
    again = [r for r in failed if r["run_id"] in final and final[r["run_id"]].trains]
    failed_skip = [r for r in failed if r not in again]
    disk_full = [r for r in results if r["outcome"] == "disk-full"]
    preempted = [r for r in results if r["outcome"] == "preempted"]
    not_started = [r for r in results if r["outcome"] == "not-started"]
    _finish_parent(parent, uri, experiment, sweep, "FINISHED" if all_done else ("FAILED" if failed else "RUNNING"))
    if results:
        err.print(summary_table(tasks, by_id))
    locked = [r for r in results if r["outcome"] == "locked"]
    n_fin = sum(1 for s in final.values() if s is Next.FINISHED)
    err.print(
        f"{n_fin}/{len(run_dirs)} runs finished"
        + (f"; {len(locked)} locked by another process" if locked else "")
        + (f"; {len(failed_skip)} failed (see status.json; rerun with --retry-failed)" if failed_skip else "")
        + (
            f"; {len(again)} stopped ({', '.join(sorted({_stop_reason(run_dirs[r['run_id']]) for r in again}))}): rerun the same "
            "command to resume"
            if again
            else ""
        )
        + (f"; {len(disk_full)} stopped by a full disk" if disk_full else "")
        + (f"; {len(preempted)} preempted (checkpointed)" if preempted else "")
        + (f"; {len(not_started)} not started (the sweep stopped)" if not_started else "")
    )
    for r in results:
        for note in r.get("notes") or ():
            err.print(f"[yellow]warning:[/] run {r['run_id']}: {note}", soft_wrap=True)
    damaged = damaged_database_line(uri, results_dir) if uri and any(r.get("mlflow_offline") for r in results) else None
    if damaged is not None:
        err.print(f"[yellow]MLflow was unreachable for some runs[/]: {damaged}", soft_wrap=True, highlight=False)
    elif uri and any(r.get("mlflow_offline") for r in results):
        err.print(
            Text.assemble(
                ("MLflow was unreachable for some runs", "yellow"),
                f": replay them with `{sync_hint(sweep, results_dir, uri)}`",
            )
        )
    incomplete = [r for r in results if r["outcome"] == "incomplete"]
    if launcher_rc and incomplete:  # the launcher itself failed (bad hydra.* setting, cluster unreachable)
        err.print(
            f"[red]error[/]: the {launcher} launcher exited with code {launcher_rc} and {len(incomplete)} "
            "run(s) did not finish (its log is above); rerun the same command to resume them"
        )
    if results:
        _warm_metrics_cache(results_dir, sweep)
    if disk_full:
        err.print(f"[red]error[/]: {disk_full[0]['error']}", soft_wrap=True)
    if failed or disk_full or (launcher_rc and incomplete):
        raise SystemExit(1)
    if preempted or not_started:
        signals = {run_dirs[r["run_id"]].status().get("signal") for r in preempted} - {None}
        code = max((stop_exit_code(s) for s in signals), default=PREEMPTED_EXIT)  # Ctrl-C: 130
        what = {130: "interrupted (Ctrl-C)", 129: "stopped (SIGHUP)"}.get(code, "preempted")
        err.print(
            f"[yellow]{what}[/]: the running runs stopped at a checkpoint and no further run started; "
            "rerun the same command to resume"
        )
        raise SystemExit(code)
    return {"sweep": sweep, "runs": list(manifest["runs"]), "results": results, "written": True, "finished": n_fin}


def _stop_reason(rd: RunDir) -> str:
    reason = rd.status().get("reason", "")
    return {"out-of-memory": "out of memory", "worker-killed": "its worker was killed"}.get(reason, reason)


def submitted_sweep(
    eng: Engine,
    spec: SweepSpec,
    exp: Expansion,
    existing: dict | None,
    *,
    results_dir: Path,
    dry_run: bool,
    json_out: bool,
    launcher: str | None,
    hydra_overrides: list[str],
    tracking_uri: str | None,
    retry_failed: bool,
    err: Console,
) -> dict[str, Any]:
    """`--engine NAME` of an engine launched apart (verl): print each run's command (--dry-run,
    --json), or freeze and submit them."""

    mpath = manifest_path(results_dir, spec.name)
    check_engine_runs(eng, [cfg for _, cfg, _ in manifest_runs(merge(existing, spec, exp).manifest)], spec.source)
    if dry_run or json_out:
        mg = merge(existing, spec, exp)
        warn(err, list(exp.warnings) + mg.warnings)
        for p in plans_of(
            eng,
            mg.manifest,
            spec.name,
            results_dir=results_dir,
            hydra_overrides=hydra_overrides,
            tracking_uri=tracking_uri,
        ):
            if json_out:
                sys.stdout.write(
                    json.dumps(
                        {
                            "run_id": p["run_id"],
                            "label": p["label"],
                            "env": p["env"],
                            "command": p["command"],
                            "data_dir": p["data_dir"],
                        }
                    )
                    + "\n"
                )
            else:
                line = eng.shell_line(p["command"], p["env"], sep=" \\\n    ")
                sys.stdout.write(f"# {p['run_id']}  {p['label']}\n{line}\n\n")
        sys.stdout.flush()
        if not json_out:
            err.print(f"{len(mg.manifest['runs'])} {eng.name} runs of sweep {spec.name} (dry run: nothing written)")
        return {"sweep": spec.name, "runs": list(mg.manifest["runs"]), "written": False}
    eng.check_launch(launcher)  # before anything is written
    mg = freeze(results_dir, spec, exp)
    warn(err, list(exp.warnings) + mg.warnings)
    plans = plans_of(
        eng,
        mg.manifest,
        spec.name,
        results_dir=results_dir,
        hydra_overrides=hydra_overrides,
        tracking_uri=tracking_uri,
    )
    skipped, submitted = submit_plans(
        eng, plans, mpath.parent, launcher=launcher, hydra_overrides=hydra_overrides, retry_failed=retry_failed
    )
    for p in skipped:
        err.print(f"{p['run_id']} {p['label']}: already submitted ({p['status']['submitted'].get('job')}); skipped")
    for s in submitted:
        err.print(f"{s['plan']['run_id']} {s['plan']['label']}: {launcher or 'local'} {s['job']}")
    return {
        "sweep": spec.name,
        "runs": list(mg.manifest["runs"]),
        "written": True,
        "submitted": [{"run_id": s["plan"]["run_id"], "job": s["job"]} for s in submitted],
    }


# ---------------------------------------------------------------------------------------------


def check_run_files(sweep_dir: Path, run_ids: Iterable[str] = ()) -> None:
    """Read every run's status.json and config.yaml once, and see that every run's directory can be
    one (`run_ids`: the runs planned; a dangling symbolic link, a file): a damaged one is a
    StoreError line now, not a traceback halfway through the sweep."""
    for rid in run_ids:
        check_run_path(sweep_dir / rid)
    for rd in list_run_dirs(sweep_dir):
        rd.status()
        rd.read_config()


def check_frozen_configs(mpath: Path, manifest: dict | None) -> None:
    """Every run config frozen in the manifest still loads (types included): one StoreError line
    naming the run and the key, before anything is written (not a traceback when the run starts)."""
    for rid, cfg in (manifest or {}).get("runs", {}).items():
        try:
            from_dict(cfg)
        except Exception as e:  # noqa: BLE001 - omegaconf's ValidationError, a ConfigError, a TypeError
            key = getattr(e, "full_key", None) or getattr(e, "key", None)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise StoreError(
                mpath, f"the frozen config of run {rid}{f' ({key})' if key else ''}: {first}", REMEDIES["manifest"]
            ) from None


def check_writable_store(sweep_dir: Path) -> None:
    """In a writable results dir, a directory this sweep writes into that is read-only (the sweep's,
    its .locks/, a run's): one line, before anything is written."""
    for d in [sweep_dir, sweep_dir / LOCK_DIR, *(rd.path for rd in list_run_dirs(sweep_dir))]:
        if d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
            raise UserError(
                f"{d}: not writable by this user (a read-only directory inside the results store): make it "
                f"writable (chmod -R u+w {d}) or use another --results-dir; nothing was written"
            )


def preflight_runs(configs: list[dict]) -> None:
    """The trainer's preflight (model, task and benchmarks load) once per distinct setting of the
    runs entering the manifest (seeds and objectives share one), before it is written, and for each
    other objective of a setting what the objective changes: the engine's check (a rule reading an
    input the engine does not feed) and a plugin rule's own code. Runs frozen earlier were checked
    when they entered it."""

    settings, runs = set(), set()
    for cfg in configs:
        run = _distinct(cfg, "seed", "name", "tracking")
        if run in runs:
            continue
        runs.add(run)
        setting = _distinct(cfg, "seed", "name", "objective", "tracking")
        if setting not in settings:
            settings.add(setting)
            preflight(from_dict(cfg))
        else:
            check(from_dict(cfg))
            check_plugin_code(from_dict(cfg))


def check_engine_runs(eng: Engine, configs: list[dict], source: str | None) -> None:
    """An engine launched apart: its check of every distinct run (seeds share one) before anything is
    planned or written, one line naming the key, the engine and why (a component it cannot feed
    would fail on its workers)."""
    seen = set()
    for cfg in configs:
        key = _distinct(cfg, "seed", "name", "tracking")
        if key not in seen:
            seen.add(key)
            eng.check(from_dict(cfg), source)


def _distinct(cfg: dict, *without: str) -> str:
    """A run config without the keys `without`, as one comparable string."""
    return json.dumps({k: v for k, v in cfg.items() if k not in without}, sort_keys=True, default=str)


def _parent_run(spec: SweepSpec, runs, results_dir: Path, tracking_uri: str | None, mpath: Path):
    """(parent run id or None, tracking URI, experiment); (None, None, None) when tracking is off."""
    if not runs or not any(setting(cfg, "tracking.mlflow") for _, cfg, _ in runs):
        return None, None, None

    first = runs[0][1]
    uri = resolve_tracking_uri(tracking_uri, setting(first, "tracking.tracking_uri"), results_dir)
    experiment = setting(first, "tracking.experiment")
    pid = sweep_parent_run(
        results_dir=results_dir,
        sweep=spec.name,
        experiment=experiment,
        tracking_uri=tracking_uri,
        config_uri=setting(first, "tracking.tracking_uri"),
        manifest_path=mpath,
    )
    return pid, uri, experiment


def _finish_parent(parent: str | None, uri: str | None, experiment: str | None, sweep: str, status: str) -> None:
    """Close the parent run, also one a run created when MLflow came back mid-sweep (found by tags)."""
    if uri and status != "RUNNING":
        finish_parent_run(parent, status, uri=uri, sweep=sweep, experiment=experiment or "clipbench")


def _warm_metrics_cache(results_dir: Path, sweep: str) -> None:
    """Parse the new metrics once now, so the report that follows reads the sweep's cache."""
    try:
        load_sweep_metrics(results_dir, sweep)
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


__all__ = ["sweep_command", "plan", "plan_table", "split_overrides", "label"]
