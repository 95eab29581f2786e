"""Running a rehearsal: the preflight, `clipbench train` killed after its first checkpoint and resumed,
the results store and the MLflow mirror checked, the report built, the real recipe's memory plan.

The training runs as the recipe's own command (`python -m clipbench train RECIPE`, torchrun over the
processes when more than one), in subprocesses, so the kill is real: every process of the run gets
SIGKILL (a node lost), the status stays "running", and `--resume` continues from the checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from clipbench.rehearse.scale import STEPS, Plan

KILL_AFTER = 1  # the rollout step whose checkpoint the run is killed after
TIMEOUT_S = 900  # one launch of the rehearsal's run, at most


def train(recipe: Path, results: Path, uri: str, *, resume: bool, log: Path) -> subprocess.Popen:
    """`clipbench train RECIPE` (the rehearsal's) as a subprocess writing `log`."""
    cmd = [
        sys.executable,
        "-m",
        "clipbench",
        "train",
        str(recipe),
        "--results-dir",
        str(results),
        "--tracking-uri",
        uri,
    ] + (["--resume"] if resume else [])
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def descendants(root: int) -> list[int]:
    """Every process under `root` (Linux /proc; elsewhere none): torchrun starts its ranks in sessions
    of their own, so a process group does not reach them."""
    parents = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], [root]
    while todo:
        cur = todo.pop()
        kids = [p for p, pp in parents.items() if pp == cur]
        out += kids
        todo += kids
    return out


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the launch and every process it started (its ranks), then reap it."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    return lines[-1][-400:] if lines else "(no output)"


def train_kill_resume(
    plan: Plan, recipe: Path, results: Path, uri: str, run_dir: Path, say: Callable[[str], None]
) -> None:
    """Train, SIGKILL after the first checkpoint, resume to the end; adds the part."""
    # PLC0415, deferred: train.checkpoint pulls in torch
    from clipbench.train.checkpoint import checkpoint_step, find_checkpoint  # noqa: PLC0415

    def ckpt() -> int:
        found = find_checkpoint(run_dir / "checkpoints" / "last")
        return (checkpoint_step(found) or 0) if found else 0

    say(f"training {STEPS} rollout steps; killing every process after the checkpoint of step {KILL_AFTER}")
    log1 = results.parent / "train-1.log"
    proc = train(recipe, results, uri, resume=False, log=log1)
    deadline = time.time() + TIMEOUT_S
    while ckpt() < KILL_AFTER and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    if proc.poll() is not None or ckpt() < KILL_AFTER:
        kill_run(proc)
        why = f"exit {proc.returncode}" if ckpt() < KILL_AFTER else "it finished before the kill"
        plan.add("checkpoint, kill, resume", "failed", f"the run stopped before the kill ({why}): {last_line(log1)}")
        return
    killed_at = ckpt()
    kill_run(proc)
    say(f"killed at checkpoint step {killed_at}; resuming")
    log2 = results.parent / "train-2.log"
    proc = train(recipe, results, uri, resume=True, log=log2)
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_run(proc)
        rc = "timeout"
    if rc != 0:
        plan.add("checkpoint, kill, resume", "failed", f"the resumed run exited {rc}: {last_line(log2)}")
        return
    plan.add(
        "checkpoint, kill, resume",
        "ran",
        f"SIGKILL of every process after the checkpoint of step {killed_at}; "
        f"--resume finished steps {killed_at + 1}-{STEPS}",
    )


def check_store(plan: Plan, run_dir: Path, uri: str) -> None:
    """The results store and the MLflow mirror are a finished run's: every optimizer step once, the
    micro-batch split, the evaluations; adds the parts."""
    from clipbench.tracking.store import RunDir, RunState  # noqa: PLC0415 - tracking.store pulls in torch

    rd = RunDir(run_dir)
    tc = plan.config["train"]
    st, rows = rd.status(), rd.read_metrics()
    want = list(range(1, STEPS * tc["mini_batches"] * tc["epochs"] + 1))
    if st.get("state") != RunState.FINISHED or [r["opt_step"] for r in rows] != want:
        plan.add(
            "results store",
            "failed",
            f"status {st.get('state')}, optimizer steps {[r['opt_step'] for r in rows]} (want 1..{want[-1]} once each)",
        )
        return
    plan.add("results store", "ran", f"status finished, {len(rows)} optimizer steps logged once each")
    if plan.micro_batch_scaled:
        fewest = min(r["micro_batches"] for r in rows)
        plan.add("micro-batches", "ran" if fewest >= 2 else "failed", f"at least {fewest} per optimizer step")
    if plan.config["eval"]["benchmarks"]:
        evals = rd.read_evals()
        ok = STEPS in evals
        plan.add(
            "evaluation",
            "ran" if ok else "failed",
            f"steps {sorted(evals)}: {', '.join(sorted(evals.get(STEPS, {})))}" if ok else f"steps {sorted(evals)}",
        )
    if plan.config["tracking"]["mlflow"]:
        check_mlflow(plan, rd, uri, len(rows))


def check_mlflow(plan: Plan, rd, uri: str, n_rows: int) -> None:
    from clipbench.tracking.mlflow_client import client_for  # noqa: PLC0415 - tracking.mlflow_client pulls in torch

    try:
        client = client_for(uri)
        exp = client.get_experiment_by_name(plan.config["tracking"]["experiment"])
        (run,) = client.search_runs([exp.experiment_id], f"tags.run_id = '{rd.run_id}'")
        points = len(client.get_metric_history(run.info.run_id, "loss"))
    except Exception as e:  # noqa: BLE001 - the rehearsal reports it
        plan.add("tracking (MLflow)", "failed", f"{type(e).__name__}: {e}"[:300])
        return
    ok = run.info.status == "FINISHED" and points == n_rows
    plan.add(
        "tracking (MLflow)",
        "ran" if ok else "failed",
        f"{uri}: run {run.info.status}, {points} loss points of {n_rows}",
    )


def check_report(plan: Plan, results: Path, out: Path) -> None:
    """`clipbench report`'s library on the rehearsal's store: the run is compared like any run."""
    from clipbench.report.build import build_report, write_report  # noqa: PLC0415 - report.build pulls in torch

    if not plan.config["eval"]["benchmarks"]:
        plan.add("report", "skipped", "the recipe evaluates nothing: a report compares evaluations")
        return
    try:
        sweep, result, tables, header = build_report(results, "train", None)
        write_report(sweep, result, tables, header, "csv", out)  # the tables (the figures: tests/test_report*)
    except Exception as e:  # noqa: BLE001 - the rehearsal reports it
        plan.add("report", "failed", f"{type(e).__name__}: {e}"[:300])
        return
    compared = result["runs"]["compared"]
    plan.add("report", "ran" if compared == 1 else "failed", f"{out}: {compared} run compared")
