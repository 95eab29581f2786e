"""MLflow as clipbench talks to it: the tracking URI, the client, experiments, runs found by tags,
what a run already holds, and sending points, params and artifacts in MLflow's batch limits.

Only `MlflowClient` with explicit run ids (no active-run globals): works in worker processes.
Short HTTP timeouts and retries (MLFLOW_HTTP_REQUEST_* defaults below, unless set) keep a dead
server from stalling a run. Used by the live sink (mlflow_sink.py) and by `clipbench sync` (sync.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from clipbench.errors import StoreError
from clipbench.tracking.files import atomic_write_json, read_json
from clipbench.tracking.lock import store_creation_lock
from clipbench.tracking.mirror import ROLE_TAG, default_tracking_uri, expected_artifacts
from clipbench.tracking.store import RunDir

log = logging.getLogger("clipbench.tracking")

# A dead tracking server must cost seconds, not the minutes of MLflow's defaults (7 retries, 120 s).
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # no "View run at ..." lines on our stdout
}
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MLFLOW_JSON = "mlflow.json"
ARTIFACTS = "mlartifacts"  # the embedded store's artifact root, beside its mlflow.db


def _apply_http_defaults() -> None:
    for k, v in HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)


# ---------------------------------------------------------------------------------------------
# URIs, names, values


def resolve_tracking_uri(tracking_uri: str | None, config_uri: str | None, results_dir: str | Path) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else tracking.tracking_uri, else the embedded sqlite."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or config_uri or default_tracking_uri(results_dir)


def artifact_location(uri: str, results_dir: str | Path) -> str | None:
    """`<results>/mlartifacts` for the embedded store; the server's own choice otherwise."""
    if uri == default_tracking_uri(results_dir):
        return str(Path(results_dir).resolve() / ARTIFACTS)
    return None


# ---------------------------------------------------------------------------------------------
# Client-side lookups (raise on trouble; callers decide)


SQLITE_HEADER = b"SQLite format 3\x00"


def damaged_database(uri: str) -> str | None:
    """Why the embedded MLflow store (`sqlite:///PATH`) is damaged, or None (not sqlite, missing,
    empty: MLflow creates it, or whole as far as SQLite's quick_check sees)."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///") :])
    try:
        if not db.is_file() or db.stat().st_size == 0:
            return None
        with open(db, "rb") as f:
            if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                return "not an SQLite database"
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("PRAGMA quick_check").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        return f"SQLite: {e}"
    except OSError:
        return None  # unreadable is not damaged: the caller's own error says why
    if rows != [("ok",)]:
        return f"SQLite's quick_check: {rows[0][0]}"
    return None


def damaged_database_line(uri: str, results_dir: str | Path, error: BaseException | None = None) -> str | None:
    """The one line that says the embedded MLflow store is damaged and how to rebuild it, or None.
    `error`: what opening it raised; a whole SQLite file that MLflow cannot open (a schema an older
    clipbench left half-migrated: "out-of-date database schema", "table ... already exists") is
    damaged too. A busy database ("locked") or an error of the file system is not."""
    why = damaged_database(uri)
    if why is None and error is not None and _unopenable(uri, error):
        why = f"MLflow cannot open it: {type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}"
    if why is None:
        return None
    db = uri[len("sqlite:///") :]
    return (
        f"the MLflow database {db} is damaged ({why}); the results store is the source of truth: move the "
        f"database away (mv {db} {db}.damaged) and rebuild it with `clipbench sync --results-dir {results_dir}`"
    )


def _unopenable(uri: str, error: BaseException) -> bool:
    if not uri.startswith("sqlite:///") or isinstance(error, OSError) or "locked" in str(error):
        return False
    db = Path(uri[len("sqlite:///") :])
    return db.is_file() and db.stat().st_size > 0


def client_for(uri: str):
    _apply_http_defaults()
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 - mlflow is heavy

    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    # Quiet "Creating initial tables..." (INFO) and the SQL store's logging of each database error with
    # its traceback before raising it (ERROR): our callers report a failure in one line (the sink goes
    # offline, `clipbench sync` exits 2), e.g. "database or disk is full".
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    with store_creation_lock(db):  # the client opens the store (creating its schema) here, one process at a time
        if not db.is_file() or db.stat().st_size == 0:
            create_database(db)
        if uri == default_tracking_uri(db.parent):
            relocate_artifacts(db)
        return MlflowClient(tracking_uri=uri)


def create_database(db: Path) -> None:
    """A new MLflow sqlite store at `db`, whole or not at all: its schema is created (MLflow's
    migrations, a few seconds) in a temporary file beside it, which is then renamed into place, so a
    kill meanwhile leaves no `db` (the next opener creates it again), never a half-migrated one that
    MLflow cannot open ("out-of-date database schema", "table ... already exists"). Temporary files
    such a kill left are removed first. The caller holds `store_creation_lock(db)`."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore  # noqa: PLC0415 - mlflow is heavy

    for stale in db.parent.glob(f".{db.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    tmp = db.parent / f".{db.name}.{secrets.token_hex(4)}.tmp"
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}", str(db.parent / ARTIFACTS))
        store.engine.dispose()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, db)
    finally:
        tmp.unlink(missing_ok=True)


