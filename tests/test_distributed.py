"""One run over 2 real processes (torchrun, gloo, FSDP2 on CPU) against the same run in one process.

- A sweep row with launch.nproc_per_node=2 (and activation checkpointing) logs the same loss,
  grad_norm and counts per optimizer step and ends with the same parameters as one process on the
  same seed and batch, with the default sampler settings (each prompt's samples from its own seed:
  one call of P/2 prompts per rank draws what one call of P prompts draws), writes its results store
  and MLflow once (rank 0).
- `clipbench train --nproc-per-node 2` with one rank SIGKILLed after the first checkpoint: the command
  fails with one clear line, status.json says failed; `--resume` on ONE process continues from the
  checkpoint the 2 processes wrote (resharded) and ends where the uninterrupted run ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from clipbench.config import load_run_config, run_id
from clipbench.tracking.store import RunDir
from clipbench.train.checkpoint import checkpoint_step, load_policy
from clipbench.train.loop import run_training

pytestmark = pytest.mark.slow  # torchrun processes training


def processes(test):
    """Starts real processes: slow, one xdist group, a long timeout."""
    for mark in (pytest.mark.slow, pytest.mark.xdist_group("distributed"), pytest.mark.timeout(600)):
        test = mark(test)
    return test


REPO = Path(__file__).resolve().parent.parent
RECIPE = str(REPO / "recipes" / "arith_tiny.yaml")
# 4 prompts x 4 samples, 3 rollout steps x 4 mini-batches, a checkpoint every step; the sampler's defaults
RUN = {
    "train.steps": 3,
    "train.prompts_per_step": 4,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.checkpoint_every": 1,
    "eval.benchmarks": [],
    "tracking.mlflow": False,
    "sampler.mismatch_is": "token",
}  # the sampler's log-probs too: the mismatch sums cross ranks
COUNTS = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")


def overrides(**extra) -> list[str]:
    return [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
        for k, v in {**RUN, **extra}.items()
    ]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: the run in this process."""
    rd = RunDir(tmp_path_factory.mktemp("one") / "run")
    run_training(load_run_config(RECIPE, overrides()), rd.path)
    return rd


def same_training(a: RunDir, b: RunDir) -> None:
    """Same loss (1e-5 relative; O(1) token losses, so a near-zero net loss has scale 1), grad_norm
    and counts per optimizer step; final parameters within 1e-5 (relative norm per tensor)."""
    ra, rb = a.read_metrics(), b.read_metrics()
    assert [r["opt_step"] for r in ra] == [r["opt_step"] for r in rb] == list(range(1, 13))
    for x, y in zip(ra, rb):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * max(abs(x["loss"]), 1.0), (x["opt_step"], x["loss"], y["loss"])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * max(x["grad_norm"], 1e-6), x["opt_step"]
        assert {k: v for k, v in x.items() if k.split("/")[0] in COUNTS and "mass" not in k} == {
            k: v for k, v in y.items() if k.split("/")[0] in COUNTS and "mass" not in k
        }  # token counts
        assert x["reward/mean"] == y["reward/mean"]  # the same completions were sampled
        # hf samples from the policy itself: mismatch ~1e-7 and weights 1, whatever the world size
        assert max(x["mismatch/abs_max"], y["mismatch/abs_max"]) < 1e-4
        assert x["correction/weight_mean"] == pytest.approx(y["correction/weight_mean"], abs=1e-6)
    pa, pb = (load_policy(rd.checkpoint_dir)[0].state_dict() for rd in (a, b))
    worst = max(float((pa[k] - pb[k]).norm() / pa[k].norm()) for k in pa)
    assert worst <= 1e-5, worst


def replays_exactly(rd: RunDir) -> None:
    """The 2 ranks' records (rollout steps 0 and 2): the trained rule replays each logged loss bit for
    bit (each rank's micro-batch losses summed in float32, the ranks' in float64, as training did) and
    every count; at the state the 2 ranks saved (DCP shards, loaded in this one process) its gradient
    has the logged norm."""
    from clipbench.replay import params as P
    from clipbench.replay.rules import RuleSpec
    from clipbench.replay.tokens import OptStepView, replay_rule
    from clipbench.tracking.records import list_records, load_record

    logged = {r["opt_step"]: r for r in rd.read_metrics()}
    assert rd.status()["records"] == [0, 2]
    for path in list_records(rd.path):
        rec = load_record(path)
        assert rec.index["world_size"] == 2
        for opt in rec.index["opt_steps"]:
            step = OptStepView(rec, opt)
            res = replay_rule(step, RuleSpec.of("grpo", rec.index["objective"]["params"]))
            row = logged[opt["opt_step"]]
            assert res.loss == row["loss"] and len(opt["ranks"]) == 2
            assert {k: v for k, v in res.stats.items() if k.split("/")[0] in COUNTS and "mass" not in k} == {
                k: v for k, v in row.items() if k.split("/")[0] in COUNTS and "mass" not in k
            }
            state = P.load_state(rec, opt)
            if state is not None:
                grads, _ = P.param_gradients(state, step, {"grpo": res})
                assert P.global_norm(grads["grpo"]) == pytest.approx(row["grad_norm"], rel=1e-5)


