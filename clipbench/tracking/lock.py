"""Inter-process locks on the results store (``filelock``: fcntl/flock, released by the OS when a
process dies, so a ``kill -9`` never leaves a stale lock).

    <results>/<sweep>/.locks/manifest.lock   held while the manifest is read-modified-written
    <results>/<sweep>/.locks/<run_id>.lock   held by the process training (or syncing) that run

A process that cannot take a run's lock at once skips the run: another process owns it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_DIR = ".locks"


def _lock_path(sweep_dir: str | Path, name: str) -> Path:
    d = Path(sweep_dir) / LOCK_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}.lock"


def manifest_lock(sweep_dir: str | Path, timeout: float = 60.0) -> FileLock:
    """Blocking lock around manifest updates (held for milliseconds)."""
    return FileLock(_lock_path(sweep_dir, "manifest"), timeout=timeout)


@contextmanager
def try_run_lock(sweep_dir: str | Path, run_id: str) -> Iterator[bool]:
    """``with try_run_lock(d, rid) as got:`` -- got is False when another process holds the run."""
    lock = FileLock(_lock_path(sweep_dir, run_id), timeout=0)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def run_locked_elsewhere(sweep_dir: str | Path, run_id: str) -> bool:
    """True when some process holds the run's lock right now (a probe: takes and releases it)."""
    if not (Path(sweep_dir) / LOCK_DIR / f"{run_id}.lock").exists():
        return False
    with try_run_lock(sweep_dir, run_id) as got:
        return not got


def store_creation_lock(db: str | Path, timeout: float = 600.0) -> FileLock:
    """Blocking lock around opening the embedded MLflow sqlite store (`<db>.lock`): the first opener
    creates and migrates its schema, which two processes at once leave half-migrated (alembic's
    "Online migration expected to match one row", "table _alembic_tmp_* already exists")."""
    return FileLock(f"{db}.lock", timeout=timeout)
