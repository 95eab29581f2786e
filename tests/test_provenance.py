"""Every run records where it ran and what it started from (clipbench/tracking/provenance.py): the
base model's weights checksum, the machine, the software, threads and world size, once per start or
resume, mirrored to MLflow; real runs on the shipped tiny model."""

from __future__ import annotations

import hashlib

import pytest
import torch

from clipbench.models import builtin_path, read_build_info, weights_sha256
from clipbench.tracking import provenance as prov


def test_a_builtin_models_checksum_is_its_shipped_build_record():
    got = prov.base_model("builtin:arith-tiny")
    assert got["name"] == "builtin:arith-tiny" and got["path"] == str(builtin_path("arith-tiny"))
    assert got["weights_sha256"] == read_build_info(builtin_path("arith-tiny"))["weights_sha256"]
    # weights_sha256: each weight file's name, a NUL, then its bytes, names sorted (one file here)
    f = builtin_path("arith-tiny") / "model.safetensors"
    assert got["weights_sha256"] == hashlib.sha256(b"model.safetensors\0" + f.read_bytes()).hexdigest()


def test_a_hub_id_is_hashed_from_the_local_cache_and_never_downloaded(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path))
    missing = prov.base_model("clipbench-test/not-cached")
    assert missing["weights_sha256"] is None and "nothing was downloaded" in missing["note"]
    # the cache layout huggingface_hub reads: refs/main names the snapshot holding the files
    repo = tmp_path / "models--clipbench-test--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"weights")
    cached = prov.base_model("clipbench-test/cached")
    assert cached["path"] == str(snap) and cached["source"] == "local Hugging Face cache"
    assert cached["weights_sha256"] == hashlib.sha256(b"model.safetensors\0weights").hexdigest()
    assert "note" not in cached


def test_params_mirror_the_first_start_and_what_a_resume_changed():
    first = {
        "step": 0,
        "time": 1.0,
        "engine": "builtin",
        "base_model": {"weights_sha256": "ab"},
        "threads": 2,
        "world_size": 2,
        "machine": {"gpu": None},
    }
    same = {**first, "step": 4, "time": 2.0}
    other = {**first, "step": 6, "time": 3.0, "world_size": 1}
    assert prov.provenance_params([first, same, other]) == {
        "provenance.engine": "builtin",
        "provenance.base_model.weights_sha256": "ab",
        "provenance.threads": 2,
        "provenance.world_size": 2,
        "provenance.machine.gpu": "none",
        "provenance.start2.world_size": 1,
    }
    assert prov.provenance_params([]) == {}


def test_machine_description():
    record = {
        "machine": {
            "cpu": "Xeon",
            "cpu_flags": "sse2 avx2 fma",
            "cpu_capability": "AVX2",
            "cpus": 4,
            "gpu": "NVIDIA H100",
            "gpu_count": 8,
            "cuda": "12.8",
        },
        "software": {
            "python": "3.11.7",
            "os": "Linux",
            "torch": "2.9.0",
            "transformers": "4.57.0",
            "vllm": "0.11.0",
            "trl": None,
            "clipbench": "0.1.0",
        },
        "threads": 8,
        "world_size": 8,
    }
    flags = hashlib.sha256(b"avx2 fma sse2").hexdigest()[:8]  # the sorted set: order does not matter
    assert prov.describe_machine(record) == (
        f"Xeon (4 CPUs, AVX2, flags {flags}); 8 x NVIDIA H100 (CUDA 12.8); torch 2.9.0, transformers 4.57.0, "
        f"vllm 0.11.0; Python 3.11.7, Linux; 8 threads, world size 8"
    )


@pytest.mark.slow
def test_a_real_run_records_its_provenance_once_per_start_and_mirrors_it(tmp_path):
    from mlflow.tracking import MlflowClient

    from clipbench.config import load_run_config, to_dict
    from clipbench.tracking.mirror import expected_params
    from clipbench.tracking.mlflow_sink import run_sink
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    cfg = load_run_config(
        "recipes/arith_tiny.yaml",
        [
            "train.prompts_per_step=4",
            "sampler.group_size=4",
            "sampler.max_new_tokens=8",
            "train.steps=2",
            "eval.benchmarks=[]",
            "tracking.mlflow=true",
        ],
    )
    rd = RunDir(tmp_path / "results" / "train" / "run")

    def train(resume: bool):
        sink = run_sink(cfg, rd, results_dir=tmp_path / "results", sweep="train", resume=resume)
        run_training(cfg, rd.path, resume=resume, sink=sink)
        sink.close()

    train(resume=False)
    (start,) = prov.read_provenance(rd.path)
    assert start["step"] == 0 and start["engine"] == "builtin" and start["device"] == "cpu"
    assert start["base_model"]["weights_sha256"] == weights_sha256(builtin_path("arith-tiny"))
    assert start["threads"] == torch.get_num_threads() and start["world_size"] == 1
    assert start["software"]["torch"] == torch.__version__ and start["machine"]["cpus"] >= 1
    assert start["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the resume runs with another thread count: a second record says so
    try:
        train(resume=True)
    finally:
        torch.set_num_threads(threads)
    starts = prov.read_provenance(rd.path)
    assert [s["step"] for s in starts] == [0, 2] and [s["threads"] for s in starts] == [threads, 1]

    client = MlflowClient(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("clipbench").experiment_id])
    params = run.data.params
    assert params["provenance.base_model.weights_sha256"] == start["base_model"]["weights_sha256"]
    assert params["provenance.threads"] == str(threads) and params["provenance.world_size"] == "1"
    if threads != 1:
        assert params["provenance.start1.threads"] == "1"
    # `clipbench sync` replays exactly what the live sink sent
    want = expected_params(rd, to_dict(cfg), rd.status())
    assert {k: v for k, v in want.items() if k.startswith("provenance.")} == {
        k: v for k, v in params.items() if k.startswith("provenance.")
    }

    train(resume=False)  # a fresh start owns the directory: one record again
    assert [s["step"] for s in prov.read_provenance(rd.path)] == [0]


def test_the_recorded_thread_count_is_the_starts_one_or_none(tmp_path):
    import json

    from clipbench.tracking.provenance import PROVENANCE_FILE, recorded_threads

    def run(*threads):
        d = tmp_path / "-".join(map(str, threads)) if threads else tmp_path / "none"
        d.mkdir()
        starts = [{"step": 10 * i, **({} if t is None else {"threads": t})} for i, t in enumerate(threads)]
        (d / PROVENANCE_FILE).write_text(json.dumps({"starts": starts}))
        return d

    assert recorded_threads(run(1)) == 1
    assert recorded_threads(run(2, 2)) == 2  # resumed on the same count
    assert recorded_threads(run(1, 2)) is None  # resumed on another: no one count to replay on
    assert recorded_threads(run(1, None)) is None  # a start that did not record it
    assert recorded_threads(run()) is None and recorded_threads(tmp_path / "missing") is None
