"""`clipbench sweep FILE --engine NAME` of an engine launched apart (verl): a sweep's runs as the
engine's own commands, planned or submitted.

    plans = plans_of(engine, manifest, sweep, results_dir=..., hydra_overrides=..., tracking_uri=...)
    skipped, submitted = submit_plans(engine, plans, sweep_dir, launcher=..., hydra_overrides=..., retry_failed=...)

The commands themselves are the engine's (`Engine.plan_runs`, `Engine.submit`: clipbench.engines.verl,
one verl trainer command per run config). A real launch freezes the manifest first (the caller),
then writes each run's config.yaml and a status.json that records its submission, so a rerun does
not submit it again.
"""

from __future__ import annotations

from pathlib import Path

from clipbench.config.labels import run_label
from clipbench.config.stored import setting
from clipbench.engines import Engine
from clipbench.sweep.manifest import manifest_runs
from clipbench.tracking.store import RunDir, RunState


def _launcher_setting(hydra_overrides: list[str], key: str) -> str | None:
    return next(
        (o.split("=", 1)[1] for o in hydra_overrides if o.lstrip("+").startswith(f"hydra.launcher.{key}=")), None
    )


def plans_of(
    engine: Engine,
    manifest: dict,
    sweep: str,
    *,
    results_dir: Path,
    hydra_overrides: list[str],
    tracking_uri: str | None,
) -> list[dict]:
    """[{run_id, label, config, data_dir, env, command}] for every run of `manifest`. GPUs per node:
    hydra.launcher.gpus_per_node, else the first run's launch.nproc_per_node (the schema's default
    for a config written before `launch`); nodes: hydra.launcher.nodes."""
    runs = [(rid, cfg, run_label(cfg, point)) for rid, cfg, point in manifest_runs(manifest)]
    gpus = _launcher_setting(hydra_overrides, "gpus_per_node")
    n_gpus = int(gpus or next((setting(cfg, "launch.nproc_per_node") for _, cfg, _ in runs), 1))
    return engine.plan_runs(
        runs,
        results_dir=results_dir,
        sweep=sweep,
        tracking_uri=tracking_uri,
        n_gpus=n_gpus,
        nnodes=int(_launcher_setting(hydra_overrides, "nodes") or 1),
    )


def submit_plans(
    engine: Engine,
    plans: list[dict],
    sweep_dir: Path,
    *,
    launcher: str | None,
    hydra_overrides: list[str],
    retry_failed: bool,
) -> tuple[list[dict], list[dict]]:
    """Submit the plans not submitted before (all of them with `retry_failed`); each submitted run's
    config.yaml and status (pending, with the submission) are written. Returns (skipped plans with
    their status, [{plan, job}])."""
    todo, skipped = [], []
    for p in plans:
        st = RunDir(Path(sweep_dir) / p["run_id"]).status()
        if st.get("submitted") and not retry_failed:
            skipped.append({**p, "status": st})
        else:
            todo.append(p)
    jobs = engine.submit(todo, launcher=launcher, hydra_overrides=hydra_overrides, sweep_dir=sweep_dir) if todo else []
    done = []
    for p, j in zip(todo, jobs):
        rd = RunDir(Path(sweep_dir) / p["run_id"])
        rd.write_config(p["config"])
        rd.set_status(
            RunState.PENDING,
            engine=engine.name,
            submitted={
                "launcher": launcher or "local",
                "job": j["job"],
                "command": engine.shell_line(p["command"], p["env"]),
            },
        )
        done.append({"plan": p, "job": j["job"]})
    return skipped, done
