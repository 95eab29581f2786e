"""Running a sweep's runs: one at a time in this process, or in N local worker processes.

The results store decides what to do with each run (it is the source of truth):

    status finished                      -> skipped
    status failed                        -> skipped, rerun (from its checkpoint if any) with --retry-failed
    otherwise, with a complete checkpoint -> resumed: train_run(..., resume=True) (the run's engine);
                                            a preempted run (status preempted) is one of these
    otherwise                            -> started from scratch (the engine cleans the directory)

Each run is trained under its run lock (`<sweep>/.locks/<run_id>.lock`); a process that cannot take
the lock at once skips the run ("locked"), so two sweep processes on one results dir share the work.
A run that raises is marked failed (error and traceback in status.json) and the sweep goes on.

A run with `launch.nproc_per_node` N > 1 is trained by N torchrun processes on this node, each running
`python -m clipbench.sweep.worker MANIFEST RUN_ID --as-rank`; this process keeps the lock and the
status, the ranks' output goes to `<run_dir>/torchrun.log`, and a rank that dies fails the run like
any failing run (resumed from its checkpoint with --retry-failed). Its per-step progress is not shown.

Preemption (SIGTERM, or a run's launch.preempt_signal): the running runs finish their optimizer step,
checkpoint and stop (outcome "preempted"), no further run starts, and rerunning the same command
resumes them. The sweep passes a signal it receives on to the processes that train (its pool's
workers, a run's torchrun); a worker that was signalled, or whose sweep was, starts no further run
(outcome "not-started"), also when the signal came while it was idle or while a run was in its final
evaluation. A worker dies with its sweep (Linux: a parent-death signal): a `kill -9` of the sweep
process leaves its runs checkpointed and no worker behind.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from enum import Enum
from multiprocessing import resource_tracker
from pathlib import Path

import torch

from clipbench.config import RunConfig, from_dict
from clipbench.config.labels import run_label
from clipbench.engines.launch import launch_ranks, run_as_rank
from clipbench.errors import PREEMPTED_EXIT, DiskFull, RunPreempted, UserError, no_space_left, unknown_choice
from clipbench.objectives.plugins import check_plugin_records
from clipbench.sweep.manifest import read_manifest
from clipbench.tracking.lock import try_run_lock
from clipbench.tracking.mlflow_sink import run_sink
from clipbench.tracking.store import RunDir, RunState
from clipbench.train.checkpoint import checkpoint_step as step_of
from clipbench.train.checkpoint import find_checkpoint, has_checkpoint_dir
from clipbench.train.preempt import STOP_SIGNALS, StopRequest, preempt_signals


@dataclass(frozen=True)
class RunTask:
    """Everything a (possibly remote) worker needs for one run; picklable."""

    results_dir: str
    sweep: str
    run_id: str
    config: RunConfig  # read once from the manifest's stored form (`run_task`)
    label: str = ""
    retry_failed: bool = False
    tracking_uri: str | None = None
    parent_run_id: str | None = None
    threads: int | None = None  # torch intra-op threads in this worker (None: leave torch's default)

    @property
    def run_dir(self) -> RunDir:
        return RunDir(Path(self.results_dir) / self.sweep / self.run_id)


def run_task(
    results_dir: str | Path, sweep: str, run_id: str, stored: Mapping, point: Mapping | None, **options
) -> RunTask:
    """The task of one run of a manifest: its stored config read into a RunConfig once, its label
    (`config.labels.run_label`); `options`: RunTask's others (retry_failed, tracking_uri, ...)."""
    return RunTask(str(results_dir), sweep, run_id, from_dict(stored), run_label(stored, point), **options)


def task_from_manifest(
    manifest: str | Path,
    run_id: str,
    *,
    retry_failed: bool = False,
    tracking_uri: str | None = None,
    parent_run_id: str | None = None,
    threads: int | None = None,
) -> RunTask:
    path = Path(manifest).resolve()
    m = read_manifest(path)
    if m is None:
        raise UserError(f"manifest not found: {path}")
    if run_id not in m["runs"]:
        raise UserError(f"{path}: " + unknown_choice("run id", run_id, list(m["runs"])[:20]))

    check_plugin_records(m.get("plugins", []), f"sweep '{path.parent.name}'")
    return run_task(
        path.parent.parent,
        path.parent.name,
        run_id,
        m["runs"][run_id],
        m.get("points", {}).get(run_id),
        retry_failed=retry_failed,
        tracking_uri=tracking_uri,
        parent_run_id=parent_run_id,
        threads=threads,
    )


