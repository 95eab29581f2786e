"""The embedded MLflow sqlite store, damaged, moved or killed while made: `clipbench sync` says a
damaged database is damaged and how to rebuild it (before: "cannot reach MLflow", forever), and
following that advice rebuilds it from the results store (the source of truth); a store moved to
another directory keeps its artifacts in itself; a kill while the first sync creates the database
leaves none."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three real syncs into a real MLflow sqlite store

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "store_format1"


def sync(results: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clipbench.cli", "sync", "fixture_v1", "--results-dir", str(results)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def n_runs(db: Path) -> int:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    finally:
        con.close()


def test_a_damaged_mlflow_database_is_named_and_rebuilt_by_sync(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(FIXTURE / "fixture_v1", results / "fixture_v1")
    assert sync(results).returncode == 0
    db = results / "mlflow.db"
    assert n_runs(db) == 3  # the sweep's parent run and its 2 runs
    with open(db, "r+b") as f:  # the schema page overwritten (what a torn write or a bad disk leaves)
        f.seek(100)
        f.write(b"\xde\xad\xbe\xef" * 900)
    p = sync(results)
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        f"error: the MLflow database {db} is damaged (SQLite: database disk image is malformed); the results "
        f"store is the source of truth: move the database away (mv {db} {db}.damaged) and rebuild it with "
        f"`clipbench sync --results-dir {results}`"
    ]
    shutil.move(db, f"{db}.damaged")  # the advice, followed
    again = sync(results)
    assert again.returncode == 0, again.stderr[-2000:]
    assert n_runs(db) == 3


def artifact_locations(db: Path) -> set[str]:
    con = sqlite3.connect(db)
    try:
        exps = {loc for (loc,) in con.execute("SELECT artifact_location FROM experiments WHERE experiment_id > 0")}
        runs = {
            uri.split("/mlartifacts/")[0] + "/mlartifacts" for (uri,) in con.execute("SELECT artifact_uri FROM runs")
        }
        return exps | runs
    finally:
        con.close()


def test_a_moved_store_keeps_its_artifacts_in_itself(tmp_path):
    """A results store moved to another directory: its mlflow.db named the old store's mlartifacts
    (MLflow records absolute paths), so `clipbench sync` listed nothing there, sent every artifact
    again and wrote them into the old path (made again; read-only there: a 162-line traceback). Its
    artifacts belong to the store they are in."""
    old, new = tmp_path / "old" / "results", tmp_path / "new" / "results"
    shutil.copytree(FIXTURE / "fixture_v1", old / "fixture_v1")
    assert sync(old).returncode == 0
    assert artifact_locations(old / "mlflow.db") == {str(old / "mlartifacts")}
    shutil.move(old.parent, new.parent)  # the whole store, mlflow.db and mlartifacts with it
    p = sync(new)
    assert p.returncode == 0, p.stderr[-2000:]
    assert artifact_locations(new / "mlflow.db") == {str(new / "mlartifacts")}
    assert not old.parent.exists()  # nothing written to where the store was
    assert n_runs(new / "mlflow.db") == 3


def test_a_kill_while_the_first_sync_creates_the_database_leaves_none(tmp_path):
    """kill -9 of the first `clipbench sync` while MLflow created its tables left mlflow.db half
    migrated for good ("out-of-date database schema", "table webhooks already exists"). The database
    is now created beside its place and renamed in whole: the kill leaves none, and the next sync makes it."""
    results = tmp_path / "results"
    shutil.copytree(FIXTURE / "fixture_v1", results / "fixture_v1")
    p = subprocess.Popen(
        [sys.executable, "-m", "clipbench.cli", "sync", "fixture_v1", "--results-dir", str(results)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    t0 = time.time()
    while not list(results.glob(".mlflow.db.*.tmp")):  # MLflow is creating its tables
        assert p.poll() is None and time.time() - t0 < 300, "the sync ended before it created its database"
        time.sleep(0.01)
    p.kill()
    p.wait()
    assert not (results / "mlflow.db").exists()
    again = sync(results)
    assert again.returncode == 0, again.stderr[-2000:]
    assert n_runs(results / "mlflow.db") == 3 and not list(results.glob(".mlflow.db.*.tmp"))


def test_a_database_mlflow_cannot_open_is_named_with_the_way_out(tmp_path):
    """A whole SQLite file with part of MLflow's schema (what an older clipbench left when killed while
    creating it): sync said "cannot reach MLflow" and nothing said to move it away."""
    results = tmp_path / "results"
    shutil.copytree(FIXTURE / "fixture_v1", results / "fixture_v1")
    db = results / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE webhooks (webhook_id VARCHAR(256) PRIMARY KEY)")
    con.commit()
    con.close()
    p = sync(results)
    assert p.returncode == 2
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"error: the MLflow database {db} is damaged (MLflow cannot open it: ")
    assert line.endswith(
        f"move the database away (mv {db} {db}.damaged) and rebuild it with `clipbench sync --results-dir {results}`"
    )
