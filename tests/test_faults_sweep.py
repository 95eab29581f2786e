"""Sweeps of several processes hit by real signals (issue 39, cases 3, 5 and 6).

- case 5: `kill -9` of one worker of a `--jobs 2` sweep (what the kernel's out-of-memory killer
  does). Before: every run printed "crashed", the sibling's run was stopped, the queued runs never
  started and the advice was "--retry-failed"; later, with the standard library's pool, the sibling
  was stopped and resumed in a new pool, and the sweep hung forever when the killed worker had held
  the pool's shared queue lock (idle between runs: every one of 3 tries here; most likely CI's one hang
  too, a kill while the worker wrote a message under that lock). Now each
  worker has a pipe of its own: the killed run is the one reported ("killed", status failed with
  reason worker-killed), the sibling trains on undisturbed (one attempt), the queued runs train, and
  a plain rerun finishes the killed run to the numbers of an uninterrupted sweep. A worker killed
  between runs costs nothing.
- case 6: Ctrl-C (SIGINT to the terminal's process group) and SIGHUP with `--jobs 2`: the training
  runs checkpoint (status preempted), no queued run starts, exit 130 (129 for SIGHUP); the rerun
  finishes every run to the uninterrupted numbers. Before: the idle workers trained the queued runs to
  the end, no checkpoint was written and SIGHUP left the status "running".
- case 3: the report of the sweep stopped by Ctrl-C says first that it is incomplete and which runs.
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
import yaml

from clipbench.sweep.manifest import manifest_path, read_manifest
from clipbench.tracking.files import read_jsonl
from clipbench.tracking.store import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("faults_sweep"), pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parent.parent
TINY = {
    "train.steps": 16,  # long enough that no run finishes between "two runs training" and the signal
    "train.prompts_per_step": 2,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "train.checkpoint_every": 2,
    "eval.benchmarks": [],
    "tracking.mlflow": False,
}


def write_sweep(tmp: Path) -> Path:
    f = tmp / "par.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "par",
                "base": str(REPO / "recipes" / "arith_tiny.yaml"),
                "overrides": TINY,
                "grid": {"seed": [0, 1, 2, 3]},
            }
        )
    )
    return f


def sweep_cmd(f: Path, res: Path) -> list[str]:
    return [sys.executable, "-m", "clipbench.cli", "sweep", str(f), "--results-dir", str(res), "--jobs", "2"]


def run_sweep(f: Path, res: Path) -> subprocess.CompletedProcess:
    return subprocess.run(sweep_cmd(f, res), cwd=REPO, capture_output=True, text=True, timeout=800)


def start_sweep(f: Path, res: Path) -> subprocess.Popen:
    return subprocess.Popen(
        sweep_cmd(f, res), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def training(sweep_dir: Path) -> list[RunDir]:
    """Runs that are running and have logged an optimizer step."""
    runs = [RunDir(d) for d in sweep_dir.glob("*") if (d / "metrics.jsonl").exists()]
    return [rd for rd in runs if rd.status().get("state") == "running" and rd.read_metrics()]


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        assert proc.poll() is None, f"the sweep exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def assert_same_as(res: Path, ref: Path) -> None:
    ids = read_manifest(manifest_path(ref, "par"))["runs"]
    for rid in ids:
        a, b = RunDir(res / "par" / rid), RunDir(ref / "par" / rid)
        assert a.status()["state"] == "finished", rid
        assert stable(a.read_metrics()) == stable(b.read_metrics()), rid
        assert len(a.read_metrics()) == 32  # 16 rollout steps x 2 mini-batches
        assert read_jsonl(a.hist_path) == read_jsonl(b.hist_path), rid


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The 4-run sweep, uninterrupted, with --jobs 2 (the same threads per worker as the tests')."""
    tmp = tmp_path_factory.mktemp("clean")
    f, res = write_sweep(tmp), tmp / "results"
    p = run_sweep(f, res)
    assert p.returncode == 0, p.stderr[-3000:]
    return res


def test_kill_9_of_one_worker_stops_only_its_run_and_a_plain_rerun_recovers(clean, tmp_path):
    f, res = write_sweep(tmp_path), tmp_path / "results"
    p = start_sweep(f, res)
    wait_for(lambda: len(training(res / "par")) == 2, 400, "two runs training", p)
    victim = training(res / "par")[0]
    os.kill(victim.status()["pid"], signal.SIGKILL)  # one worker, as the OOM killer picks it
    _, err = p.communicate(timeout=800)
    assert p.returncode == 1, err[-3000:]
    lines = [ln.strip() for ln in err.splitlines()]
    pid = victim.status()["error"].split("pid ")[1].split(")")[0]
    assert any(
        ln.startswith(f"killed {victim.run_id} ")
        and ln.endswith(
            f"its worker process (pid {pid}) died without a word while it trained (killed: kill -9, or the "
            "kernel's out-of-memory killer)"
        )
        for ln in lines
    ), err[-3000:]
    assert "crashed" not in err and "--retry-failed" not in err
    assert "3/4 runs finished; 1 stopped (its worker was killed): rerun the same command to resume" in err
    st = victim.status()
    assert st["state"] == "failed" and st["reason"] == "worker-killed"
    others = [RunDir(d) for d in (res / "par").iterdir() if d.name != victim.run_id and (d / "status.json").exists()]
    assert [(rd.status()["state"], rd.status()["attempts"]) for rd in others] == [("finished", 1)] * 3  # undisturbed
    again = run_sweep(f, res)  # the plain command, no --retry-failed
    assert again.returncode == 0, again.stderr[-3000:]
    # the killed run resumes from its checkpoint, or starts again when it died before its first one
    counts = r"3 finished, (1 to resume, 0 to start|0 to resume, 1 to start)"
    assert re.search(counts, again.stderr), again.stderr[-2000:]
    assert_same_as(res, clean)