def checkpoint_step(rd: RunDir) -> int | None:
    """The step of the run's newest complete checkpoint (clipbench.train.checkpoint owns the layout)."""

    ckpt = find_checkpoint(rd.checkpoint_dir)
    return None if ckpt is None else step_of(ckpt)


RETRIED = ("disk-full", "out-of-memory", "worker-killed")  # failures the same command retries (resumes)


class Next(str, Enum):
    """What a sweep does next with one of its runs (`classify`): skip it, finished or failed (its
    RunState, by the same name), or train it, resuming from a checkpoint or from the start. A str, so
    it prints and serialises as its plain name."""

    FINISHED = RunState.FINISHED.value  # skipped
    FAILED = RunState.FAILED.value  # skipped (--retry-failed trains it again)
    RESUME = "resume"
    START = "start"

    @property
    def trains(self) -> bool:
        return self in (Next.RESUME, Next.START)


def classify(rd: RunDir, retry_failed: bool = False) -> Next:
    """What to do with a run, from the store alone. A run that a full disk, a memory limit or a killed
    worker stopped is not skipped: the same command resumes it."""
    status = rd.status()
    state = RunState(status.get("state", RunState.PENDING.value))
    if state is RunState.FINISHED:
        return Next.FINISHED
    if state is RunState.FAILED and not retry_failed and status.get("reason") not in RETRIED:
        return Next.FAILED
    return Next.RESUME if checkpoint_step(rd) is not None or has_checkpoint_dir(rd.checkpoint_dir) else Next.START


def _outcome(task: RunTask, outcome: str, t0: float, **extra) -> dict:
    return {
        "run_id": task.run_id,
        "label": task.label,
        "outcome": outcome,
        "seconds": round(time.time() - t0, 2),
        **extra,
    }


def _make_sink(task: RunTask, cfg, rd: RunDir, resume: bool):
    return run_sink(
        cfg,
        rd,
        results_dir=task.results_dir,
        sweep=task.sweep,
        tracking_uri=task.tracking_uri,
        parent_run_id=task.parent_run_id,
        run_name=task.label or None,
        resume=resume,
    )


def _quiet_libraries() -> None:
    """The sweep draws its own progress bars: no per-checkpoint tqdm bars from transformers/hub."""
    try:
        import huggingface_hub.utils as hub_utils  # noqa: PLC0415 - huggingface_hub is heavy
        import transformers.utils.logging as tf_logging  # noqa: PLC0415 - transformers is heavy

        tf_logging.disable_progress_bar()
        hub_utils.disable_progress_bars()
    except Exception:  # noqa: BLE001 - cosmetic
        pass


def run_one(
    task: RunTask,
    *,
    progress: Callable[[dict], None] | None = None,
    on_start: Callable[[str, int, str], None] | None = None,
) -> dict:
    """Train (or skip, or resume) one run of a sweep. Returns {"run_id", "outcome", ...}; never raises
    for a failing run (KeyboardInterrupt/SystemExit propagate and leave the run resumable)."""
    t0 = time.time()
    try:
        return _run_one(task, t0, progress=progress, on_start=on_start)
    except DiskFull as e:
        return _outcome(task, "disk-full", t0, error=str(e))
    except OSError as e:  # writing the run's lock or status before training: the run's own files are whole
        if (full := no_space_left(e)) is None:
            raise
        return _outcome(task, "disk-full", t0, error=str(task.run_dir.fail_for_disk(full)))