def clipbench(*args: str, **kw):
    return subprocess.run(
        [sys.executable, "-m", "clipbench", *args], cwd=REPO, capture_output=True, text=True, timeout=500, **kw
    )


def test_launch_is_outside_the_run_identity_and_not_a_sweep_axis(tmp_path):
    from clipbench.errors import ConfigError
    from clipbench.sweep.expand import expand
    from clipbench.sweep.spec import load_spec

    assert run_id(load_run_config(RECIPE, ["launch.nproc_per_node=2"])) == run_id(load_run_config(RECIPE))
    sweep = tmp_path / "ax.yaml"
    sweep.write_text(yaml.safe_dump({"name": "ax", "base": RECIPE, "grid": {"launch.nproc_per_node": [1, 2]}}))
    with pytest.raises(ConfigError, match="grid.launch.nproc_per_node: not part of a run's identity"):
        expand(load_spec(sweep))
    sweep.write_text(
        yaml.safe_dump(
            {"name": "ax", "base": RECIPE, "zip": {"launch.nproc_per_node": [1, 2], "train.prompts_per_step": [8, 4]}}
        )
    )  # zipped with a key that differs
    assert [c["launch"]["nproc_per_node"] for c in expand(load_spec(sweep)).runs.values()] == [1, 2]


def test_rank_shares_are_contiguous_blocks():
    from clipbench.train.distributed import Dist

    items = list(range(10))
    shares = Dist(rank=0, world=3).shares(items)
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert [Dist(rank=r, world=3).share(items) for r in range(3)] == shares and Dist().share(items) == items


@processes
def test_a_sweep_row_on_two_processes_trains_the_run_one_process_trains(one_process, tmp_path):
    sweep = tmp_path / "dp.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "name": "dp",
                "base": RECIPE,
                "grid": {"seed": [0]},
                "overrides": {
                    **RUN,
                    "launch.nproc_per_node": 2,
                    "model.gradient_checkpointing": True,
                    "tracking.mlflow": True,
                    "train.record.every": 2,
                },
            }
        )
    )  # recording changes nothing
    res = clipbench("sweep", str(sweep), "--results-dir", str(tmp_path / "results"))
    assert res.returncode == 0, res.stdout + res.stderr
    (run_dir,) = [p for p in (tmp_path / "results" / "dp").iterdir() if p.is_dir() and not p.name.startswith(".")]
    rd = RunDir(run_dir)
    assert rd.status()["state"] == "finished" and rd.status()["world_size"] == 2
    same_training(one_process, rd)  # rank 0 alone wrote: 12 rows, not 24
    replays_exactly(rd)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    (exp,) = [e for e in client.search_experiments() if e.name == "clipbench"]
    (child,) = client.search_runs([exp.experiment_id], f"tags.run_id = '{rd.run_id}'")
    assert len(client.get_metric_history(child.info.run_id, "loss")) == 12
    assert child.data.params["provenance.world_size"] == "2"  # where it ran, recorded by rank 0


def _descendants(root: int) -> list[int]:
    parents = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        cur = todo.pop()
        kids = [pid for pid, ppid in parents.items() if ppid == cur]
        out += kids
        todo += kids
    return out


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            return pid
    return None


