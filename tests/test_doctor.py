"""`clipbench doctor` (clipbench.engines.machine): every row against what this machine is, read another
way; an MLflow server that answers (a real HTTP server on 127.0.0.1) and one that does not."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib.metadata import version

import torch
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.engines.machine import machine_checks

runner = CliRunner()


def rows(**kw) -> dict:
    return {c.part: c for c in machine_checks(**kw)}


def test_rows_say_what_this_machine_is(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    r = rows(results_dir=tmp_path / "res")
    assert r["torch"].found.startswith(torch.__version__) and r["torch"].ok
    assert r["TRL"].ok and r["TRL"].found == version("trl")
    assert r["W&B (tracking.sinks)"].found == version("wandb") and r["TensorBoard (tracking.sinks)"].ok
    assert (
        r["MLflow"].ok
        and r["MLflow"].found == f"{version('mlflow')}, embedded: sqlite:///{tmp_path / 'res' / 'mlflow.db'}"
    )
    cores = len(os.sched_getaffinity(0))
    assert r["threads"].found.startswith(f"torch {torch.get_num_threads()}, {cores} cores usable")
    if torch.cuda.is_available():  # a GPU machine: one row per GPU with its memory
        p = torch.cuda.get_device_properties(0)
        assert r["GPU 0"].found.startswith(f"{p.name}, {p.total_memory / 2**30:.1f} GiB")
        assert "CUDA GPUs" not in r
    else:  # this CPU machine: no GPU, the hf sampler, no verl trainer; each missing piece with its fix
        assert not r["CUDA GPUs"].ok and "pip install torch --index-url" in r["CUDA GPUs"].fix
        assert r["sampler (backend: auto)"].found.startswith("hf")
        assert not r["verl"].ok and r["verl"].fix
        assert r["engines usable here"].found == "builtin, trl (default: builtin)"
    for c in r.values():
        assert c.ok or c.fix, c  # every missing piece names its fix


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):
        pass


def test_a_configured_server_answers_or_not(tmp_path, monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        c = rows(results_dir=tmp_path)["MLflow"]
        assert c.ok and c.found == f"{version('mlflow')}, server {uri} answers"
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = rows(results_dir=tmp_path, tracking_uri=f"http://127.0.0.1:{port}")["MLflow"]
    assert not c.ok and "unreachable" in c.found and "mlflow server" in c.fix


def test_cli_json(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    res = runner.invoke(app, ["doctor", "--json", "--results-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    parts = [json.loads(line)["part"] for line in res.stdout.splitlines()]
    assert parts[:2] == ["clipbench", "torch"] and parts[-4:] == [
        "MLflow",
        "W&B (tracking.sinks)",
        "TensorBoard (tracking.sinks)",
        "threads",
    ]
    assert not list(tmp_path.iterdir())  # nothing written


def test_rehearse_refuses_bad_input_before_the_table(tmp_path):
    res = runner.invoke(app, ["rehearse", "nope", "--results-dir", str(tmp_path)])
    assert res.exit_code == 2 and len(res.stderr.splitlines()) == 1 and "nope: file not found" in res.stderr