def _run_one(task: RunTask, t0: float, *, progress, on_start) -> dict:
    rd = task.run_dir
    sweep_dir = rd.path.parent
    with try_run_lock(sweep_dir, task.run_id) as got:
        if not got:
            return _outcome(task, "locked", t0)
        action = classify(rd, task.retry_failed)  # re-read under the lock: another process may have finished it
        if action is Next.FINISHED:
            return _outcome(task, "skipped", t0)
        if action is Next.FAILED:
            return _outcome(task, "failed-skipped", t0, error=rd.status().get("error"))

        if task.threads:
            torch.set_num_threads(task.threads)
        _quiet_libraries()

        cfg = task.config
        from_step = checkpoint_step(rd)
        resume = action is Next.RESUME  # also a damaged checkpoint: the run says so and sets it aside
        rd.start_attempt(sweep=task.sweep, resumed_from=from_step, pid=os.getpid())
        if on_start:
            on_start(task.run_id, cfg.train.steps, action.value)
        n = cfg.launch.nproc_per_node
        if n > 1:
            manifest = str(Path(task.results_dir) / task.sweep / "manifest.json")
            args = [manifest, task.run_id, "--as-rank", *_worker_args(task)]

            rc = launch_ranks(
                n, "clipbench.sweep.worker", args, rd, log=rd.path / "torchrun.log", signals=preempt_signals(cfg)
            )
            if rd.state is RunState.PREEMPTED:
                return _outcome(task, "preempted", t0, **_resumed(rd, from_step), step=rd.status().get("step"))
            if rc != 0:
                st = rd.status()
                outcome = "disk-full" if st.get("reason") == "disk-full" else "failed"
                return _outcome(task, outcome, t0, error=str(st.get("error", f"exit code {rc}"))[:500])
            return _outcome(task, "resumed" if resume else "finished", t0, **_resumed(rd, from_step))
        sinks = []

        def make_sink():
            sinks.append(_make_sink(task, cfg, rd, resume))
            return sinks[-1]

        try:
            summary = run_as_rank(cfg, rd, resume=resume, make_sink=make_sink, progress=progress)
        except RunPreempted:  # checkpointed: the next invocation resumes it
            return _outcome(task, "preempted", t0, **_resumed(rd, from_step), step=rd.status().get("step"))
        except DiskFull:
            raise
        except BaseException as e:  # a failing run must not stop the sweep (run_as_rank marked it failed)
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise  # not the run's failure (DCP's CheckpointException is a BaseException: it is one)
            return _outcome(task, "failed", t0, error=f"{type(e).__name__}: {first_line(e)}"[:500])
        offline = bool(sinks) and getattr(sinks[0], "offline", False) and cfg.tracking.mlflow
        last = {k: v for k, v in (summary.get("last") or {}).items() if k in ("reward/mean", "accuracy", "entropy")}
        evals = {k: v for k, v in summary.items() if k.startswith("eval/")}
        resumed = _resumed(rd, from_step)
        return _outcome(
            task,
            "resumed" if resumed["resumed_from"] is not None else "finished",
            t0,
            **resumed,
            mlflow_offline=bool(offline),
            last=last,
            evals=evals,
        )


def _resumed(rd: RunDir, from_step: int | None) -> dict:
    """{"resumed_from": the step the run resumed from, "notes": what its resume set aside or
    restored (status.json's checkpoint_notes; empty when nothing)}."""
    st = rd.status()
    notes = st.get("checkpoint_notes") or []
    return {"resumed_from": st.get("resumed_from") if notes else from_step, "notes": notes}


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _worker_args(task: RunTask) -> list[str]:
    """The options of `python -m clipbench.sweep.worker` that rebuild `task` from the manifest."""
    args = ["--tracking-uri", task.tracking_uri] if task.tracking_uri else []
    args += ["--parent-run-id", task.parent_run_id] if task.parent_run_id else []
    return args + (["--retry-failed"] if task.retry_failed else [])


def train_as_rank(task: RunTask) -> None:
    """One rank of a run that `run_one` launched over N processes (it holds the lock and the status)."""

    _quiet_libraries()
    cfg, rd = task.config, task.run_dir
    resume = checkpoint_step(rd) is not None or has_checkpoint_dir(rd.checkpoint_dir)
    run_as_rank(cfg, rd, resume=resume, make_sink=lambda: _make_sink(task, cfg, rd, resume))


# ---------------------------------------------------------------------------------------------
# Sequential and process-pool execution


def run_sequential(tasks: list[RunTask], ui=None) -> list[dict]:
    out = []
    preempt = StopRequest.install(STOP_SIGNALS)  # between runs: start no further one (a run installs its own)
    try:
        return _run_each(tasks, ui, preempt, out)
    finally:
        preempt.restore()