@processes
def test_a_dead_rank_fails_the_run_and_one_process_resumes_it(one_process, tmp_path):
    results = tmp_path / "results"
    args = ["train", RECIPE, *overrides(), "--results-dir", str(results)]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clipbench", *args, "--nproc-per-node", "2"],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    # launch.* is not part of the run's identity: the 2-process run is the one-process run's directory
    run_dir = results / "train" / run_id(load_run_config(RECIPE, overrides()))
    deadline = time.time() + 300
    while (checkpoint_step(run_dir / "checkpoints" / "last") or 0) < 1:
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    rank1 = _rank_pid(proc.pid, 1)
    assert rank1 is not None and proc.poll() is None, "the run ended before rank 1 could be killed"
    os.kill(rank1, signal.SIGKILL)
    proc.wait(timeout=300)
    err = log.read_text()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: training on 2 processes failed (torchrun exit code") and "--resume" in last, last
    rd = RunDir(run_dir)
    assert rd.status()["state"] == "failed" and rd.status()["error"]
    assert checkpoint_step(rd.checkpoint_dir) in (1, 2)
    resumed_from = checkpoint_step(rd.checkpoint_dir)

    res = clipbench(*args, "--resume")  # one process, from the 2 processes' checkpoint
    assert res.returncode == 0, res.stderr
    assert rd.status()["state"] == "finished" and rd.status()["world_size"] == 1
    same_training(one_process, rd)
    from clipbench.tracking.provenance import read_provenance

    starts = read_provenance(rd.path)  # started on 2 processes, resumed on 1 from its checkpoint
    assert [(s["step"], s["world_size"]) for s in starts] == [(0, 2), (resumed_from, 1)]


@processes
def test_two_processes_share_the_evaluation_and_write_one_processs_payload(tmp_path):
    """Evaluation over 2 processes: each samples and grades its share of the batches (40 problems in
    batches of 16: rank 0 takes batches 0 and 2, rank 1 batch 1 and a discarded repeat), rank 0 writes
    the gathered payload, the same problems, samples and grades as one process (step 0: the same
    base-model weights, the same seeds per batch)."""
    import json

    extra = {"train.steps": 1, "eval.benchmarks": ["arith"], "eval.n": 2, "eval.limit": 40}
    one = RunDir(tmp_path / "one")
    run_training(load_run_config(RECIPE, overrides(**extra)), one.path)
    res = clipbench(
        "train", RECIPE, *overrides(**extra), "--results-dir", str(tmp_path / "results"), "--nproc-per-node", "2"
    )
    assert res.returncode == 0, res.stdout + res.stderr
    two = RunDir(tmp_path / "results" / "train" / run_id(load_run_config(RECIPE, overrides(**extra))))
    assert two.status()["world_size"] == 2
    a, b = (json.loads(rd.eval_path(0, "arith").read_text()) for rd in (one, two))
    assert len(a["problem_ids"]) == 40 and a["problem_ids"] == b["problem_ids"]
    assert a["correct"] == b["correct"] and a["summary"] == b["summary"]
    assert a["mean_completion_tokens"] == b["mean_completion_tokens"]


@processes
def test_sigterm_preempts_two_processes_and_one_process_resumes_the_same_run(one_process, tmp_path):
    """SIGTERM to `clipbench train --nproc-per-node 2` (as SLURM sends it): passed on to torchrun and
    the ranks, which agree to stop at their next safe point, checkpoint (sharded) and exit; exit code
    75, status preempted, the resume command last; resumed on ONE process, the run ends where the
    uninterrupted one-process run ends."""
    results = tmp_path / "results"
    args = ["train", RECIPE, *overrides(), "--results-dir", str(results)]
    rd = RunDir(results / "train" / run_id(load_run_config(RECIPE, overrides())))
    proc = subprocess.Popen(
        [sys.executable, "-m", "clipbench", *args, "--nproc-per-node", "2"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not (rd.metrics_path.exists() and rd.metrics_path.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 75, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("preempted: run ") and "on 2 processes stopped at a checkpoint; resume it: " in last, last
    st = rd.status()
    assert st["state"] == "preempted" and st["signal"] == "SIGTERM" and checkpoint_step(rd.checkpoint_dir) is not None
    res = clipbench(*args, "--resume")  # one process, from the 2 processes' checkpoint
    assert res.returncode == 0, res.stderr
    assert rd.status()["state"] == "finished"
    same_training(one_process, rd)


@processes
def test_a_lagged_run_on_two_processes_resumes_on_one_where_one_process_ends(tmp_path):
    """sampler.lag on 2 processes (each rank keeps its shard of the past policies and swaps it in):
    the same training as one process; preempted by SIGTERM and resumed on ONE process, the policies
    the lagged sampler still needs come back from the 2 ranks' checkpoint (resharded)."""
    lagged = [*overrides(), "sampler.lag=1"]  # the decoupled form: recompute, the behaviour gap through tis
    one = RunDir(tmp_path / "one")
    run_training(load_run_config(RECIPE, lagged), one.path)
    results = tmp_path / "results"
    args = ["train", RECIPE, *lagged, "--results-dir", str(results)]
    rd = RunDir(results / "train" / run_id(load_run_config(RECIPE, lagged)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "clipbench", *args, "--nproc-per-node", "2"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not (rd.metrics_path.exists() and rd.metrics_path.read_text().count("\n") >= 5):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # during rollout step 1 or 2: past the policy of step 0
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 75, err[-3000:]
    assert (rd.checkpoint_dir / "lag").is_dir()
    res = clipbench(*args, "--resume")
    assert res.returncode == 0, res.stderr
    ra, rb = one.read_metrics(), rd.read_metrics()
    assert [r["offpolicy/lag"] for r in rb[::4]] == [0, 1, 1]
    for x, y in zip(ra, rb, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * max(abs(x["loss"]), 1.0), x["opt_step"]
        assert x["reward/mean"] == y["reward/mean"]  # the same completions were sampled
        assert x["offpolicy/kl"] == pytest.approx(y["offpolicy/kl"], rel=1e-4, abs=1e-9)
        assert x["offpolicy/out_of_band"] == y["offpolicy/out_of_band"]
    pa, pb = (load_policy(r.checkpoint_dir)[0].state_dict() for r in (one, rd))
    assert max(float((pa[k] - pb[k]).norm() / pa[k].norm()) for k in pa) <= 1e-5
