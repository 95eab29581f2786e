"""Where a run ran and what it started from: one record per start or resume, in ``<run>/provenance.json``.

    records = record_start(rd, cfg.model.name, engine="builtin", world_size=2, device="cpu", fresh=True)
    sink.log_params(provenance_params(records))          # the MLflow mirror (params `provenance.*`)
    describe_machine(record)                             # one line, for the report

A record (``{"starts": [record, ...]}``; a fresh start replaces the list, a resume appends to it):

    step, time, engine, device       the rollout step the start began at (0 for a fresh start); unix time
    base_model                       name, path, weights_sha256 (models.weights_sha256: the weight files'
                                     bytes); None with a `note` for a hub id that is not in the local
                                     Hugging Face cache (nothing is downloaded to hash it)
    machine                          cpu (model name), cpu_flags (/proc/cpuinfo), cpu_capability (the
                                     SIMD level torch's CPU kernels use), cpus, gpu (name), gpu_count, cuda
    software                         python, os, torch, transformers, vllm, trl, clipbench (None: absent)
    threads, world_size              torch's intra-op threads, the run's processes

Why: the same run config gives the same numbers only on the same machine, thread count and world
size (float summation order differs elsewhere) and from the same base-model bytes; the report lists
the machines a comparison spans and flags runs compared across different base-model checksums.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from clipbench.tracking.files import atomic_write_json, read_json

PROVENANCE_FILE = "provenance.json"
SOFTWARE = ("torch", "transformers", "vllm", "trl", "clipbench")
PARAM_PREFIX = "provenance."
NOT_MIRRORED = ("step", "time")  # differ on every start: in the file only


def provenance_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / PROVENANCE_FILE


def read_provenance(run_dir: str | Path) -> list[dict]:
    """The run's start records, oldest first ([] for a run written before provenance was recorded)."""
    data = read_json(provenance_path(run_dir), {}, kind="provenance")
    starts = data.get("starts", [])
    return [s for s in starts if isinstance(s, dict)] if isinstance(starts, list) else []


def record_start(
    rd, model_name: str, *, engine: str, world_size: int, device: str, step: int = 0, fresh: bool
) -> list[dict]:
    """Collect this start's record and write provenance.json (atomically): replaced on a fresh start,
    appended on a resume. Returns every record of the run (what `provenance_params` mirrors)."""
    record = {
        "step": int(step),
        "time": time.time(),
        "engine": engine,
        "device": str(device),
        "base_model": base_model(model_name),
        "machine": machine(),
        "software": software(),
        "threads": torch_threads(),
        "world_size": int(world_size),
    }
    starts = [] if fresh else read_provenance(rd.path)
    starts.append(record)
    atomic_write_json(provenance_path(rd.path), {"starts": starts})
    return starts


# ---- what is recorded ---------------------------------------------------------------------------


def base_model(name: str) -> dict:
    """The base model's name, directory and weights checksum (a hub id: its local cache's copy, if any)."""
    # PLC0415, deferred: models pulls in torch
    from clipbench.models import looks_local, resolve_model_name, weights_sha256  # noqa: PLC0415

    path = resolve_model_name(name)
    out: dict[str, Any] = {"name": name, "path": str(path), "weights_sha256": weights_sha256(path)}
    if out["weights_sha256"] is None and not looks_local(path):
        cached = _hub_cache_snapshot(path)
        if cached is not None:
            out.update(path=str(cached), weights_sha256=weights_sha256(cached), source="local Hugging Face cache")
    if out["weights_sha256"] is None:
        out["note"] = (
            "no weight files found locally (a hub id not in the local Hugging Face cache): no checksum; "
            "nothing was downloaded to compute one"
        )
    return out


def _hub_cache_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of `repo_id`, never downloading; None when absent."""
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - huggingface_hub is heavy

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a valid id, no huggingface_hub: no checksum
        return None


def machine() -> dict:
    import torch  # noqa: PLC0415 - torch is heavy

    cpu, flags = _cpuinfo()
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "cpu": cpu or platform.processor() or platform.machine(),
        "cpu_flags": flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": _cpus(),
        "gpu": ", ".join(sorted(set(gpus))) or None,
        "gpu_count": len(gpus),
        "cuda": torch.version.cuda if gpus else None,
    }


def _cpuinfo() -> tuple[str | None, str | None]:
    """(model name, flags) from /proc/cpuinfo (Linux; 'Features' on ARM); (None, None) elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("model name") or fields.get("Hardware"), fields.get("flags") or fields.get("Features")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 0


def software() -> dict:
    out: dict[str, str | None] = {"python": platform.python_version(), "os": platform.platform()}
    for name in SOFTWARE:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def clipbench_version() -> str | None:
    """The installed clipbench's version (None when it runs from a tree that is not installed)."""
    try:
        return metadata.version("clipbench")
    except metadata.PackageNotFoundError:
        return None


def torch_threads() -> int:
    import torch  # noqa: PLC0415 - torch is heavy

    return torch.get_num_threads()


def recorded_threads(run_dir: str | Path) -> int | None:
    """The torch thread count the run's starts ran on, None when they disagree or none recorded it (a
    forward's summation order depends on it: a replay on the same machine and thread count gives
    training's log-probs bit for bit)."""
    counts = {start.get("threads") for start in read_provenance(run_dir)}
    return counts.pop() if len(counts) == 1 and None not in counts else None


# ---- reading records: the MLflow mirror and the report -------------------------------------------


def _flat(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def provenance_params(starts: Sequence[Mapping]) -> dict[str, Any]:
    """MLflow params: ``provenance.<key>`` of the first start; a later start (a resume) adds
    ``provenance.start<i>.<key>`` for each key whose value differs from the first start's (params
    cannot change once logged). Every start's time and step stay in provenance.json."""
    if not starts:
        return {}
    first = {k: v for k, v in _flat(starts[0]).items() if k not in NOT_MIRRORED}
    out = {f"{PARAM_PREFIX}{k}": ("none" if v is None else v) for k, v in first.items()}
    for i, start in enumerate(starts[1:], 1):
        for k, v in _flat(start).items():
            if k not in NOT_MIRRORED and first.get(k) != v:
                out[f"{PARAM_PREFIX}start{i}.{k}"] = "none" if v is None else v
    return out


def flags_digest(flags: str | None) -> str | None:
    """8 hex characters naming a CPU's flag set (the set, not its order)."""
    if not flags:
        return None
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]


def describe_machine(record: Mapping) -> str:
    """Where a start ran, on one line: hardware, software, threads and world size (not the model)."""
    m, s = record.get("machine", {}), record.get("software", {})
    flags = flags_digest(m.get("cpu_flags"))
    cpu = f"{m.get('cpu') or 'unknown CPU'} ({m.get('cpus', '?')} CPUs, {m.get('cpu_capability') or '?'}" + (
        f", flags {flags})" if flags else ")"
    )
    gpu = f"{m['gpu_count']} x {m['gpu']} (CUDA {m.get('cuda')})" if m.get("gpu_count") else "no GPU"
    versions = ", ".join(f"{k} {s[k]}" for k in SOFTWARE if s.get(k) and k != "clipbench")
    return (
        f"{cpu}; {gpu}; {versions}; Python {s.get('python', '?')}, {s.get('os', '?')}; "
        f"{record.get('threads', '?')} threads, world size {record.get('world_size', '?')}"
    )


def weights_checksum(record: Mapping) -> str | None:
    return (record.get("base_model") or {}).get("weights_sha256")
