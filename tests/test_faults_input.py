"""Faults that must be one line with the way out (issue 39, cases 7 and 10).

- a frozen manifest config of the wrong type (before: 311 lines of omegaconf), a sweep name of 256
  characters (136 lines) or with non-ASCII letters (the message said "letters"), a read-only `.locks/`
  or run directory inside a writable store (143-233 lines): one line, exit 2, nothing written.
- `--dry-run` of a read-only store shows the plan (it writes nothing; before: refused).
- a file-size limit (`ulimit -f`, EFBIG) is handled as a full disk is: one line naming the file and the
  limit, the run resumable, and the same command without the limit finishes it.
- a MemoryError inside a run (a process memory limit): one line, the run marked failed with reason
  out-of-memory (before: left "running"), and the same command resumes it (no --retry-failed).
- stale `.NAME.*.tmp` files of atomic writes are removed when the run starts again.

Read-only directories are real read-only bind mounts (root only: root may write any directory whose
mode says otherwise), skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clipbench.cli import app
from clipbench.sweep.manifest import manifest_path, read_manifest
from clipbench.tracking.store import RunDir

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "store_format1"
SWEEP = FIXTURE / "fixture_v1.sweep.yaml"


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path) -> Path:
    shutil.copytree(FIXTURE / "fixture_v1", tmp_path / "results" / "fixture_v1")
    return tmp_path / "results"


def one_line_exit_2(res, start: str) -> None:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), lines


def test_a_frozen_config_of_the_wrong_type_is_one_line(store):
    mpath = store / "fixture_v1" / "manifest.json"
    m = json.loads(mpath.read_text())
    rid = sorted(m["runs"])[0]
    m["runs"][rid]["train"]["steps"] = "ten"
    mpath.write_text(json.dumps(m))
    before = snapshot(store)
    res = runner.invoke(app, ["sweep", str(SWEEP), "--results-dir", str(store)])
    one_line_exit_2(res, f"error: {mpath}: the frozen config of run {rid} (train.steps): Value 'ten' of type 'str'")
    assert "move it away and rerun" in res.stderr
    assert snapshot(store) == before


@pytest.mark.parametrize(
    "name,reason",
    [
        ("a" * 256, "name: 256 characters, at most 128 (it names the sweep's directory): shorten it"),
        ("résumé", "name: expected a directory-safe name (ASCII letters, digits, '_', '-', '.'), got 'résumé'"),
    ],
    ids=["256-characters", "non-ascii"],
)
def test_sweep_names_that_cannot_be_a_directory_are_one_line(tmp_path, name, reason):
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({"name": name, "base": "quickstart", "grid": {"seed": [0]}}, allow_unicode=True))
    res = runner.invoke(app, ["sweep", str(f), "--results-dir", str(tmp_path / "results")])
    one_line_exit_2(res, f"error: {f}: {reason}")
    assert not (tmp_path / "results").exists()


@pytest.fixture
def read_only(tmp_path):
    """read_only(path): `path` becomes a read-only bind mount of itself (undone after the test)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only bind mount needs root (root writes any directory its mode forbids)")
    mounted = []

    def make(path: Path) -> None:
        for args in (["--bind", str(path), str(path)], ["-o", "remount,bind,ro", str(path)]):
            res = subprocess.run(["mount", *args], capture_output=True, text=True)
            if res.returncode:
                pytest.skip(f"cannot bind-mount here: {res.stderr.strip()}")
        mounted.append(path)

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("where", [".locks", "run"])
def test_a_read_only_directory_inside_the_store_is_one_line(store, read_only, where):
    sweep_dir = store / "fixture_v1"
    d = sweep_dir / ".locks" if where == ".locks" else next(p for p in sweep_dir.iterdir() if p.is_dir())
    d.mkdir(exist_ok=True)
    read_only(d)
    before = snapshot(store)
    res = runner.invoke(app, ["sweep", str(SWEEP), "--results-dir", str(store)])
    one_line_exit_2(res, f"error: {d}: not writable by this user (a read-only directory inside the results store)")
    assert snapshot(store) == before