def _run_each(tasks: list[RunTask], ui, preempt, out: list[dict]) -> list[dict]:
    for i, task in enumerate(tasks):
        if preempt.received is not None:  # a run's own handler passes its signal on when it ends
            out.extend(_outcome(t, "not-started", time.time()) for t in tasks[i:])
            break
        started = []

        def on_start(rid, steps, action, _t=task):
            started.append(action)
            if ui is not None:
                ui.start_run(rid, _t.label, steps)

        res = run_one(task, progress=ui.callback(task.run_id) if ui is not None else None, on_start=on_start)
        if ui is not None:
            ui.end_run(task.run_id, res["outcome"], task.label, _detail(res))
        out.append(res)
        if res["outcome"] in STOPS_SWEEP:  # the machine is being taken back, or the disk is full: start nothing more
            out.extend(_outcome(t, "not-started", time.time()) for t in tasks[i + 1 :])
            break
    return out


STOPS_SWEEP = ("preempted", "disk-full")  # outcomes after which a sweep starts no further run

_QUEUE = None
_STOP = None  # the sweep's "start no further run" (a multiprocessing Event the sweep sets on a signal)
_IDLE = None  # this worker's StopRequest between runs: a signal received here is kept
_PARENT = None  # the sweep's pid: a worker whose sweep died exits


def _pool_init(q, threads: int, stop, parent: int) -> None:
    global _QUEUE, _STOP, _IDLE, _PARENT
    _QUEUE, _STOP, _PARENT = q, stop, parent
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)

    # Between runs a signal is kept (no further run starts here); a run installs its own handlers
    # inside these and passes a signal it received back out when it ends (StopRequest.restore).
    _IDLE = StopRequest.install(STOP_SIGNALS, forward=lambda signum: _exit_if_orphaned())
    _die_with_parent()
    if q is not None:
        q.put(("pid", os.getpid()))


