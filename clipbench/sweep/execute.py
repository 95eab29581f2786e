"""Running a sweep's runs: `run_one` trains (or skips, or resumes) one; `run_sequential` runs them one
at a time in this process (`clipbench.sweep.pool.run_parallel`: in N local worker processes).

The results store decides what to do with each run (it is the source of truth):

    status finished                      -> skipped (rows its metrics or histograms lost are
                                            written back from its last checkpoint: mend_finished)
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
resumes them. The sweep passes a signal it receives on to the processes that train (a run's torchrun
here; the pool's workers there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from clipbench.config import RunConfig, from_dict
from clipbench.config.labels import run_label
from clipbench.config.stored import recorded
from clipbench.engines.launch import launch_ranks, run_as_rank
from clipbench.errors import DiskFull, RunPreempted, UserError, no_space_left, unknown_choice
from clipbench.objectives.plugins import check_plugin_records
from clipbench.sweep.manifest import read_manifest
from clipbench.tracking.lock import try_run_lock
from clipbench.tracking.mlflow_sink import run_sink
from clipbench.tracking.store import RunDir, RunState
from clipbench.train.checkpoint import checkpoint_step as step_of
from clipbench.train.checkpoint import find_checkpoint, has_checkpoint_dir, lost_rows, restore_lost_rows
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


def mend_finished(run_dirs: Mapping[str, RunDir], configs: Mapping[str, dict], states: Mapping[str, Next]) -> list[str]:
    """Rows a finished run's metrics.jsonl or histograms lost (deleted, emptied, a torn last line)
    written back from its last checkpoint's copy, each under the run's lock. A line per file restored."""
    notes = []
    for rid, rd in run_dirs.items():
        if states.get(rid) is not Next.FINISHED:
            continue
        seed = int(recorded(configs[rid], "seed") or 0)
        if not lost_rows(rd, run_id=rid, seed=seed):
            continue
        with try_run_lock(rd.path.parent, rid) as got:
            if got:
                notes += [f"run {rid}: {n}" for n in restore_lost_rows(rd, run_id=rid, seed=seed)]
    return notes


def make_outcome(task: RunTask, outcome: str, t0: float, **extra) -> dict:
    return {
        "run_id": task.run_id,
        "label": task.label,
        "outcome": outcome,
        "seconds": round(time.time() - t0, 2),
        **extra,
    }


def outcome_from_store(task: RunTask) -> dict:
    """A run's outcome as its store tells it: for a run trained elsewhere (a Hydra launcher's job),
    or whose worker died before its own word arrived."""
    st = task.run_dir.status()
    state = st.get("state", RunState.PENDING.value)
    outcome = {
        RunState.FINISHED.value: "resumed" if st.get("resumed_from") is not None else "finished",
        RunState.FAILED.value: "failed",
        RunState.PREEMPTED.value: "preempted",
    }.get(state, "incomplete")
    return {"run_id": task.run_id, "label": task.label, "outcome": outcome, "error": st.get("error")}


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
        return make_outcome(task, "disk-full", t0, error=str(e))
    except OSError as e:  # writing the run's lock or status before training: the run's own files are whole
        if (full := no_space_left(e)) is None:
            raise
        return make_outcome(task, "disk-full", t0, error=str(task.run_dir.fail_for_disk(full)))


def _run_one(task: RunTask, t0: float, *, progress, on_start) -> dict:
    rd = task.run_dir
    sweep_dir = rd.path.parent
    with try_run_lock(sweep_dir, task.run_id) as got:
        if not got:
            return make_outcome(task, "locked", t0)
        action = classify(rd, task.retry_failed)  # re-read under the lock: another process may have finished it
        if action is Next.FINISHED:
            return make_outcome(task, "skipped", t0)
        if action is Next.FAILED:
            return make_outcome(task, "failed-skipped", t0, error=rd.status().get("error"))

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
                return make_outcome(task, "preempted", t0, **_resumed(rd, from_step), step=rd.status().get("step"))
            if rc != 0:
                st = rd.status()
                outcome = "disk-full" if st.get("reason") == "disk-full" else "failed"
                return make_outcome(task, outcome, t0, error=str(st.get("error", f"exit code {rc}"))[:500])
            return make_outcome(task, "resumed" if resume else "finished", t0, **_resumed(rd, from_step))
        sinks = []

        def make_sink():
            sinks.append(_make_sink(task, cfg, rd, resume))
            return sinks[-1]

        try:
            summary = run_as_rank(cfg, rd, resume=resume, make_sink=make_sink, progress=progress)
        except RunPreempted:  # checkpointed: the next invocation resumes it
            return make_outcome(task, "preempted", t0, **_resumed(rd, from_step), step=rd.status().get("step"))
        except DiskFull:
            raise
        except BaseException as e:  # a failing run must not stop the sweep (run_as_rank marked it failed)
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise  # not the run's failure (DCP's CheckpointException is a BaseException: it is one)
            return make_outcome(task, "failed", t0, error=f"{type(e).__name__}: {first_line(e)}"[:500])
        offline = bool(sinks) and getattr(sinks[0], "offline", False) and cfg.tracking.mlflow
        last = {k: v for k, v in (summary.get("last") or {}).items() if k in ("reward/mean", "accuracy", "entropy")}
        evals = {k: v for k, v in summary.items() if k.startswith("eval/")}
        resumed = _resumed(rd, from_step)
        return make_outcome(
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
            out.extend(make_outcome(t, "not-started", time.time()) for t in tasks[i:])
            break
        started = []

        def on_start(rid, steps, action, _t=task):
            started.append(action)
            if ui is not None:
                ui.start_run(rid, _t.label, steps)

        res = run_one(task, progress=ui.callback(task.run_id) if ui is not None else None, on_start=on_start)
        if ui is not None:
            ui.end_run(task.run_id, res["outcome"], task.label, outcome_detail(res))
        out.append(res)
        if res["outcome"] in STOPS_SWEEP:  # the machine is being taken back, or the disk is full: start nothing more
            out.extend(make_outcome(t, "not-started", time.time()) for t in tasks[i + 1 :])
            break
    return out


STOPS_SWEEP = ("preempted", "disk-full")  # outcomes after which a sweep starts no further run


def outcome_detail(res: dict) -> str:
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
