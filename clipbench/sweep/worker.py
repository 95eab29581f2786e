"""Run one run of a frozen manifest in this process: the unit of work of every launcher.

    python -m clipbench.sweep.worker results/nsr_vs_decay/manifest.json 1bd04df439fd [--retry-failed]

Used directly for hand-written job arrays (SLURM `--array`, one run id per task) and by the Hydra
app (`clipbench.sweep.hydra_app`). Exit code 0 when the run is finished (now or before), skipped
because another process holds it, or a failed run left alone; 1 when it failed now.

`--as-rank`: this process is one of the N torchrun processes of a run with launch.nproc_per_node = N
(started by `run_one`, which holds the run lock and its status): it only trains.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clipbench.errors import UserError, unknown_choice
from clipbench.sweep.execute import RunTask, run_one, train_as_rank
from clipbench.sweep.expand import run_label
from clipbench.sweep.manifest import read_manifest


def task_from_manifest(manifest: str | Path, run_id: str, *, retry_failed: bool = False,
                       tracking_uri: str | None = None, parent_run_id: str | None = None,
                       threads: int | None = None) -> RunTask:
    path = Path(manifest).resolve()
    m = read_manifest(path)
    if m is None:
        raise UserError(f"manifest not found: {path}")
    if run_id not in m["runs"]:
        raise UserError(f"{path}: " + unknown_choice("run id", run_id, list(m["runs"])[:20]))
    from clipbench.objectives.plugins import check_plugin_records

    check_plugin_records(m.get("plugins", []), f"sweep '{path.parent.name}'")
    return RunTask(results_dir=str(path.parent.parent), sweep=path.parent.name, run_id=run_id,
                   config=m["runs"][run_id], label=run_label(m["runs"][run_id], m.get("points", {}).get(run_id)),
                   retry_failed=retry_failed, tracking_uri=tracking_uri, parent_run_id=parent_run_id,
                   threads=threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clipbench.sweep.worker", description=__doc__.splitlines()[0])
    ap.add_argument("manifest")
    ap.add_argument("run_id")
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--parent-run-id", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--as-rank", action="store_true", help="train as one torchrun rank (started by the sweep)")
    a = ap.parse_args(argv)
    try:
        task = task_from_manifest(a.manifest, a.run_id, retry_failed=a.retry_failed, tracking_uri=a.tracking_uri,
                                  parent_run_id=a.parent_run_id, threads=a.threads)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if a.as_rank:
        train_as_rank(task)
        return 0

    def progress(ev: dict) -> None:
        print(json.dumps({"run_id": task.run_id, **ev}), flush=True)

    res = run_one(task, progress=progress)
    print(json.dumps(res, default=str), flush=True)
    return 1 if res["outcome"] == "failed" else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
