"""Hydra's launcher plugins for a sweep: which launchers exist, the command that starts them, per-run resources.

`clipbench sweep FILE --launcher joblib|submitit_slurm|submitit_local|ray` freezes the manifest,
then starts the Hydra app (clipbench.sweep.hydra_job) in multirun mode over the run ids still to do:

    python -m clipbench.sweep.hydra_job --multirun manifest=/abs/results/s/manifest.json \\
        run_id='1bd04df439fd','e6071dc50487' hydra/launcher=submitit_slurm \\
        hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=1 hydra.launcher.timeout_min=240

Each job is one run (`clipbench.sweep.execute.run_one`: run lock, skip / resume / start, status in
the store). Launcher settings come from `hydra.*` overrides on the `clipbench sweep` command line.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from clipbench.errors import UserError
from clipbench.registry import Registry

# launcher name -> (plugin module, pip package); None: built into hydra-core.
LAUNCHERS: Registry[tuple[str, str] | None] = Registry("launcher")
LAUNCHERS.register("basic", None)
LAUNCHERS.register("joblib", ("hydra_plugins.hydra_joblib_launcher", "hydra-joblib-launcher"))
LAUNCHERS.register("submitit_slurm", ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"))
LAUNCHERS.register("submitit_local", ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"))
LAUNCHERS.register("ray", ("hydra_plugins.hydra_ray_launcher", "hydra-ray-launcher"))
HYDRA_APP = "clipbench.sweep.hydra_job"  # the app the launchers start (each job: one run)
# Hydra override values are parsed by its grammar; a run id like 123e45678901 would become a float.
MAX_IDS_PER_CALL = 4000  # keeps one argv element well under Linux's 128 KiB limit


def check_launcher(name: str) -> None:
    if name not in LAUNCHERS:
        raise UserError("--launcher: " + LAUNCHERS.unknown(name))
    plugin = LAUNCHERS[name]
    if plugin is not None and importlib.util.find_spec(plugin[0]) is None:
        raise UserError(f"--launcher {name}: the Hydra plugin is not installed; pip install {plugin[1]}")


def _quote(s: str) -> str:
    return "'" + str(s).replace("\\", "\\\\").replace("'", "\\'") + "'"


def hydra_command(
    manifest: str | Path,
    run_ids: list[str],
    *,
    launcher: str,
    jobs: int | None,
    hydra_overrides: list[str] = (),
    retry_failed: bool = False,
    tracking_uri: str | None = None,
    parent_run_id: str | None = None,
    threads: int | None = None,
    sweep_dir: str | Path,
) -> list[str]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cmd = [
        sys.executable,
        "-m",
        HYDRA_APP,
        "--multirun",
        f"manifest={_quote(Path(manifest).resolve())}",
        "run_id=" + ",".join(_quote(r) for r in run_ids),
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={_quote(Path(sweep_dir).resolve() / '.hydra' / stamp)}",
        "hydra.sweep.subdir=${run_id}",
        f"retry_failed={str(bool(retry_failed)).lower()}",
    ]
    if tracking_uri:
        cmd.append(f"tracking_uri={_quote(tracking_uri)}")
    if parent_run_id:
        cmd.append(f"parent_run_id={_quote(parent_run_id)}")
    if threads:
        cmd.append(f"threads={int(threads)}")
    if launcher == "joblib" and jobs and not _sets(hydra_overrides, "hydra.launcher.n_jobs"):
        cmd.append(f"hydra.launcher.n_jobs={int(jobs)}")
    if (
        launcher == "ray"
        and _joins_ray_cluster(hydra_overrides)
        and not _sets(hydra_overrides, "hydra.launcher.ray.init.object_store_memory")
    ):
        # The plugin sets a small object store for the Ray instance it would start itself; Ray refuses
        # that setting when it joins a running cluster ("object_store_memory must not be provided").
        cmd.append("+hydra.launcher.ray.init.object_store_memory=null")
    return cmd + list(hydra_overrides)


def _sets(overrides, key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def _joins_ray_cluster(overrides) -> bool:
    """An address for ray.init (an override, or RAY_ADDRESS): the jobs go to a running cluster."""
    for o in overrides:
        k, _, v = o.lstrip("+").partition("=")
        if k == "hydra.launcher.ray.init.address":
            return v not in ("", "null", "None")
    return bool(os.environ.get("RAY_ADDRESS"))


# Launcher settings that are the resources of one job, read as resources per process: a run trained
# by N processes (launch.nproc_per_node; its job starts torchrun) gets N times them, and N CPUs when
# none is given.
PER_PROCESS = {
    "ray": (
        "hydra.launcher.ray.remote.num_cpus",
        "hydra.launcher.ray.remote.num_gpus",
        "hydra.launcher.ray.remote.memory",
    ),
    "submitit_slurm": ("hydra.launcher.cpus_per_task", "hydra.launcher.gpus_per_node", "hydra.launcher.mem_gb"),
    "submitit_local": ("hydra.launcher.cpus_per_task", "hydra.launcher.gpus_per_node", "hydra.launcher.mem_gb"),
}


def per_run_resources(launcher: str, overrides: list[str], nproc: int) -> list[str]:
    """The launcher overrides for the jobs of runs trained by `nproc` processes each."""
    keys = PER_PROCESS.get(launcher, ())
    if nproc == 1 or not keys:
        return list(overrides)
    out, scaled = [], False
    for o in overrides:
        k, _, v = o.partition("=")
        if k.lstrip("+~") in keys:
            try:
                v = _number(float(v) * nproc)
            except ValueError:
                raise UserError(
                    f"'{o}': a resource of one process must be a number (runs with "
                    f"launch.nproc_per_node={nproc} get {nproc} times it)"
                ) from None
            scaled = True
        out.append(f"{k}={v}")
    if not scaled:  # at least one CPU per process
        out.append(("+" if launcher == "ray" else "") + f"{keys[0]}={nproc}")
    return out


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def launch(manifest: str | Path, run_ids: list[str], *, nprocs: dict[str, int] | None = None, **kw) -> int:
    """Run the Hydra app over `run_ids` (one launch per process count, in chunks); returns the worst
    exit code. `nprocs`: run id -> launch.nproc_per_node (default 1)."""
    groups: dict[int, list[str]] = {}
    for rid in run_ids:
        groups.setdefault(int((nprocs or {}).get(rid, 1)), []).append(rid)
    rc = 0
    for nproc, ids in groups.items():
        over = per_run_resources(kw["launcher"], list(kw.get("hydra_overrides", ())), nproc)
        for i in range(0, len(ids), MAX_IDS_PER_CALL):
            cmd = hydra_command(manifest, ids[i : i + MAX_IDS_PER_CALL], **{**kw, "hydra_overrides": over})
            rc = max(rc, subprocess.run(cmd).returncode)
    return rc