def test_dry_run_of_a_read_only_store_shows_the_plan(store, read_only):
    read_only(store)
    res = runner.invoke(app, ["sweep", str(SWEEP), "--results-dir", str(store), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "2 runs from 2 grid points" in res.stdout


TINY = {
    "train.steps": 2,
    "train.prompts_per_step": 2,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "eval.benchmarks": [],
    "tracking.mlflow": False,
}


def tiny_sweep(tmp_path: Path) -> Path:
    f = tmp_path / "lim.yaml"
    f.write_text(
        yaml.safe_dump(
            {"name": "lim", "base": str(REPO / "recipes" / "arith_tiny.yaml"), "overrides": TINY, "grid": {"seed": [0]}}
        )
    )
    return f


def sweep_proc(f: Path, res: Path, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clipbench.cli", "sweep", str(f), "--results-dir", str(res)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        preexec_fn=preexec,
    )


@pytest.mark.slow
def test_a_file_size_limit_is_handled_as_a_full_disk(tmp_path):
    """`ulimit -f` of 4 MiB: the tiny model's checkpoint shard (5.6 MB) cannot be written (torch's
    writer loses the EFBIG: the shard at the limit says it)."""
    f, res = tiny_sweep(tmp_path), tmp_path / "results"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))

    p = sweep_proc(f, res, limit)
    assert p.returncode == 1, p.stderr[-3000:]
    (rid,) = read_manifest(manifest_path(res, "lim"))["runs"]
    rd = RunDir(res / "lim" / rid)
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: file too large for this process's file-size limit (`ulimit -f`) writing {rd.path}/checkpoints/"
        ".tmp-2; temporary files removed, finished work untouched: raise the limit and rerun the same command to "
        "resume"
    )
    assert "Traceback" not in p.stderr
    st = rd.status()
    assert st["state"] == "failed" and st["reason"] == "disk-full"
    assert not list(rd.path.rglob(".tmp-*"))
    again = sweep_proc(f, res)
    assert again.returncode == 0, again.stderr[-3000:]
    assert rd.status()["state"] == "finished" and len(rd.read_metrics()) == 4


def test_a_memory_error_in_a_run_is_one_line_and_the_same_command_resumes_it(tmp_path, monkeypatch):
    """A real MemoryError (an allocation no machine has) inside the run's training."""
    import clipbench.engines.launch as launch
    from clipbench.config import load_run_config
    from clipbench.errors import RunFailed
    from clipbench.sweep.execute import Next, classify

    cfg = load_run_config(str(REPO / "recipes" / "arith_tiny.yaml"), [f"{k}={json.dumps(v)}" for k, v in TINY.items()])

    def train_run(*a, **kw):
        return bytearray(1 << 60)  # MemoryError

    monkeypatch.setattr(launch, "train_run", train_run)
    rd = RunDir(tmp_path / "run")
    rd.start_attempt()
    with pytest.raises(RunFailed) as e:
        launch.run_as_rank(cfg, rd, resume=False)
    assert len(str(e.value).splitlines()) == 1
    assert str(e.value).startswith("out of memory (MemoryError: ): this process's memory limit (`ulimit -v`")
    st = rd.status()
    assert st["state"] == "failed" and st["reason"] == "out-of-memory" and "traceback" not in st
    assert classify(rd) is Next.START  # not skipped like a failed run: the same command retries it


def test_stale_temp_files_of_atomic_writes_are_removed_when_the_run_starts_again(tmp_path):
    from clipbench.train.distributed import Dist
    from clipbench.train.loop import prepare_run_dir

    rd = RunDir(tmp_path / "run")
    rd.set_status("preempted", step=0)
    stale = [rd.path / ".status.json.1a2b3c4d.tmp", rd.path / "eval" / "step_000000" / ".arith.json.5e6f7a8b.tmp"]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{")
    (rd.path / "checkpoints" / ".tmp-4").mkdir(parents=True)
    from clipbench.config import load_run_config

    prepare_run_dir(rd, Dist(), True, load_run_config(REPO / "recipes" / "arith_tiny.yaml"))
    assert not any(p.exists() for p in stale) and not (rd.path / "checkpoints" / ".tmp-4").exists()
    assert rd.status()["state"] == "preempted"  # the whole files stay
