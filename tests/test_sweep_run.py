"""Sweeps that train for real (tiny settings): SIGKILL mid-run then resume with identical metrics,
two sweep processes sharing one results dir, --jobs 2, the Hydra launchers (joblib; Ray against a real
local cluster and submitit's local executor, each killed mid-launch and relaunched), failed runs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from clipbench.sweep.manifest import manifest_path, read_manifest
from clipbench.tracking.files import read_jsonl
from clipbench.tracking.store import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sweep_run"), pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
# A few seconds per run on CPU: 2 prompts x 4 samples, 8 new tokens, a checkpoint every 2 steps.
TINY = {
    "train.steps": 6,
    "train.prompts_per_step": 2,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "train.checkpoint_every": 2,
    "eval.limit": 8,
    "eval.n": 2,
    "eval.every": 0,
    "tracking.mlflow": False,
}
TIME_KEYS = ("time/",)  # wall-clock metrics differ between runs; everything else must not


def write_sweep(tmp: Path, name: str, methods=("grpo", "dapo"), **over) -> Path:
    f = tmp / f"{name}.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "base": str(REPO / "recipes" / "arith_tiny.yaml"),
                "overrides": {**TINY, **over},
                "grid": {"objective.method": list(methods)},
            }
        )
    )
    return f


def clipbench(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clipbench.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=500, **kw
    )


def popen(*args: str, new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "clipbench.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def run_files(rd: RunDir) -> dict:
    """Everything a run produced that must not depend on interruptions: metrics, histograms, evals."""
    evals = {
        step: {b: {k: v for k, v in p.items() if k != "seconds"} for b, p in d.items()}  # wall clock
        for step, d in rd.read_evals().items()
    }
    return {"metrics": stable(rd.read_metrics()), "hist": read_jsonl(rd.hist_path), "evals": evals}


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The tiny 2-run sweep, uninterrupted, one run after another. (Session scope: with xdist's
    loadgroup this module's tests share one worker but may interleave with other modules, which
    would rebuild a module-scoped fixture.)"""
    tmp = tmp_path_factory.mktemp("ref")
    f = write_sweep(tmp, "tiny")
    res = tmp / "results"
    p = clipbench("sweep", str(f), "--results-dir", str(res))
    assert p.returncode == 0, p.stderr[-3000:]
    m = read_manifest(manifest_path(res, "tiny"))
    runs = {rid: RunDir(res / "tiny" / rid) for rid in m["runs"]}
    for rd in runs.values():
        assert rd.status()["state"] == "finished"
        assert len(rd.read_metrics()) == 6 * 2  # steps x mini-batches
    return f, res, runs