def relocate_artifacts(db: Path) -> int:
    """Point the embedded store's artifact locations at its own `mlartifacts`: a results store copied
    or moved to another directory keeps an mlflow.db whose experiments and runs name the old store's
    absolute paths (MLflow records them so), and MLflow would go on writing there. Every location in
    another directory's `mlartifacts` is moved to the same place in this store's (experiments and runs,
    one transaction); returns how many rows changed. A database without MLflow's tables yet, or
    damaged, is left to MLflow and `damaged_database`."""
    if not db.is_file() or db.stat().st_size == 0:
        return 0
    here = str(db.parent.resolve() / ARTIFACTS)
    con = sqlite3.connect(db, timeout=30)
    try:
        with con:
            n = 0
            for table, key, col in (
                ("experiments", "experiment_id", "artifact_location"),
                ("runs", "run_uuid", "artifact_uri"),
            ):
                for k, loc in con.execute(f"SELECT {key}, {col} FROM {table}").fetchall():
                    moved = _moved(loc, here)
                    if moved is not None:
                        n += con.execute(f"UPDATE {table} SET {col} = ? WHERE {key} = ?", (moved, k)).rowcount
            return n
    except sqlite3.DatabaseError:
        return 0
    finally:
        con.close()


def _moved(loc, here: str) -> str | None:
    """`loc` in this store's artifact root `here` when it lies in another directory's `mlartifacts`."""
    if not isinstance(loc, str):
        return None
    head, sep, tail = loc.partition("/" + ARTIFACTS)
    if not sep or (tail and not tail.startswith("/")) or head.removeprefix("file://") + sep == here:
        return None
    return here + tail


# MLflow 3's UI opens an experiment by its kind: a training tool's experiment is model development
# ("Machine learning": its runs), not GenAI (traces); without the tag MLflow 3.x opens the GenAI view.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"


def get_or_create_experiment(client, name: str, location: str | None) -> str:
    """The experiment's id (created, or restored when deleted), tagged as model development unless
    its kind is already set (a user's choice is kept)."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 - mlflow is heavy

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=location, tags={KIND_TAG: KIND})
        except MlflowException:  # created meanwhile by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if KIND_TAG not in (exp.tags or {}):  # an experiment created before clipbench tagged it
        client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
    return exp.experiment_id


def _q(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace("'", "\\'")


def find_runs(client, experiment_id: str, *, sweep: str, role: str, run_id: str | None = None) -> list:
    """Active MLflow runs tagged with this sweep (and run id), oldest first."""
    filt = f"tags.sweep = '{_q(sweep)}' AND tags.`{ROLE_TAG}` = '{role}'"
    if run_id is not None:
        filt += f" AND tags.run_id = '{_q(run_id)}'"
    return list(
        client.search_runs(
            [experiment_id], filter_string=filt, max_results=1000, order_by=["attributes.start_time ASC"]
        )
    )


def metric_steps(client, mlflow_run_id: str, keys: Iterable[str]) -> dict[str, dict[int, int]]:
    """{metric: {step: number of points at that step}} from the run's full histories."""
    out: dict[str, dict[int, int]] = {}
    for key in keys:
        counts: dict[int, int] = {}
        for m in client.get_metric_history(mlflow_run_id, key):
            counts[m.step] = counts.get(m.step, 0) + 1
        out[key] = counts
    return out


def _mlflow_json(rd: RunDir) -> dict:
    """`<run_dir>/mlflow.json`; a damaged one counts as empty (it only caches ids found again by tags)."""
    try:
        return read_json(rd.path / MLFLOW_JSON, {}, kind="mlflow") or {}
    except StoreError:
        log.warning("%s is damaged; it is rewritten (MLflow runs are found again by their tags)", rd.path / MLFLOW_JSON)
        return {}


def record_mlflow_run(rd: RunDir, uri: str, **info: Any) -> None:
    """Remember the child run for this tracking URI in `<run_dir>/mlflow.json`."""
    data = _mlflow_json(rd)
    data[uri] = {**data.get(uri, {}), **info}
    atomic_write_json(rd.path / MLFLOW_JSON, data)


def recorded_mlflow_run(rd: RunDir, uri: str) -> dict:
    return _mlflow_json(rd).get(uri, {})


# ---------------------------------------------------------------------------------------------
# Sending what a run lacks, in MLflow's batch limits


def artifact_sizes(client, mlflow_run_id: str, path: str | None = None) -> dict[str, int]:
    """{artifact path: size} of a run, recursively."""
    out: dict[str, int] = {}
    for fi in client.list_artifacts(mlflow_run_id, path):
        if fi.is_dir:
            out.update(artifact_sizes(client, mlflow_run_id, fi.path))
        else:
            out[fi.path] = fi.file_size or 0
    return out


def send_points(client, mlflow_run_id: str, points: list) -> int:
    """log_batch in chunks of MLflow's limit; returns the number sent."""
    for i in range(0, len(points), MAX_METRICS_PER_BATCH):
        client.log_batch(mlflow_run_id, metrics=points[i : i + MAX_METRICS_PER_BATCH], synchronous=True)
    return len(points)


def send_params(client, mlflow_run_id: str, params: Mapping[str, str]) -> int:
    from mlflow.entities import Param  # noqa: PLC0415 - mlflow is heavy

    todo = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(todo), MAX_PARAMS_PER_BATCH):
        client.log_batch(mlflow_run_id, params=todo[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)
    return len(todo)


def send_missing_artifacts(client, mlflow_run_id: str, rd: RunDir, have: Mapping[str, int] | None = None) -> int:
    """Upload the run's files MLflow lacks (or holds with another size); returns how many."""
    have = artifact_sizes(client, mlflow_run_id) if have is None else have
    n = 0
    for f, where in expected_artifacts(rd):
        if have.get(f"{where}/{f.name}" if where else f.name) != f.stat().st_size:
            client.log_artifact(mlflow_run_id, str(f), where)
            n += 1
    return n
