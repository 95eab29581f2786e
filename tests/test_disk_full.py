"""A full disk: one line naming the path, the run marked failed, its temporary files removed, exit 1,
no further run started, nothing finished touched; freeing space and rerunning the same command
resumes and ends where an uninterrupted sweep ends (clipbench/errors.py `no_space_left`,
`RunDir.fail_for_disk`, sweep/execute.py).

The end-to-end test fills a real filesystem: a tmpfs mounted for the test (root only; skipped with
the reason elsewhere), sized so that the first run of three fits and the second runs out of room while
it writes its second checkpoint (a run dir is 5.5 MB, a checkpoint swap needs two; MLflow's sqlite
store, 1.5 MB, is on the same disk). Then the tmpfs is grown (`remount,size=`) and the sweep rerun.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from clipbench.errors import DiskFull, no_space_left
from clipbench.tracking.store import RunDir, RunState

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# Finding "no space left" behind what the writers raise


def _raise_chain():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("unexpected pos 704 vs 598") from e
    except RuntimeError as e:
        return e


class FakeCheckpointException(BaseException):  # torch.distributed.checkpoint's shape: {rank: (exc, stack)}
    def __init__(self, failures):
        self.failures = failures


def test_no_space_left_is_found_behind_causes_contexts_and_a_checkpoints_ranks():
    assert no_space_left(OSError(errno.ENOSPC, "x")).errno == errno.ENOSPC
    assert no_space_left(OSError(errno.EDQUOT, "x")).errno == errno.EDQUOT
    assert no_space_left(_raise_chain()).errno == errno.ENOSPC  # through __cause__
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError:
            raise ValueError("while handling") from None  # __context__ kept, __cause__ suppressed
    except ValueError as e:
        assert no_space_left(e) is not None
    ranks = FakeCheckpointException({0: (OSError(errno.ENOSPC, "full"), ["a stack summary, not an exception"])})
    assert no_space_left(ranks) is not None
    assert no_space_left(sqlite3.OperationalError("database or disk is full")).errno == errno.ENOSPC
    assert no_space_left(OSError(errno.EACCES, "denied")) is None
    assert no_space_left(FakeCheckpointException({0: (RuntimeError("boom"), [])})) is None


def test_a_run_the_disk_stopped_is_marked_failed_its_temporaries_removed_and_rerun(tmp_path):
    from clipbench.sweep.execute import Next, classify

    rd = RunDir(tmp_path / "run")
    rd.start_attempt(pid=1)
    (rd.checkpoint_dir / ".tmp-3" / "dcp").mkdir(parents=True)
    (rd.checkpoint_dir / ".tmp-3" / "dcp" / "__0_0.distcp").write_bytes(b"half")
    (rd.path / ".status.json.abcd1234.tmp").write_text("{")
    (rd.path / "metrics.jsonl").write_text('{"step": 0}\n')
    err = rd.fail_for_disk(OSError(errno.ENOSPC, "No space left on device", str(rd.checkpoint_dir / ".tmp-3")))
    assert isinstance(err, DiskFull) and err.status_written
    assert str(err).startswith(f"no space left on device writing {rd.checkpoint_dir / '.tmp-3'};")
    assert not list(rd.path.rglob("*.tmp")) and not (rd.checkpoint_dir / ".tmp-3").exists()
    assert (rd.path / "metrics.jsonl").read_text() == '{"step": 0}\n'  # finished work untouched
    st = rd.status()
    assert st["state"] == RunState.FAILED.value and st["reason"] == "disk-full"
    assert classify(rd) is Next.START  # not skipped like a failed run: the same command retries it


# ---------------------------------------------------------------------------------------------
# A real filesystem that fills up


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (the filesystem that fills up is real)")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


SWEEP = """name: full
base: {recipe}
overrides:
  train.steps: 2
  train.checkpoint_every: 1
  eval.limit: 16
grid:
  seed: [0, 1, 2]
"""


def _sweep(spec: Path, results: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "clipbench", "sweep", str(spec), "--results-dir", str(results), "--jobs", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _metrics(results: Path) -> dict[str, list[dict]]:
    runs = {}
    for rd_path in sorted((results / "full").iterdir()):
        if rd_path.is_dir():
            rows = RunDir(rd_path).read_metrics()
            runs[rd_path.name] = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
    return runs


@pytest.mark.slow
def test_a_sweep_on_a_disk_that_fills_stops_in_one_line_and_resumes_to_the_uninterrupted_numbers(small_disk, tmp_path):
    spec = tmp_path / "full.yaml"
    spec.write_text(SWEEP.format(recipe=REPO / "recipes" / "arith_tiny.yaml"))
    ref = _sweep(spec, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-2000:]

    full = _sweep(spec, small_disk / "res")
    assert full.returncode == 1, full.stderr[-3000:]
    assert "Traceback" not in full.stderr + full.stdout
    errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: no space left on device writing {small_disk}")
    assert "1 stopped by a full disk" in full.stderr and "1 not started" in full.stderr
    assert not [p for p in small_disk.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    states = {p.parent.name: RunDir(p.parent).status() for p in (small_disk / "res" / "full").glob("*/status.json")}
    assert sorted(s["state"] for s in states.values()) == ["failed", "finished"]  # the third never started
    stopped = next(s for s in states.values() if s["state"] == "failed")
    assert stopped["reason"] == "disk-full" and stopped["error"].startswith("no space left on device writing")
    reference = _metrics(tmp_path / "ref")
    finished = next(k for k, s in states.items() if s["state"] == "finished")
    assert _metrics(small_disk / "res")[finished] == reference[finished]  # finished work untouched

    subprocess.run(["mount", "-o", "remount,size=40m", str(small_disk)], check=True)
    again = _sweep(spec, small_disk / "res")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "3/3 runs finished" in again.stderr
    assert _metrics(small_disk / "res") == reference  # the stopped run resumed from its last whole checkpoint
