"""Against a real `mlflow server` (sqlite backend, proxied artifacts) on 127.0.0.1, started once for
this module: a sweep's runs, params, metrics and artifacts land where expected; the server stopped
mid-sweep, restarted, then `clipbench sync`: nothing missing, nothing duplicated."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.sweep.manifest import manifest_path, read_manifest
from clipbench.tracking import mlflow_client as mc
from clipbench.tracking.mirror import expected_artifacts, expected_metrics
from clipbench.tracking.store import RunDir

pytestmark = [
    pytest.mark.mlflow_server,
    pytest.mark.slow,
    pytest.mark.xdist_group("mlflow_server"),
    pytest.mark.timeout(600),
]

REPO = Path(__file__).resolve().parent.parent
TINY = {
    "train.steps": 4,
    "train.prompts_per_step": 2,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "train.checkpoint_every": 2,
    "eval.limit": 8,
    "eval.n": 2,
    "eval.every": 2,
    "tracking.batch_every": 2,
}
runner = CliRunner()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        self.log = root / "server.log"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> None:
        exe = Path(sys.executable).parent / "mlflow"
        cmd = [
            str(exe),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root
        )
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("mlflow server did not become healthy")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    s.start()
    yield s
    s.stop()


def write_sweep(tmp: Path, name: str, methods, **over) -> Path:
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


def check_mirror(client, uri: str, res: Path, sweep: str) -> dict[str, str]:
    """Every run of the store is in MLflow exactly: tags, nesting, params, every metric point once,
    the artifacts. Returns {run_id: mlflow run id}."""
    exp = client.get_experiment_by_name("clipbench")
    parents = mc.find_runs(client, exp.experiment_id, sweep=sweep, role="sweep")
    assert len(parents) == 1
    parent = parents[0].info.run_id
    assert "manifest.json" in [f.path for f in client.list_artifacts(parent)]
    m = read_manifest(manifest_path(res, sweep))
    out = {}
    for rid, cfg in m["runs"].items():
        rd = RunDir(res / sweep / rid)
        found = mc.find_runs(client, exp.experiment_id, sweep=sweep, role="run", run_id=rid)
        assert len(found) == 1, rid
        run = found[0]
        mid = run.info.run_id
        assert mc.recorded_mlflow_run(rd, uri)["run_id"] == mid
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == parent
        assert (tags["sweep"], tags["run_id"], tags["method"], tags["seed"], tags["model"]) == (
            sweep,
            rid,
            cfg["objective"]["method"],
            str(cfg["seed"]),
            cfg["model"]["name"],
        )
        assert run.info.status == "FINISHED"
        params = run.data.params
        assert params["objective.method"] == cfg["objective"]["method"]
        assert params["train.steps"] == str(cfg["train"]["steps"]) and params["run_id"] == rid
        assert params["rule.method"] == cfg["objective"]["method"] and "rule.ref_band_pos" in params
        expected = expected_metrics(rd)
        assert {"loss", "reward/mean", "clip_events", "eval/arith/avg_at_2", "eval/arith/pass_at_2"} <= set(expected)
        assert set(run.data.metrics) == set(expected)
        # one step axis: evaluations at rollout steps 0, 2, 4 sit at optimizer steps 0, 4, 8 (2 mini-batches)
        n_steps = cfg["train"]["steps"]
        assert sorted(m.step for m in client.get_metric_history(mid, "eval/arith/avg_at_2")) == [
            2 * k for k in range(0, n_steps + 1, 2)
        ]
        assert not {"step", "opt_step", "epoch", "mini_batch", "old_logp_source"} & set(run.data.metrics)
        assert params["eval/arith/n"] == "2" and params["eval/arith/num_problems"] == "8"
        for key, steps in expected.items():
            hist = [x.step for x in client.get_metric_history(mid, key)]
            assert sorted(hist) == sorted(steps), (rid, key)  # none missing, none twice
        arts = set()
        for d in (None, "hist", "eval", *[f"eval/{p.name}" for p in (rd.path / "eval").iterdir()]):
            arts |= {f.path for f in client.list_artifacts(mid, d)}
        for f, where in expected_artifacts(rd):
            assert (f"{where}/{f.name}" if where else f.name) in arts
        assert {
            "config.yaml",
            "hist/log_ratio.jsonl",
            "eval/step_000000/arith.json",
            f"eval/step_{n_steps:06d}/arith.json",
        } <= arts
        out[rid] = mid
    return out


def test_sweep_lands_in_the_server(tmp_path, server):
    f = write_sweep(tmp_path, "srv", ["grpo", "dapo"])
    res = tmp_path / "results"
    old = os.umask(0o007)  # a results dir shared by a group: files 0660, directories 0770
    try:
        r = runner.invoke(app, ["sweep", str(f), "--results-dir", str(res), "--tracking-uri", server.uri])
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output[-3000:]
    client = mc.client_for(server.uri)
    ids = check_mirror(client, server.uri, res, "srv")
    assert len(ids) == 2
    assert not (res / "mlflow.db").exists()  # with a server, no embedded store
    written = [p for p in (res / "srv").rglob("*") if ".locks" not in p.parts]
    assert any(p.match("checkpoints/last/*") for p in written) and any(p.name == "status.json" for p in written)
    modes = {str(p.relative_to(res)): p.stat().st_mode & 0o777 for p in written}
    assert {k: m for k, m in modes.items() if m != (0o770 if (res / k).is_dir() else 0o660)} == {}


def test_server_stopped_mid_sweep_then_sync_restores_everything_once(tmp_path, server, monkeypatch):
    import clipbench.train.loop as loop

    f = write_sweep(tmp_path, "outage", ["grpo", "abc", "dapo"])
    res = tmp_path / "results"
    real = loop.run_training
    calls = []

    def run_training(cfg, run_dir, **kw):
        calls.append(Path(run_dir).name)
        progress = kw.get("progress")
        if len(calls) == 2:  # the server dies during the second run, after its second step

            def progress_and_kill(ev, _inner=progress):
                if ev["step"] == 2:
                    server.stop()
                if _inner:
                    _inner(ev)

            kw["progress"] = progress_and_kill
        return real(cfg, run_dir, **kw)

    monkeypatch.setattr(loop, "run_training", run_training)
    r = runner.invoke(app, ["sweep", str(f), "--results-dir", str(res), "--tracking-uri", server.uri])
    assert r.exit_code == 0, r.output[-3000:]  # training never noticed
    assert "clipbench sync outage" in r.output
    m = read_manifest(manifest_path(res, "outage"))
    for rid in m["runs"]:
        assert RunDir(res / "outage" / rid).status()["state"] == "finished"
    second, third = calls[1], calls[2]
    assert mc.recorded_mlflow_run(RunDir(res / "outage" / second), server.uri)["offline"] is True
    assert mc.recorded_mlflow_run(RunDir(res / "outage" / third), server.uri)["offline"] is True

    server.start()
    client = mc.client_for(server.uri)
    exp = client.get_experiment_by_name("clipbench").experiment_id
    partial = mc.find_runs(client, exp, sweep="outage", role="run", run_id=second)
    assert len(partial) == 1  # created before the outage, with some of its metrics
    assert not mc.find_runs(client, exp, sweep="outage", role="run", run_id=third)

    s = runner.invoke(app, ["sync", "outage", "--results-dir", str(res), "--tracking-uri", server.uri])
    assert s.exit_code == 0, s.output[-3000:]
    ids = check_mirror(client, server.uri, res, "outage")
    assert ids[second] == partial[0].info.run_id  # the same child, completed
    again = runner.invoke(app, ["sync", "outage", "--results-dir", str(res), "--tracking-uri", server.uri])
    assert again.exit_code == 0
    check_mirror(client, server.uri, res, "outage")  # still exactly once


def test_server_down_at_the_start_then_up_mid_sweep(tmp_path, server, monkeypatch):
    """The first run trains offline (the exact replay command is printed); the server is up for the
    second, whose run creates the sweep's parent; the sweep closes it. `sync` then adds the first run
    under the name the sweep gave it, with its real start and end times."""
    import clipbench.train.loop as loop
    from clipbench.config.labels import run_label

    f = write_sweep(tmp_path, "late", ["grpo", "dapo"], **{"train.steps": 2})
    res = tmp_path / "results"
    real = loop.run_training
    calls = []

    def run_training(cfg, run_dir, **kw):
        calls.append(Path(run_dir).name)
        out = real(cfg, run_dir, **kw)
        if len(calls) == 1:
            server.start()  # up before the second run's sink connects
        return out

    server.stop()
    monkeypatch.setattr(loop, "run_training", run_training)
    r = runner.invoke(app, ["sweep", str(f), "--results-dir", str(res), "--tracking-uri", server.uri])
    assert r.exit_code == 0, r.output[-3000:]
    hint = f"clipbench sync late --results-dir {res} --tracking-uri {server.uri}"
    assert f"`{hint}`" in " ".join(r.output.split())  # the exact command (rich may wrap the line)
    client = mc.client_for(server.uri)
    exp = client.get_experiment_by_name("clipbench").experiment_id
    (parent,) = mc.find_runs(client, exp, sweep="late", role="sweep")
    assert parent.info.status == "FINISHED"  # closed by the sweep although it started offline
    first = RunDir(res / "late" / calls[0])
    assert not mc.find_runs(client, exp, sweep="late", role="run", run_id=calls[0])

    s = runner.invoke(app, hint.split()[1:])
    assert s.exit_code == 0, s.output[-3000:]
    check_mirror(client, server.uri, res, "late")
    (child,) = mc.find_runs(client, exp, sweep="late", role="run", run_id=calls[0])
    status = first.status()
    assert child.info.run_name == run_label(first.read_config())
    assert child.info.start_time == int(status["started"] * 1000)
    assert child.info.end_time == int(status["finished"] * 1000)  # its real duration, not the sync's
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"


def test_kill_9_then_resume_with_the_server_up_leaves_nothing_missing(tmp_path, server):
    """SIGKILL loses the sink's buffered points (batch_every 100: none were sent); the resumed run sends
    what the store holds and MLflow lacks, so the mirror is exact without `clipbench sync`."""
    f = write_sweep(tmp_path, "killed", ["grpo"], **{"tracking.batch_every": 100})
    res = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "clipbench.cli",
        "sweep",
        str(f),
        "--results-dir",
        str(res),
        "--tracking-uri",
        server.uri,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if list((res / "killed").glob("*/checkpoints/last/state.json")):  # the checkpoint at step 2
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the sweep ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    client = mc.client_for(server.uri)
    exp = client.get_experiment_by_name("clipbench").experiment_id
    (before,) = mc.find_runs(client, exp, sweep="killed", role="run")
    assert before.info.status == "RUNNING" and not before.data.metrics  # the buffer died with the process

    r = runner.invoke(app, ["sweep", str(f), "--results-dir", str(res), "--tracking-uri", server.uri])
    assert r.exit_code == 0, r.output[-3000:]
    assert "resumed" in r.output and "clipbench sync" not in r.output
    (after,) = check_mirror(client, server.uri, res, "killed").values()
    assert after == before.info.run_id
