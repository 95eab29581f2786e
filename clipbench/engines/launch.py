"""Running one run as processes: the body of each rank, and the launcher that starts N of them.

    run_as_rank(cfg, rd, resume=..., make_sink=...)   # one process, or one rank: the run's engine trains
    launch_ranks(n, "clipbench", ["train", ...], rd)  # torchrun over n local processes; waits

Used by `clipbench train` and by a sweep's runs (clipbench.sweep.execute), so both treat failures
alike: an exception marks the run failed (rank 0 writes the error and traceback to status.json);
SIGTERM of a rank (what torchrun sends the other ranks when one dies) is one; Ctrl-C is not (the
run stays resumable). When a launch's processes exit non-zero, the launcher marks the run failed too, keeping
a rank's own error when it wrote one.
"""

from __future__ import annotations

import subprocess
import time
import traceback
from pathlib import Path
from typing import Callable

from clipbench.tracking.store import RunDir
from clipbench.train.distributed import close_distributed, init_distributed, raise_on_sigterm, torchrun_command


def run_as_rank(cfg, rd: RunDir, *, resume: bool,
                make_sink: Callable[[], object] | None = None, progress: Callable[[dict], None] | None = None,
                on_rank: Callable | None = None) -> dict:
    """Train `cfg` into `rd` as this process's part: the whole run in one process, or one rank of a
    torchrun launch (the process group is set up and torn down here), trained by the run's engine
    (`train_run`). Rank 0 gets the sink (`make_sink()`) and the progress callback. `on_rank(dist)`
    runs once the rank is known."""
    from clipbench.engines import train_run
    from clipbench.objectives.plugins import ensure_plugins

    dist = init_distributed(cfg.model.device)
    if dist.sharded:
        raise_on_sigterm()
    if on_rank is not None:
        on_rank(dist)
    sink = make_sink() if make_sink is not None and dist.main else None
    status = "FAILED"
    try:
        ensure_plugins(cfg)  # the run's rule files, in whichever process runs it (every rank)
        summary = train_run(cfg, rd.path, resume=resume, sink=sink, progress=progress if dist.main else None,
                            dist=dist)
        status = "FINISHED"
        return summary
    except BaseException as e:
        # Ctrl-C (or an exit asked of a single process) interrupts: the run stays resumable. Anything
        # else fails it, SIGTERM of a rank included (torchrun stopping the group after a rank died).
        if isinstance(e, KeyboardInterrupt) or (isinstance(e, SystemExit) and not dist.sharded):
            status = "KILLED"
        elif dist.main:
            rd.set_status("failed", error=f"{type(e).__name__}: {e}"[:2000],
                          traceback=traceback.format_exc()[-8000:], failed_at=time.time())
        raise
    finally:
        if sink is not None:
            sink.close(status)
        close_distributed()


def launch_ranks(nproc: int, module: str, args: list[str], rd: RunDir, *, log: Path | None = None) -> int:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGS`, waited for; the run is marked failed
    when it exits non-zero. `log`: a file for the ranks' output (default: this terminal)."""
    cmd = torchrun_command(nproc, module, args)
    if log is None:
        rc = subprocess.run(cmd).returncode
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        fail_run(rd, f"torchrun over {nproc} processes exited with code {rc}" + (f" (log: {log})" if log else ""))
    return rc


def fail_run(rd: RunDir, error: str) -> None:
    """Mark a run failed after its processes exited, keeping a rank's own (more precise) error."""
    status = rd.status() if rd.status_path.exists() else {}
    if status.get("state") == "failed" and status.get("error"):
        return
    rd.set_status("failed", error=error, failed_at=time.time())
