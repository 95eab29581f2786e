"""`clipbench sweep --jobs N`: N local worker processes, each talking to the sweep over a pipe of its own.

    outcomes = run_parallel(tasks, jobs=2, ui=progress)

The sweep hands one run at a time to an idle worker over that worker's pipe, and reads the run's
progress and its outcome back on the same pipe. Nothing is shared between the workers (no queue,
lock or event), so a worker that dies at any moment, even halfway through writing a message, leaves
the others nothing to wait on. The standard library's pools share locked queues among their
workers: a worker killed while it held a lock (idle, waiting for its next task, as reproduced and
now tested in `tests/test_faults_sweep.py`; or, by reading the code, while sending its progress or
its result) left every other worker, and the sweep with them, waiting forever.

A worker that dies (`kill -9`, the kernel's out-of-memory killer):
- while it trained a run (the run's status says running, with the worker's pid): that run alone is
  reported `killed` and marked failed with reason worker-killed (the same command resumes it, see
  `execute.classify`); the other workers train on undisturbed;
- after its run ended, before its outcome arrived: the store says how the run ended;
- before its run started: the run goes back to the queue once (a second time it is reported
  `killed`, as above).
A new worker takes a dead one's place while runs are waiting; a worker with nothing left to do exits.

Signals (SIGTERM, a run's preempt signal, SIGINT, SIGHUP): the sweep hands out no further run and
passes the signal on to its workers; the running runs checkpoint and stop (`preempted`), the queued
ones are `not-started`. A worker signalled on its own starts no further run, and an outcome that
stops a sweep (`execute.STOPS_SWEEP`) stops the handing out. A worker dies with its sweep (Linux: a
parent-death signal): a `kill -9` of the sweep leaves its runs checkpointed and no worker behind.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait

from clipbench.errors import PREEMPTED_EXIT
from clipbench.sweep.execute import (
    STOPS_SWEEP,
    RunTask,
    make_outcome,
    outcome_detail,
    outcome_from_store,
    run_one,
)
from clipbench.tracking.store import RunState
from clipbench.train.preempt import STOP_SIGNALS, StopRequest


def threads_per_worker(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(jobs, 1))


def run_parallel(tasks: list[RunTask], jobs: int, ui=None) -> list[dict]:
    """Train `tasks` in `jobs` spawned worker processes (torch threads = cores // jobs each); the
    outcomes in the order they arrived."""
    _start_resource_tracker()
    threads = threads_per_worker(jobs)
    pool = _Pool(mp.get_context("spawn"), jobs, threads, ui)
    preempt = StopRequest.install(STOP_SIGNALS, forward=pool.stop)
    try:
        pool.run(deque(replace(t, threads=threads) for t in tasks))
    finally:
        preempt.restore()
        pool.close()
    return pool.out


# ---------------------------------------------------------------------------------------------
# The sweep's side


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection  # the sweep's end of this worker's pipe
    task: RunTask | None = None  # the run it was handed; None: idle
    started: bool = False  # that run has started (the worker said "start")

    def hand(self, task: RunTask | None) -> None:
        """Give it a run (None: exit). A worker that died meanwhile is found by its sentinel."""
        self.task, self.started = task, False
        try:
            self.conn.send(task)
        except OSError:
            pass


class _Pool:
    def __init__(self, ctx, jobs: int, threads: int, ui):
        self.ctx, self.jobs, self.threads, self.ui = ctx, jobs, threads, ui
        self.workers: list[_Worker] = []
        self.retired: list[_Worker] = []  # told to exit; joined at close
        self.out: list[dict] = []
        self.stopping = False  # hand out no further run
        self.requeued: set[str] = set()  # runs whose worker died before starting them, once

    def stop(self, signum: int) -> None:
        """The sweep's signal handler: no further run starts; the running ones checkpoint."""
        self.stopping = True
        for w in self.workers:
            try:
                os.kill(w.process.pid, signum)
            except OSError:  # gone already
                pass

    def run(self, queue: deque[RunTask]) -> None:
        while True:
            if self.stopping:
                self.out.extend(make_outcome(t, "not-started", time.time()) for t in queue)
                queue.clear()
            self._hand_out(queue)
            self._reap()
            if not self.workers:
                return
            ready = wait([w.conn for w in self.workers] + [w.process.sentinel for w in self.workers], timeout=1.0)
            for w in [w for w in self.workers if w.conn in ready or w.process.sentinel in ready]:
                if self._read(w) and w.process.sentinel not in ready:
                    continue  # it lives: its messages are read
                w.process.join(timeout=5)  # its pipe is closed: it is exiting
                if not w.process.is_alive():
                    self._died(w, queue)

    def _hand_out(self, queue: deque[RunTask]) -> None:
        for w in [w for w in self.workers if w.task is None]:
            if queue and not self.stopping:
                w.hand(queue.popleft())
            else:
                w.hand(None)
                self.workers.remove(w)
                self.retired.append(w)
        while queue and not self.stopping and len(self.workers) < self.jobs:
            w = self._spawn()
            self.workers.append(w)
            if self.stopping:  # a signal came while it was being started: it is told to exit
                break
            w.hand(queue.popleft())

    def _reap(self) -> None:
        """Retired workers that have exited are joined (no zombie waits for the sweep's end)."""
        for w in [w for w in self.retired if not w.process.is_alive()]:
            w.conn.close()
            self.retired.remove(w)

    def _spawn(self) -> _Worker:
        ours, theirs = self.ctx.Pipe(duplex=True)
        p = self.ctx.Process(target=_worker_main, args=(theirs, self.threads, os.getpid()), name="clipbench-worker")
        p.start()
        theirs.close()  # the worker holds the only other end: its death is our end's EOF
        return _Worker(p, ours)

    def _read(self, w: _Worker) -> bool:
        """Every message the worker has sent; False once its pipe is closed."""
        try:
            while w.conn.poll():
                self._on(w, w.conn.recv())
        except (EOFError, OSError):
            return False
        return True

    def _on(self, w: _Worker, msg: tuple) -> None:
        kind, task = msg[0], w.task
        if kind == "start":
            w.started = True
            if self.ui is not None:
                self.ui.start_run(msg[1], task.label if task else "", msg[2])
        elif kind == "event":
            if self.ui is not None:
                self.ui.event(msg[1], msg[2])
        elif kind == "result":
            w.task, w.started = None, False
            self._record(task, msg[1])

    def _record(self, task: RunTask, res: dict) -> None:
        if self.ui is not None:
            self.ui.end_run(task.run_id, res["outcome"], task.label, outcome_detail(res))
        self.out.append(res)
        if res["outcome"] in STOPS_SWEEP:  # the machine is being taken back, or the disk is full
            self.stopping = True

    def _died(self, w: _Worker, queue: deque[RunTask]) -> None:
        self.workers.remove(w)
        w.conn.close()
        task = w.task
        if task is None:  # idle: nothing was lost
            return
        rd = task.run_dir
        st = rd.status() if rd.status_path.exists() else {}
        pid = w.process.pid
        if st.get("state") == RunState.RUNNING.value and st.get("pid") == pid:
            self._killed(
                task,
                f"its worker process (pid {pid}) died without a word while it trained "
                "(killed: kill -9, or the kernel's out-of-memory killer)",
            )
        elif w.started:  # the run ended; its outcome died with the worker
            self._record(task, outcome_from_store(task))
        elif self.stopping:
            self.out.append(make_outcome(task, "not-started", time.time()))
        elif task.run_id in self.requeued:
            self._killed(
                task,
                f"its worker processes died twice before the run started (the last: pid {pid}, "
                f"exit code {w.process.exitcode})",
            )
        else:  # it died before this run started: another worker tries it, once
            self.requeued.add(task.run_id)
            queue.appendleft(task)

    def _killed(self, task: RunTask, error: str) -> None:
        """The run failed with its worker, reason worker-killed: the same command trains it again."""
        task.run_dir.path.mkdir(parents=True, exist_ok=True)
        task.run_dir.set_status(RunState.FAILED, error=error, reason="worker-killed", failed_at=time.time())
        self._record(task, make_outcome(task, "killed", time.time(), error=error))

    def close(self) -> None:
        """Every worker gone. After `run` returned none is busy; after an error a busy one is asked
        to checkpoint (SIGTERM) and waited for."""
        busy = [w for w in self.workers if w.task is not None]
        for w in self.workers:
            if w in busy:
                w.process.terminate()
            else:
                w.hand(None)
        for w in self.workers + self.retired:
            w.conn.close()  # a busy worker's outcome has nowhere to go: the store keeps its state
            w.process.join(timeout=None if w in busy else 60)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
        self.workers, self.retired = [], []


def _start_resource_tracker() -> None:
    """multiprocessing's resource tracker (a child of this process, which spawning starts), started
    with SIGHUP blocked: it ignores SIGINT and SIGTERM itself, and a SIGHUP to the terminal's process
    group would kill it and leave its successor printing KeyErrors for what it never saw."""
    if not hasattr(signal, "pthread_sigmask"):
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ---------------------------------------------------------------------------------------------
# A worker's side

_IDLE: StopRequest | None = None  # this worker's StopRequest between runs: a signal received here is kept
_PARENT: int | None = None  # the sweep's pid: a worker whose sweep died exits


def _worker_main(conn: Connection, threads: int, parent: int) -> None:
    """Runs handed over `conn` until it says None or closes; each one's outcome sent back."""
    global _IDLE, _PARENT
    _PARENT = parent
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    # Between runs a signal is kept (no further run starts here); a run installs its own handlers
    # inside these and passes a signal it received back out when it ends (StopRequest.restore).
    _IDLE = StopRequest.install(STOP_SIGNALS, forward=lambda signum: _exit_if_orphaned())
    _die_with_parent()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the sweep closed its end
            return
        if task is None:
            return
        res = _train(task, conn)
        try:
            conn.send(("result", res))
        except OSError:  # the sweep is gone; the store has the run's state
            return
        _exit_if_orphaned()  # its sweep died while it trained: the run is checkpointed, nobody waits


def _train(task: RunTask, conn: Connection) -> dict:
    if _IDLE is not None and _IDLE.received is not None:
        return make_outcome(task, "not-started", time.time())  # this worker was asked to stop: start nothing

    def send(*msg) -> None:
        try:
            conn.send(msg)
        except OSError:  # progress is cosmetic: a sweep that is gone does not fail the run
            pass

    try:
        return run_one(
            task,
            progress=lambda ev: send("event", task.run_id, ev),
            on_start=lambda rid, steps, action: send("start", rid, steps, action),
        )
    except Exception as e:  # noqa: BLE001 - run_one raises only what is not the run's own failure
        return make_outcome(task, "crashed", time.time(), error=f"{type(e).__name__}: {e}")


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
