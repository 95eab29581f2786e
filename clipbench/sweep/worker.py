"""Run one run of a frozen manifest in this process: the unit of work of every launcher.

    python -m clipbench.sweep.worker results/nsr_vs_decay/manifest.json 1bd04df439fd [--retry-failed]

Used directly for hand-written job arrays (SLURM `--array`, one run id per task); the Hydra
launchers' jobs (`clipbench.sweep.hydra_job`) run the same `run_one`. Exit code 0 when the run is finished (now or before), skipped
because another process holds it, or a failed run left alone; 1 when it failed now.

`--as-rank`: this process is one of the N torchrun processes of a run with launch.nproc_per_node = N
(started by `run_one`, which holds the run lock and its status): it only trains.
"""

from __future__ import annotations

import argparse
import json
import sys

from clipbench.errors import UserError
from clipbench.sweep.execute import run_one, task_from_manifest, train_as_rank


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
        task = task_from_manifest(
            a.manifest,
            a.run_id,
            retry_failed=a.retry_failed,
            tracking_uri=a.tracking_uri,
            parent_run_id=a.parent_run_id,
            threads=a.threads,
        )
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