def _die_with_parent() -> None:
    """Linux: the kernel sends this worker SIGTERM when the sweep process dies (kill -9 included), so a
    worker never outlives its sweep: a run it trains checkpoints at its next safe point and the worker
    exits; an idle one exits at once. Elsewhere a worker notices after its run."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    _exit_if_orphaned()  # the sweep may have died before the line above


def _exit_if_orphaned() -> None:
    if _PARENT is not None and os.getppid() != _PARENT:
        os._exit(PREEMPTED_EXIT)


def _pool_run(task: RunTask) -> dict:
    q = _QUEUE
    if (_STOP is not None and _STOP.is_set()) or (_IDLE is not None and _IDLE.received is not None):
        return _outcome(task, "not-started", time.time())  # the sweep was asked to stop: start nothing

    def send(*msg):
        if q is not None:
            try:
                q.put_nowait(msg)
            except Exception:  # noqa: BLE001 - progress is cosmetic
                pass

    res = run_one(
        task,
        progress=lambda ev: send("event", task.run_id, ev),
        on_start=lambda rid, steps, action: send("start", rid, steps, action),
    )
    _exit_if_orphaned()  # its sweep died while it trained: the run is checkpointed, nobody waits for it
    return res


def threads_per_worker(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(jobs, 1))


def run_parallel(tasks: list[RunTask], jobs: int, ui=None) -> list[dict]:
    """N spawned worker processes (torch threads = cores // N each); progress flows back on a queue."""
    ctx = mp.get_context("spawn")
    _start_resource_tracker()
    q = ctx.Queue()
    threads = threads_per_worker(jobs)
    tasks = [replace(t, threads=threads) for t in tasks]
    labels = {t.run_id: t.label for t in tasks}
    stop = threading.Event()
    workers: list[int] = []

    def pump():
        while not stop.is_set() or not q.empty():
            try:
                msg = q.get(timeout=0.2)
            except (queue_mod.Empty, EOFError, OSError):
                continue
            if msg[0] == "pid":
                workers.append(msg[1])
            if ui is None:
                continue
            if msg[0] == "start":
                ui.start_run(msg[1], labels.get(msg[1], ""), msg[2])
            elif msg[0] == "event":
                ui.event(msg[1], msg[2])

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    out = []

    stop_runs = ctx.Event()

    def forward(
        signum,
    ):  # no further run starts (also the tasks already queued to a worker); the running ones checkpoint
        stop_runs.set()
        _signal_all(workers, signum)

    preempt = StopRequest.install(STOP_SIGNALS, forward=forward)
    try:
        pending = tasks
        while pending:  # a worker that died breaks the pool: the runs it did not kill go on in a new one
            broken = _run_pool(pending, jobs, ctx, q, threads, stop_runs, preempt, ui, out)
            pending = _after_broken_pool(broken, out, ui, stopping=preempt.received is not None or stop_runs.is_set())
    finally:
        preempt.restore()
        stop.set()
        th.join(timeout=2)
    return out


def _start_resource_tracker() -> None:
    """multiprocessing's resource tracker (a child of this process), started with SIGHUP blocked: it
    ignores SIGINT and SIGTERM itself, and a SIGHUP to the terminal's process group would kill it and
    leave its successor printing KeyErrors for the semaphores it never saw."""
    if not hasattr(signal, "pthread_sigmask"):
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _run_pool(tasks, jobs, ctx, q, threads, stop_runs, preempt, ui, out: list[dict]) -> list[RunTask]:
    """One process pool over `tasks`; outcomes appended to `out`. Returns the tasks whose future a
    broken pool failed (a worker process died: `kill -9`, the kernel's out-of-memory killer)."""
    broken = []
    with ProcessPoolExecutor(
        max_workers=jobs, mp_context=ctx, initializer=_pool_init, initargs=(q, threads, stop_runs, os.getpid())
    ) as ex:
        futs = {ex.submit(_pool_run, t): t for t in tasks}
        for fut in as_completed(futs):
            if preempt.received is not None:
                for f in futs:
                    f.cancel()
            task = futs[fut]
            if fut.cancelled():
                out.append(_outcome(task, "not-started", time.time()))
                continue
            try:
                res = fut.result()
            except BrokenProcessPool:
                broken.append(task)
                continue
            except Exception as e:  # noqa: BLE001
                res = {
                    "run_id": task.run_id,
                    "label": task.label,
                    "outcome": "crashed",
                    "error": f"{type(e).__name__}: {e}",
                }
            if res["outcome"] == "disk-full":  # start no further run (queued ones included); running ones go on
                stop_runs.set()
                for f in futs:
                    f.cancel()
            time.sleep(0.05)  # let the pump drain the run's last events
            if ui is not None:
                ui.end_run(task.run_id, res["outcome"], task.label, _detail(res))
            out.append(res)
    return broken


def _after_broken_pool(broken: list[RunTask], out: list[dict], ui, *, stopping: bool) -> list[RunTask]:
    """The tasks of a broken pool: a run whose worker died while it trained (status still running) is
    marked failed with reason worker-killed (the same command resumes it: classify); the others (a
    sibling the pool stopped at a checkpoint, runs not started yet) are returned to run again, unless
    the sweep is stopping."""
    again = []
    for task in broken:
        rd = task.run_dir
        st = rd.status() if rd.status_path.exists() else {}
        if st.get("state") == RunState.RUNNING.value:
            pid = st.get("pid")
            error = (
                f"its worker process{f' (pid {pid})' if pid else ''} died without a word while it trained "
                "(killed: kill -9, or the kernel's out-of-memory killer)"
            )
            rd.set_status(RunState.FAILED, error=error, reason="worker-killed", failed_at=time.time())
            res = _outcome(task, "killed", time.time(), error=error)
            if ui is not None:
                ui.end_run(task.run_id, "killed", task.label, _detail(res))
            out.append(res)
        elif stopping:
            out.append(_outcome(task, "not-started", time.time()))
        else:
            again.append(task)
    return again


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:  # gone already
            pass


def _detail(res: dict) -> str:
    if res.get("error"):
        return str(res["error"]).splitlines()[0][:160]
    parts = ["checkpoint set aside (see below)"] if any("set aside" in n for n in res.get("notes") or ()) else []
    if res.get("resumed_from") is not None:
        parts.append(f"from step {res['resumed_from']}")
    for k, v in (res.get("evals") or {}).items():
        if "/avg@" in k:
            parts.append(f"{k} {v:.3f}")
    if res.get("seconds"):
        parts.append(f"{res['seconds']:.0f}s")
    if res.get("mlflow_offline"):
        parts.append("mlflow offline")
    return "  ".join(parts)
