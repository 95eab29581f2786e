"""The built wheel, installed where the repository is not importable, runs a shipped recipe by name
from an empty directory (issue 27). The wheel is built from a copy of the package alone (clipbench/,
pyproject.toml, README.md), so nothing outside the package can be what makes it work. The fresh venv
reuses this environment's dependencies (a .pth line to its site-packages, not its .pth files, so this
checkout's editable install is not seen): nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(OMP_NUM_THREADS="1", COLUMNS="250")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a fresh venv with the wheel built from this checkout installed (--no-deps)."""
    root = tmp_path_factory.mktemp("package")
    src = root / "src"
    shutil.copytree(REPO / "clipbench", src / "clipbench", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    res = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "wheel"),
            str(src),
        ],
        cwd=root,
    )
    assert res.returncode == 0, res.stderr
    (wheel,) = (root / "wheel").glob("clipbench-*.whl")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, transformers, ... from here
    res = run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd=root)
    assert res.returncode == 0, res.stderr
    return env_dir / "bin"


def test_the_wheel_is_what_runs(installed, tmp_path):
    res = run([str(installed / "python"), "-c", "import clipbench; print(clipbench.__file__)"], cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip().startswith(str(installed.parent)), res.stdout + res.stderr
    res = run([str(installed / "clipbench"), "--version"], cwd=tmp_path)
    assert res.stdout == "clipbench 0.1.0 (results store format 2)\n", res.stderr
    res = run([str(installed / "clipbench"), "recipes"], cwd=tmp_path)
    # one line per recipe and sweep, the name whole ("train quickstart": `clipbench train quickstart`)
    assert res.returncode == 0 and "train quickstart " in res.stdout and "sweep quickstart " in res.stdout


def test_a_named_recipe_and_sweep_run_from_an_empty_directory(installed, tmp_path):
    """`clipbench train arith_tiny` (2 real steps of the tiny built-in model), then the quickstart
    sweep by name (its `base: ../recipes/quickstart.yaml` inside the installed package) planned."""
    cb = str(installed / "clipbench")
    res = run([cb, "train", "arith_tiny", "train.steps=2", "eval.every=0", "eval.limit=8", "eval.n=2"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (run_dir,) = (tmp_path / "results" / "train").iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 2 and status["store_format"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [0, 1]  # two rollout steps, 4 mini-batches each
    res = run([cb, "sweep", "quickstart", "--dry-run", "--json"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    plans = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert sorted((p["config"]["objective"]["method"], p["config"]["seed"]) for p in plans) == [
        ("grpo", 0),
        ("grpo", 1),
    ]
    res = run([cb, "init", "kit"], cwd=tmp_path)
    assert res.returncode == 0 and (tmp_path / "kit" / "sweep.yaml").is_file(), res.stderr
    res = run([cb, "sweep", "kit/sweep.yaml", "--dry-run"], cwd=tmp_path)
    assert res.returncode == 0 and "6 runs" in res.stdout, res.stdout + res.stderr