def assert_same_results(res: Path, ref_runs: dict[str, RunDir], sweep: str = "tiny") -> None:
    for rid, ref in ref_runs.items():
        got = RunDir(res / sweep / rid)
        assert got.status()["state"] == "finished", rid
        a, b = run_files(got), run_files(ref)
        assert len(a["metrics"]) == len(b["metrics"]), rid
        for x, y in zip(a["metrics"], b["metrics"]):
            diff = {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}
            assert not diff, (rid, x["opt_step"], diff)
        assert a["hist"] == b["hist"], rid
        assert a["evals"] == b["evals"], rid


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.05):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            out = (proc.stdout.read() if proc.stdout else "")[-1000:] + (proc.stderr.read() if proc.stderr else "")[
                -2000:
            ]
            raise AssertionError(f"process exited ({proc.returncode}) before {what}: {out}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def ckpt_step(rd: RunDir) -> int | None:
    try:
        return json.loads((rd.checkpoint_dir / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def test_sigkill_mid_run_then_rerun_skips_finished_and_resumes_identically(tmp_path, reference):
    f, _, ref_runs = reference
    res = tmp_path / "results"
    first, second = list(ref_runs)
    rd1, rd2 = RunDir(res / "tiny" / first), RunDir(res / "tiny" / second)

    p = popen("sweep", str(f), "--results-dir", str(res))
    try:
        # the second run has a checkpoint and has trained past it
        wait_for(
            lambda: (ckpt_step(rd2) or 0) >= 2 and any(r["step"] >= ckpt_step(rd2) for r in rd2.read_metrics()),
            300,
            "a checkpoint and steps after it in the second run",
            p,
            poll=0.02,
        )
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert rd1.status()["state"] == "finished"
    st2 = rd2.status()
    assert st2["state"] == "running" and ckpt_step(rd2) is not None
    killed_at = ckpt_step(rd2)
    # every file in place is whole (writes are temp file + rename): they all parse
    for path in (rd2.status_path, rd2.checkpoint_dir / "state.json", res / "tiny" / "manifest.json"):
        assert isinstance(json.loads(path.read_text()), dict), path
    assert yaml.safe_load(rd2.config_path.read_text())["objective"]["method"] == "dapo"
    assert all(r["step"] < 6 for r in read_jsonl(rd2.metrics_path))
    m1 = (rd1.metrics_path.stat().st_mtime_ns, rd1.status_path.stat().st_mtime_ns)

    again = clipbench("sweep", str(f), "--results-dir", str(res))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "1 finished, 1 to resume, 0 to start" in again.stderr
    assert (rd1.metrics_path.stat().st_mtime_ns, rd1.status_path.stat().st_mtime_ns) == m1  # untouched
    st2 = rd2.status()
    assert st2["state"] == "finished" and st2["attempts"] == 2 and st2["resumed_from"] == killed_at
    assert_same_results(res, ref_runs)

    third = clipbench("sweep", str(f), "--results-dir", str(res))  # nothing left to do
    assert third.returncode == 0 and "2 finished, 0 to resume, 0 to start" in third.stderr


def test_two_sweep_processes_share_one_results_dir(tmp_path, reference):
    f = write_sweep(tmp_path, "tiny", methods=("grpo", "dapo", "abc"))
    res = tmp_path / "results"
    p1 = popen("sweep", str(f), "--results-dir", str(res))
    try:
        wait_for(
            lambda: (
                manifest_path(res, "tiny").is_file()
                and any(RunDir(d).status().get("state") == "running" for d in (res / "tiny").iterdir() if d.is_dir())
            ),
            300,
            "the first process to start a run",
            p1,
        )
        p2 = popen("sweep", str(f), "--results-dir", str(res))
        out2 = p2.communicate(timeout=500)
        out1 = p1.communicate(timeout=500)
    finally:
        p1.kill()
    assert p1.returncode == 0 and p2.returncode == 0, (out1[1][-2000:], out2[1][-2000:])
    assert "locked" in out1[1] + out2[1]  # one of them found a run held by the other
    m = read_manifest(manifest_path(res, "tiny"))
    assert len(m["runs"]) == 3
    for rid in m["runs"]:
        rd = RunDir(res / "tiny" / rid)
        st = rd.status()
        assert st["state"] == "finished" and st["attempts"] == 1, (rid, st)  # each run trained once
        steps = [r["opt_step"] for r in rd.read_metrics()]
        assert steps == list(range(1, 13))
    _, _, ref_runs = reference
    assert_same_results(res, ref_runs)  # grpo and dapo: the same numbers as the reference sweep


def test_jobs_2_gives_the_same_results(tmp_path, reference):
    f, _, ref_runs = reference
    res = tmp_path / "results"
    p = clipbench("sweep", str(f), "--results-dir", str(res), "--jobs", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_results(res, ref_runs)


def test_joblib_launcher_runs_each_run_once(tmp_path, reference):
    f, _, ref_runs = reference
    res = tmp_path / "results"
    p = clipbench("sweep", str(f), "--results-dir", str(res), "--launcher", "joblib", "--jobs", "2")
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    assert_same_results(res, ref_runs)
    assert list((res / "tiny" / ".hydra").iterdir())  # Hydra's multirun outputs live under the sweep
    for rd in ref_runs:
        assert RunDir(res / "tiny" / rd).status()["attempts"] == 1


def test_failed_runs_are_skipped_unless_retry_failed(tmp_path):
    import shutil

    from clipbench.models import resolve_model_name

    # a model directory with its config and a damaged weights file: the preflight (config, a weights
    # file present) passes, training fails to load it (a directory without weights is refused by the
    # preflight: tests/test_config.py)
    broken = tmp_path / "no_such_model"
    broken.mkdir()
    shutil.copy(Path(resolve_model_name("builtin:arith-tiny")) / "config.json", broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    f = write_sweep(tmp_path, "broken", methods=("grpo",), **{"model.name": str(broken)})
    res = tmp_path / "results"
    p = clipbench("sweep", str(f), "--results-dir", str(res))
    assert p.returncode == 1, p.stderr[-2000:]
    (rid,) = read_manifest(manifest_path(res, "broken"))["runs"]
    st = RunDir(res / "broken" / rid).status()
    assert st["state"] == "failed" and "SafetensorError" in st["error"] and "Traceback" in st["traceback"]
    again = clipbench("sweep", str(f), "--results-dir", str(res))
    assert again.returncode == 0 and "1 failed: skipped" in again.stderr
    assert RunDir(res / "broken" / rid).status()["attempts"] == 1
    retry = clipbench("sweep", str(f), "--results-dir", str(res), "--retry-failed")
    assert retry.returncode == 1
    assert RunDir(res / "broken" / rid).status()["attempts"] == 2


# ---------------------------------------------------------------------------------------------
# Ray and submitit: a launch killed mid-way, then the same command again


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster (`ray start --head --block`, 2 CPUs), stopped at the end by SIGTERM to
    the `ray start` process (it drains and stops every process of this cluster, and only those)."""
    if importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip("hydra-ray-launcher is not installed (pip install -e .[dev])")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="cbray")  # short: Ray's unix socket paths live under it
    log = open(Path(tmp) / "start.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={tmp}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: "block forever" in (Path(tmp) / "start.log").read_text(), 120, "ray start", proc, poll=0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def kill_launch_then_relaunch(
    f: Path, res: Path, ref_runs: dict[str, RunDir], *launch_args: str, after_a_finished_run: bool = False
) -> dict:
    """Start the sweep, SIGKILL its whole process group (the launcher's driver and every job process it
    started locally) once a run has a checkpoint and steps after it (and, if asked, another run has
    finished), run the same command again.
    Checks that every run trained to completion exactly once (per the store) with the numbers of the
    uninterrupted reference sweep; returns {run_id: state at the kill}."""
    args = ("sweep", str(f), "--results-dir", str(res), *launch_args)
    rds = {rid: RunDir(res / "tiny" / rid) for rid in ref_runs}

    def interrupted_mid_run() -> bool:
        if after_a_finished_run and not any(rd.status().get("state") == "finished" for rd in rds.values()):
            return False
        return any(
            (ckpt_step(rd) or 0) >= 2
            and any(r["step"] >= ckpt_step(rd) for r in rd.read_metrics())
            and rd.status().get("state") == "running"
            for rd in rds.values()
        )

    p = popen(*args, new_session=True)
    try:
        wait_for(interrupted_mid_run, 300, "a checkpoint and steps after it in a run", p, poll=0.02)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone (wait_for reports why)
            pass
        p.wait()
    at_kill = {
        rid: {
            "state": rd.status().get("state") if rd.status_path.exists() else None,
            "ckpt": ckpt_step(rd),
            "mtimes": (rd.metrics_path.stat().st_mtime_ns, rd.status_path.stat().st_mtime_ns)
            if rd.status().get("state") == "finished"
            else None,
        }
        for rid, rd in rds.items()
    }
    assert any(s["state"] == "running" for s in at_kill.values())

    again = clipbench(*args)
    assert again.returncode == 0, (again.stdout[-2000:], again.stderr[-3000:])
    n_fin = sum(s["state"] == "finished" for s in at_kill.values())
    n_res = sum(s["state"] != "finished" and s["ckpt"] is not None for s in at_kill.values())
    assert f"{n_fin} finished, {n_res} to resume, {2 - n_fin - n_res} to start" in again.stderr
    for rid, rd in rds.items():
        st, killed = rd.status(), at_kill[rid]
        if killed["state"] == "finished":  # skipped: not a byte touched
            assert st["attempts"] == 1
            assert (rd.metrics_path.stat().st_mtime_ns, rd.status_path.stat().st_mtime_ns) == killed["mtimes"]
        else:  # the interrupted attempt (if it had started) and the one that finished it
            attempts = 1 if killed["state"] is None else 2
            assert st["attempts"] == attempts and st["resumed_from"] == killed["ckpt"], (rid, st, killed)
    assert_same_results(res, ref_runs)  # each optimizer step once, the same numbers as uninterrupted
    return at_kill


def test_ray_launcher_on_a_local_cluster_killed_then_relaunched(tmp_path, reference, ray_cluster):
    f, _, ref_runs = reference
    # 2 CPUs per run on the 2-CPU cluster: one run at a time, so the kill lands in the second run
    at_kill = kill_launch_then_relaunch(
        f,
        tmp_path / "results",
        ref_runs,
        "--launcher",
        "ray",
        f"hydra.launcher.ray.init.address={ray_cluster}",
        "+hydra.launcher.ray.remote.num_cpus=2",
        after_a_finished_run=True,
    )
    assert sorted(s["state"] for s in at_kill.values()) == ["finished", "running"]


def test_submitit_local_launcher_killed_then_relaunched(tmp_path, reference):
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        pytest.skip("hydra-submitit-launcher is not installed (pip install -e .[dev])")
    f, _, ref_runs = reference
    res = tmp_path / "results"
    kill_launch_then_relaunch(f, res, ref_runs, "--launcher", "submitit_local", "hydra.launcher.timeout_min=10")
    assert list((res / "tiny" / ".hydra").glob("*/.submitit"))  # submitit's job folders live under the sweep


def preempted_mid_run(rd: RunDir) -> bool:
    """The run has a checkpoint and has trained past it (a preemption now lands inside training)."""
    return (ckpt_step(rd) or 0) >= 2 and any(r["step"] >= ckpt_step(rd) for r in rd.read_metrics())


def test_sigterm_preempts_the_sweep_and_the_rerun_resumes_identically(tmp_path, reference):
    """SIGTERM to `clipbench sweep` (as a cluster sends it before it takes the machine back): the
    running run finishes its optimizer step, checkpoints and is marked preempted, no further run
    starts, exit code 75 with the advice to rerun; the rerun resumes it with the uninterrupted numbers."""
    f, _, ref_runs = reference
    res = tmp_path / "results"
    first, second = list(ref_runs)
    rd1, rd2 = RunDir(res / "tiny" / first), RunDir(res / "tiny" / second)
    p = popen("sweep", str(f), "--results-dir", str(res))
    wait_for(lambda: preempted_mid_run(rd1), 300, "a checkpoint and steps after it in the first run", p, poll=0.02)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 75, err[-3000:]
    assert "preempted" in err and "rerun the same command to resume" in err
    st = rd1.status()
    assert st["state"] == "preempted" and st["signal"] == "SIGTERM"
    assert not rd2.status_path.exists()  # the second run never started
    again = clipbench("sweep", str(f), "--results-dir", str(res))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 finished, 1 to resume, 1 to start" in again.stderr
    assert rd1.status()["resumed_from"] == st["step"] or rd1.status()["resumed_from"] is not None
    assert_same_results(res, ref_runs)


def test_submitit_requeues_a_preempted_job_which_resumes_the_run(tmp_path, reference):
    """--launcher submitit_local: submitit's preemption signal (USR2, what it asks SLURM to send before a
    time limit) reaches a job mid-run; the run checkpoints (status preempted), then submitit's own
    handler requeues the job, which resumes the run: the sweep finishes with the uninterrupted numbers."""
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        pytest.skip("hydra-submitit-launcher is not installed (pip install -e .[dev])")
    f, _, ref_runs = reference
    res = tmp_path / "results"
    rds = [RunDir(res / "tiny" / rid) for rid in ref_runs]
    p = popen(
        "sweep",
        str(f),
        "--results-dir",
        str(res),
        "--launcher",
        "submitit_local",
        "hydra.launcher.timeout_min=30",
        new_session=True,
    )
    try:
        wait_for(
            lambda: any(preempted_mid_run(rd) and rd.status().get("state") == "running" for rd in rds),
            300,
            "a checkpoint and steps after it in a run",
            p,
            poll=0.02,
        )
        (rd,) = [rd for rd in rds if rd.status().get("state") == "running"][:1]
        job = submitit_job_of(p.pid, rd.status()["pid"])
        os.kill(job, signal.SIGUSR2)  # submitit's default preemption signal
        wait_for(
            lambda: rd.status().get("state") == "preempted" or rd.status().get("attempts", 1) > 1,
            120,
            "the run preempted",
            p,
            poll=0.02,
        )
        out, err = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, err[-3000:]
    st = rd.status()
    assert st["state"] == "finished" and st["attempts"] == 2 and st["resumed_from"] is not None  # requeued, resumed
    assert_same_results(res, ref_runs)


def submitit_job_of(root: int, pid: int) -> int:
    """The job process under the sweep `root` that trains the run (its status.json's pid)."""
    assert pid in _descendants(root), (pid, root)
    return pid


def _descendants(root: int) -> list[int]:
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        cur = todo.pop()
        kids = [q for q, pp in parents.items() if pp == cur]
        out += kids
        todo += kids
    return out


def test_a_signal_during_a_runs_final_evaluation_still_stops_the_sweep(tmp_path):
    """Sequential sweep, SIGTERM once the first run has logged its last optimizer step (it is in its
    last checkpoint or final evaluation, past its last safe point): that run finishes, and no further
    run starts (the run's handler passed the signal on to the sweep's); exit 75. Before, the run's
    handler swallowed it and the sweep trained the other runs and exited 0."""
    f = write_sweep(tmp_path, "sig", methods=("grpo", "dapo", "abc"), **{"eval.limit": 64, "eval.n": 4})
    res = tmp_path / "results"
    p = popen("sweep", str(f), "--results-dir", str(res))
    first = RunDir(res / "sig")
    wait_for(
        lambda: any(
            max((r["step"] for r in RunDir(d).read_metrics()), default=-1) == 5
            for d in first.path.glob("*")
            if (d / "metrics.jsonl").exists()
        ),
        300,
        "the first run's last optimizer step",
        p,
        poll=0.01,
    )
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 75, err[-3000:]
    states = {d.name: RunDir(d).status().get("state") for d in (res / "sig").iterdir() if (d / "status.json").exists()}
    assert list(states.values()) == ["finished"], states  # the first run ended as it would have; no other started
    assert "2 not started" in err and "rerun the same command to resume" in err


def _session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (Linux /proc): the sweep, its workers, their helpers."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # session id; zombies are gone already
            out.append(int(stat.parent.name))
    return out


def test_sigterm_with_jobs_2_starts_no_queued_run(tmp_path):
    """--jobs 2, four runs: SIGTERM while two train. They checkpoint and stop; the queued runs never
    start (before: the task already handed to the pool's queue started, and an idle worker ignored the
    signal); exit 75."""
    f = write_sweep(tmp_path, "par", methods=("grpo", "dapo", "abc", "nsr"), **{"train.steps": 20})
    res = tmp_path / "results"
    p = popen("sweep", str(f), "--results-dir", str(res), "--jobs", "2")
    wait_for(lambda: len(training(res / "par")) == 2, 300, "two runs training", p, poll=0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 75, err[-3000:]
    states = [RunDir(d).status()["state"] for d in (res / "par").iterdir() if (d / "status.json").exists()]
    assert sorted(states) == ["preempted", "preempted"], (states, err[-2000:])
    assert "2 not started" in err


def training(sweep_dir: Path) -> list[RunDir]:
    """The runs of a sweep that are running and have logged an optimizer step."""
    runs = [RunDir(d) for d in sweep_dir.glob("*") if (d / "metrics.jsonl").exists()]
    return [rd for rd in runs if rd.status().get("state") == "running" and rd.read_metrics()]


def test_kill_9_of_the_sweep_leaves_no_worker_behind(tmp_path):
    """`kill -9` of the sweep process alone (not its group): its workers get the parent-death signal,
    checkpoint the runs they train (status preempted, not a stale 'running') and exit; no queued run
    starts, and nothing of the session is left (before: both workers trained on, one started a queued
    run, then they and the resource tracker idled forever)."""
    f = write_sweep(tmp_path, "orph", methods=("grpo", "dapo", "abc", "nsr"), **{"train.steps": 20})
    res = tmp_path / "results"
    p = popen("sweep", str(f), "--results-dir", str(res), "--jobs", "2", new_session=True)
    wait_for(lambda: len(training(res / "orph")) == 2, 300, "two runs training", p, poll=0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    wait_for(lambda: not _session_pids(p.pid), 120, "every process of the sweep's session to exit")
    runs = [RunDir(d) for d in (res / "orph").iterdir() if (d / "status.json").exists()]
    assert [rd.status()["state"] for rd in runs] == ["preempted", "preempted"]
    assert all(ckpt_step(rd) is not None for rd in runs)  # resumable


def test_an_organism_sweep_on_a_local_ray_cluster_reports_as_the_local_one(tmp_path, ray_cluster):
    """The organism recipe, 2 rules x 2 seeds (2 rollout steps, a small evaluation), swept with
    `--jobs 2` here and on the Ray cluster (2 CPUs, one per run: two runs at a time, each on one torch
    thread, as each of the local sweep's 2 workers on 2 cores): the same runs with the same numbers,
    and the same report, byte for byte but for the results directory it names."""
    f = tmp_path / "org.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "org",
                "base": str(REPO / "recipes" / "organism.yaml"),
                "overrides": {
                    "train.steps": 2,
                    "train.checkpoint_every": 2,
                    "eval.every": 0,
                    "eval.limit": 8,
                    "eval.n": 2,
                    "eval.n_ends": 4,
                    "sampler.backend": "hf",
                    "tracking.mlflow": False,
                },
                "grid": {"seed": [0, 1], "objective.name": ["grpo", "cispo"]},
            }
        )
    )
    reports = {}
    for where, launch in (
        ("local", ("--jobs", "2")),
        (
            "ray",
            (
                "--launcher",
                "ray",
                f"hydra.launcher.ray.init.address={ray_cluster}",
                "+hydra.launcher.ray.remote.num_cpus=1",
            ),
        ),
    ):
        res = tmp_path / where
        p = clipbench("sweep", str(f), "--results-dir", str(res), *launch)
        assert p.returncode == 0, (where, p.stderr[-3000:])
        out = tmp_path / f"report-{where}"
        p = clipbench("report", "org", "--results-dir", str(res), "--format", "markdown", "--out", str(out))
        assert p.returncode == 0, (where, p.stderr[-3000:])
        # the report names the sweep's directory; everything else must be the same
        reports[where] = {q.name: q.read_text().replace(str(res), "<results>") for q in sorted(out.glob("*.md"))}
    runs = read_manifest(manifest_path(tmp_path / "local", "org"))["runs"]
    assert len(runs) == 4 and list(read_manifest(manifest_path(tmp_path / "ray", "org"))["runs"]) == list(runs)
    assert_same_results(tmp_path / "ray", {rid: RunDir(tmp_path / "local" / "org" / rid) for rid in runs}, "org")
    assert reports["local"] and reports["ray"] == reports["local"]
