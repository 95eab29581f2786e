"""Preemption: a signal stops a run at its next safe point with a checkpoint; the resumed run equals an
uninterrupted one (clipbench/train/preempt.py).

- Inside a rollout step (the signal arrives during an optimizer step: the run finishes that step,
  checkpoints the rest of the rollout step's inputs and stops) and at a step boundary (the signal
  arrives while a rollout step is logged: the run stops before the next one samples). Resumed, the
  metrics rows, histograms and final parameters are exactly the uninterrupted run's (one process,
  the same arithmetic), with a stochastic rule (nsr: per-epoch draws), 2 epochs and a sampler
  correction (its weights and mismatch are part of the saved inputs).
- `clipbench train` sent a real SIGTERM: exit code 75, status preempted, the last line is the command
  that resumes it; that command finishes the run with the uninterrupted run's numbers.
- torchrun stopping the other ranks after one died is not a preemption: that run fails
  (tests/test_distributed.py); 2 processes preempted by SIGTERM to the launcher resume on one.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from clipbench.config import load_run_config, run_id
from clipbench.errors import RunPreempted
from clipbench.tracking.store import RunDir
from clipbench.train.checkpoint import checkpoint_step, load_partial, load_policy
from clipbench.train.loop import run_training
from clipbench.train.preempt import StopRequest

pytestmark = pytest.mark.slow  # trains the tiny model

REPO = Path(__file__).resolve().parent.parent
RECIPE = str(REPO / "recipes" / "arith_tiny.yaml")
# 4 rollout steps x (2 epochs x 2 mini-batches) = 16 optimizer steps; nsr draws; a token correction
RUN = {
    "train.steps": 4,
    "train.prompts_per_step": 4,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "train.epochs": 2,
    "train.checkpoint_every": 3,
    "objective.method": "nsr",
    "sampler.mismatch_is": "token",
    "eval.benchmarks": [],
    "tracking.mlflow": False,
    "launch.preempt_signal": "SIGUSR1",
}


def overrides(**extra) -> list[str]:
    return [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
        for k, v in {**RUN, **extra}.items()
    ]


CFG = load_run_config(RECIPE, overrides())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every run of this module, in this process or a `clipbench train` child (ONE_THREAD), on one
    thread, so that their float arithmetic is the same: a thread count that another test file left in
    this worker, or a child's default of every core, changes round-off (e.g. the sampler's log-probs
    against the trainer's, which the mismatch metrics log)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    rd = RunDir(tmp_path_factory.mktemp("full") / "run")
    run_training(CFG, rd.path)
    return rd


def strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def same_run(a: RunDir, b: RunDir) -> None:
    assert strip(a.read_metrics()) == strip(b.read_metrics())
    assert len(a.read_metrics()) == 16
    assert a.hist_path.read_text() == b.hist_path.read_text()  # one log-ratio histogram row per rollout step
    pa, pb = (load_policy(rd.checkpoint_dir)[0].state_dict() for rd in (a, b))
    assert all(bool((pa[k] == pb[k]).all()) for k in pa)  # one process, the same arithmetic: exactly


def signal_at_optimizer_step(monkeypatch, n: int, signum=signal.SIGUSR1) -> None:
    """This process receives `signum` during its n-th optimizer step (deterministic)."""
    import clipbench.train.loop as loop

    real, calls = loop.optimizer_step, []

    def step(*a, **kw):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signum)
        return real(*a, **kw)

    monkeypatch.setattr(loop, "optimizer_step", step)


def test_a_signal_inside_a_rollout_step_finishes_the_optimizer_step_and_resumes_exactly(
    uninterrupted, tmp_path, monkeypatch
):
    rd = RunDir(tmp_path / "run")
    signal_at_optimizer_step(monkeypatch, 6)  # rollout step 1 (of 4), its second optimizer step
    stop = StopRequest.install(["SIGTERM", "SIGUSR1"])
    try:
        with pytest.raises(RunPreempted, match="preempted by SIGUSR1 at rollout step 1 .optimizer step 6."):
            run_training(CFG, rd.path, stop=stop)
    finally:
        stop.restore()
    st = rd.status()
    assert st["state"] == "preempted" and st["step"] == 1 and st["opt_step"] == 6 and st["signal"] == "SIGUSR1"
    assert [r["opt_step"] for r in rd.read_metrics()] == [1, 2, 3, 4, 5, 6]  # the steps done are logged
    partial = load_partial(rd.checkpoint_dir)
    assert checkpoint_step(rd.checkpoint_dir) == 1 and partial["next"] == 2
    assert {"old_logp", "advantages", "weights"} <= {k for k, v in partial["inputs"].items() if v is not None}
    monkeypatch.undo()
    run_training(CFG, rd.path, resume=True)
    assert rd.status()["state"] == "finished"
    same_run(uninterrupted, rd)


def test_a_signal_between_rollout_steps_stops_before_the_next_one_samples(uninterrupted, tmp_path):
    rd = RunDir(tmp_path / "run")
    stop = StopRequest.install(["SIGTERM"])

    def progress(ev):  # rank 0 logged rollout step 2 of 4: the signal arrives now
        if ev["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        with pytest.raises(RunPreempted, match="preempted by SIGTERM at rollout step 2 .optimizer step 8."):
            run_training(CFG, rd.path, stop=stop, progress=progress)
    finally:
        stop.restore()
    assert rd.status()["state"] == "preempted"
    assert checkpoint_step(rd.checkpoint_dir) == 2 and load_partial(rd.checkpoint_dir) is None  # a step boundary
    run_training(CFG, rd.path, resume=True)
    same_run(uninterrupted, rd)


def test_a_signal_before_the_first_optimizer_step_resumes_exactly(uninterrupted, tmp_path):
    """Preempted at rollout step 0 (e.g. during the start's evaluation), before any optimizer step: the
    checkpoint holds no optimizer state, so the resumed run's first AdamW step is the uninterrupted
    run's (issue 28: DCP's get_state_dict fills an empty optimizer with step=1 state, and the resumed
    run then differed from optimizer step 2 on)."""
    rd = RunDir(tmp_path / "run")
    stop = StopRequest.install(["SIGTERM"])
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # pending before the run's first safe point
        with pytest.raises(RunPreempted, match="preempted by SIGTERM at rollout step 0 .optimizer step 0."):
            run_training(CFG, rd.path, stop=stop)
    finally:
        stop.restore()
    assert rd.status()["state"] == "preempted" and checkpoint_step(rd.checkpoint_dir) == 0
    run_training(CFG, rd.path, resume=True)
    same_run(uninterrupted, rd)


def test_clipbench_train_sent_sigterm_exits_75_with_the_resume_command(uninterrupted, tmp_path):
    results = tmp_path / "results"
    args = ["train", RECIPE, *overrides(), "--results-dir", str(results)]
    rd = RunDir(results / "train" / run_id(CFG))
    proc = subprocess.Popen(
        [sys.executable, "-m", "clipbench", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ONE_THREAD,
    )
    deadline = time.time() + 300
    while not (rd.metrics_path.exists() and rd.metrics_path.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 75, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("preempted: preempted by SIGTERM at rollout step ") and "resume it: clipbench train " in last
    assert rd.status()["state"] == "preempted"
    resume = shlex.split(last.split("resume it: ", 1)[1])
    assert resume[:2] == ["clipbench", "train"] and resume[-1] == "--resume"
    res = subprocess.run(
        [sys.executable, "-m", *resume], cwd=REPO, capture_output=True, text=True, timeout=300, env=ONE_THREAD
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert rd.status()["state"] == "finished"
    same_run(uninterrupted, rd)
