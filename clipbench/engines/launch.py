"""Running one run as processes: the body of each rank, and the launcher that starts N of them.

    run_as_rank(cfg, rd, resume=..., make_sink=...)   # one process, or one rank: the run's engine trains
    launch_ranks(n, "clipbench", ["train", ...], rd)  # torchrun over n local processes; waits

Used by `clipbench train` and by a sweep's runs (clipbench.sweep.execute), so both treat failures
alike: an exception marks the run failed (rank 0 writes the error and traceback to status.json);
Ctrl-C does not (the run stays resumable). SIGTERM (and the run's launch.preempt_signal) asks the
built-in loop to stop at its next safe point with a checkpoint (train/preempt.py: status preempted,
`RunPreempted`); the launcher passes the signal on to torchrun, which passes it to the ranks. When a
launch's processes exit non-zero, the launcher marks the run failed, keeping a rank's own error when
it wrote one and a preemption when the ranks stopped for one (a rank that died makes the others' next
collective fail: that run fails).
"""

from __future__ import annotations

import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from clipbench.engines import engine_of, train_run
from clipbench.errors import RunFailed, RunPreempted, no_space_left, out_of_memory
from clipbench.objectives.plugins import ensure_plugins
from clipbench.tracking.store import RunDir, RunState
from clipbench.train.distributed import close_distributed, init_distributed, raise_on_sigterm, torchrun_command
from clipbench.train.preempt import NO_STOP, StopRequest, preempt_signals


def run_as_rank(
    cfg,
    rd: RunDir,
    *,
    resume: bool,
    make_sink: Callable[[], object] | None = None,
    progress: Callable[[dict], None] | None = None,
    on_rank: Callable | None = None,
) -> dict:
    """Train `cfg` into `rd` as this process's part: the whole run in one process, or one rank of a
    torchrun launch (the process group is set up and torn down here), trained by the run's engine
    (`train_run`). Rank 0 gets the sink (`make_sink()`) and the progress callback. `on_rank(dist)`
    runs once the rank is known."""

    preemptible = engine_of(cfg).preemptible
    stop = StopRequest.install(preempt_signals(cfg)) if preemptible else NO_STOP  # before setup: a signal waits
    dist = init_distributed(cfg.model.device)
    if dist.sharded and not preemptible:
        raise_on_sigterm()
    if on_rank is not None:
        on_rank(dist)
    sink = make_sink() if make_sink is not None and dist.main else None
    status = "FAILED"
    try:
        ensure_plugins(cfg)  # the run's rule files, in whichever process runs it (every rank)
        summary = train_run(
            cfg, rd.path, resume=resume, sink=sink, progress=progress if dist.main else None, dist=dist, stop=stop
        )
        status = "FINISHED"
        return summary
    except BaseException as e:
        # Ctrl-C (or an exit asked of a single process) interrupts and a preemption checkpoints: the
        # run stays resumable. Anything else fails it (a rank's error, or a dead rank's collective).
        if isinstance(e, (KeyboardInterrupt, RunPreempted)) or (isinstance(e, SystemExit) and not dist.sharded):
            status = "KILLED"
        elif (full := no_space_left(e)) is not None:
            if dist.main:
                raise rd.fail_for_disk(full) from None  # one line, not the writers' tracebacks
        elif (oom := out_of_memory(e)) is not None:
            if dist.main:  # one line; a rerun of the same command resumes it (like a full disk)
                msg = f"out of memory ({type(oom).__name__}: {(str(oom).strip().splitlines() or [''])[0][:160]})"
                rd.set_status(RunState.FAILED, error=msg, reason="out-of-memory", failed_at=time.time())
                raise RunFailed(
                    f"{msg}: this process's memory limit (`ulimit -v`, a cgroup) or the machine is too small for "
                    f"run {rd.run_id}; raise it and rerun the same command to resume"
                ) from None
        elif dist.main:
            rd.set_status(
                RunState.FAILED,
                error=f"{type(e).__name__}: {e}"[:2000],
                traceback=traceback.format_exc()[-8000:],
                failed_at=time.time(),
            )
        raise
    finally:
        stop.restore()
        if sink is not None:
            sink.close(status)  # the MLflow mirror flushed, also on a preemption
        close_distributed()
        if stop.received is not None and status == "KILLED":
            stop.chain()  # e.g. submitit's handler: requeue the job, which resumes the run


def launch_ranks(
    nproc: int, module: str, args: list[str], rd: RunDir, *, log: Path | None = None, signals: list[str] = ("SIGTERM",)
) -> int:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGS`, waited for; the run is marked failed
    when it exits non-zero (unless its ranks marked it preempted). `log`: a file for the ranks' output
    (default: this terminal). `signals` (the run's preemption signals, `preempt_signals`) received
    here are passed on to torchrun, which passes them to the ranks."""
    cmd = torchrun_command(nproc, module, args, signals)
    out = open(log, "ab") if log is not None else None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    stop = StopRequest.install(signals, forward=lambda signum: [p.send_signal(signum) for p in procs])
    try:
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None))
        if stop.received is not None:  # asked before torchrun existed
            procs[0].send_signal(stop.received)
        rc = procs[0].wait()
    finally:
        stop.restore()
        if out is not None:
            out.close()
    if rc != 0:
        fail_run(rd, f"torchrun over {nproc} processes exited with code {rc}" + (f" (log: {log})" if log else ""))
    if stop.received is not None and rd.state is RunState.PREEMPTED:
        stop.chain()  # e.g. submitit's handler: requeue the job, which resumes the run
    return rc


def fail_run(rd: RunDir, error: str) -> None:
    """Mark a run failed after its processes exited, keeping a rank's own (more precise) error and a
    preemption (the ranks checkpointed and stopped: resumable)."""
    status = rd.status() if rd.status_path.exists() else {}
    if (status.get("state") == RunState.FAILED and status.get("error")) or status.get("state") == RunState.PREEMPTED:
        return
    rd.set_status(RunState.FAILED, error=error, failed_at=time.time())
