"""A damaged MLflow sqlite store (issue 39, case 8): `clipbench sync` says the database is damaged and
how to rebuild it (before: "cannot reach MLflow", forever), and following that advice rebuilds it from
the results store (the source of truth)."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
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