def _workers_of(pid: int) -> list[int]:
    """The live spawned worker processes whose parent is `pid`."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if fields[1] == str(pid) and fields[0] != "Z" and b"spawn_main" in cmd:
            out.append(int(d.name))
    return out


def test_a_worker_killed_between_runs_costs_nothing(tmp_path):
    """A short run and a long one: once the short one has finished, its worker is killed (before:
    the worker, idle in the pool's shared queue, held that queue's lock; the pool stopped the long
    run, which then waited for the lock forever). Now the worker has left (nothing to hand it) or
    dies with nothing of its own, and the long run trains on to its end."""
    f = tmp_path / "two.yaml"
    overrides = {k: v for k, v in TINY.items() if k != "train.steps"}
    f.write_text(
        yaml.safe_dump(
            {
                "name": "two",
                "base": str(REPO / "recipes" / "arith_tiny.yaml"),
                "overrides": overrides,
                "grid": {"train.steps": [2, 40]},
            }
        )
    )
    res = tmp_path / "results"
    p = start_sweep(f, res)
    runs = lambda: [RunDir(d) for d in (res / "two").glob("*") if (d / "status.json").exists()]  # noqa: E731
    done = lambda: [rd for rd in runs() if rd.status()["state"] == "finished"]  # noqa: E731
    wait_for(lambda: done() and training(res / "two"), 400, "the short run finished, the long one training", p)
    pid = done()[0].status()["pid"]
    if pid in _workers_of(p.pid):  # still there (it leaves once nothing is left to hand it); never another's pid
        os.kill(pid, signal.SIGKILL)
    _, err = p.communicate(timeout=800)
    assert p.returncode == 0, err[-3000:]
    assert "2/2 runs finished" in err
    assert sorted(rd.status()["attempts"] for rd in runs()) == [1, 1]


def test_a_worker_that_dies_before_its_run_starts_gives_the_run_back_once(tmp_path):
    """A one-run sweep with --jobs 2: its worker is killed as it starts up (importing, before it read
    the run), and so is the worker that replaces it. The first death gives the run back to the queue;
    the second fails it with reason worker-killed, saying so; the same command then trains it."""
    f = tmp_path / "one.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "one",
                "base": str(REPO / "recipes" / "arith_tiny.yaml"),
                "overrides": {**TINY, "train.steps": 2},
                "grid": {"seed": [0]},
            }
        )
    )
    res = tmp_path / "results"
    p = start_sweep(f, res)
    killed: set[int] = set()
    t0 = time.time()
    while len(killed) < 2 and time.time() - t0 < 300 and p.poll() is None:
        for pid in set(_workers_of(p.pid)) - killed:
            os.kill(pid, signal.SIGKILL)  # within milliseconds of its birth: it is still importing
            killed.add(pid)
        time.sleep(0.01)
    _, err = p.communicate(timeout=300)
    assert len(killed) == 2 and p.returncode == 1, err[-3000:]
    (rd,) = [RunDir(d) for d in (res / "one").iterdir() if (d / "status.json").exists()]
    st = rd.status()
    assert st["state"] == "failed" and st["reason"] == "worker-killed" and "attempts" not in st  # never started
    assert st["error"].startswith("its worker processes died twice before the run started (the last: pid ")
    assert "0/1 runs finished; 1 stopped (its worker was killed): rerun the same command to resume" in err
    again = run_sweep(f, res)
    assert again.returncode == 0 and "1/1 runs finished" in again.stderr, again.stderr[-2000:]


@pytest.mark.parametrize(
    "signum,code,what", [(signal.SIGINT, 130, "interrupted (Ctrl-C)"), (signal.SIGHUP, 129, "stopped (SIGHUP)")]
)
def test_ctrl_c_and_sighup_with_jobs_2_checkpoint_and_start_nothing_queued(clean, tmp_path, signum, code, what):
    f, res = write_sweep(tmp_path), tmp_path / "results"
    p = start_sweep(f, res)
    wait_for(lambda: len(training(res / "par")) == 2, 400, "two runs training", p)
    os.killpg(p.pid, signum)  # the whole process group, as the terminal sends it
    _, err = p.communicate(timeout=600)
    assert p.returncode == code, err[-3000:]
    runs = [RunDir(d) for d in (res / "par").iterdir() if (d / "status.json").exists()]
    assert [rd.status()["state"] for rd in runs] == ["preempted", "preempted"], err[-2000:]
    assert {rd.status()["signal"] for rd in runs} == {signal.Signals(signum).name}
    assert all((rd.checkpoint_dir / "state.json").is_file() for rd in runs)
    assert "2 not started" in err
    assert err.strip().splitlines()[-1] == (
        f"{what}: the running runs stopped at a checkpoint and no further run started; rerun the same command to resume"
    )
    if signum == signal.SIGINT:
        report = subprocess.run(
            [sys.executable, "-m", "clipbench.cli", "report", "par", "--results-dir", str(res), "--format", "csv"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        # no run finished: the report refuses to compare, naming the planned runs
        assert report.returncode == 2 and "no finished runs to compare yet (2 of 4 planned runs" in report.stderr
        again = run_sweep(f, res)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "0 finished, 2 to resume, 2 to start" in again.stderr
        assert_same_as(res, clean)
