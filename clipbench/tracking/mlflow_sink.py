"""MLflow mirror of the results store: one parent run per sweep, one nested child run per run.

    sink = run_sink(cfg, RunDir(path), results_dir="results", sweep="nsr_vs_decay",
                    parent_run_id=parent, run_name="nsr p=0.5 seed=0")
    sink.log_params(...); sink.log_metrics(opt_step, {...}); sink.log_artifact(path, "eval/step_000040")
    sink.close("FINISHED")

- Tracking URI: `--tracking-uri`, else MLFLOW_TRACKING_URI, else `tracking.tracking_uri`, else an
  embedded sqlite store `sqlite:///<results>/mlflow.db` with artifacts in `<results>/mlartifacts`.
- Only `MlflowClient` with explicit run ids (no active-run globals): works in worker processes.
- Metrics are buffered and sent with `log_batch` every `tracking.batch_every` optimizer steps and at
  close; names are sanitised to MLflow's charset (`pass@8` -> `pass_at_8`, `/` kept).
- Never raises into training: the first failure logs one warning and the sink goes offline (the
  results store keeps everything; `clipbench sync` replays it later). Short HTTP timeouts/retries
  (MLFLOW_HTTP_REQUEST_* defaults below, unless set) keep a dead server from stalling a run.
- The child's MLflow run id is stored in `<run_dir>/mlflow.json` ({tracking uri: {...}}).
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from clipbench.errors import StoreError
from clipbench.tracking.store import RunDir, atomic_write_json, read_json

log = logging.getLogger("clipbench.tracking")

# A dead tracking server must cost seconds, not the minutes of MLflow's defaults (7 retries, 120 s).
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # no "View run at ..." lines on our stdout
}
MAX_PARAM_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MLFLOW_JSON = "mlflow.json"
ROLE_TAG = "clipbench.role"


def _apply_http_defaults() -> None:
    for k, v in HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)


# ---------------------------------------------------------------------------------------------
# URIs, names, values


def default_tracking_uri(results_dir: str | Path) -> str:
    return f"sqlite:///{Path(results_dir).resolve() / 'mlflow.db'}"


def resolve_tracking_uri(tracking_uri: str | None, config_uri: str | None, results_dir: str | Path) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else tracking.tracking_uri, else the embedded sqlite."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or config_uri or default_tracking_uri(results_dir)


def artifact_location(uri: str, results_dir: str | Path) -> str | None:
    """`<results>/mlartifacts` for the embedded store; the server's own choice otherwise."""
    if uri == default_tracking_uri(results_dir):
        return str(Path(results_dir).resolve() / "mlartifacts")
    return None


_BAD = re.compile(r"[^\w.\- :/]")


def metric_name(key: str) -> str:
    """MLflow's allowed charset (alphanumerics _ - . space : /): '@' -> '_at_', others -> '_'."""
    name = _BAD.sub("_", str(key).replace("@", "_at_"))
    norm = posixpath.normpath(name) if name else name
    if not name or norm != name or norm == "." or norm.startswith(".."):
        name = name.strip("/").replace("//", "/") or "_"
        if posixpath.normpath(name) != name or name.startswith(".."):
            name = name.replace("/", "_").replace("..", "__")
    return name


def param_value(v: Any) -> str:
    s = str(v)
    return s if len(s) <= MAX_PARAM_LEN else s[: MAX_PARAM_LEN - 3] + "..."


def metric_value(v: Any) -> float | None:
    """A number for MLflow, or None to skip. None (how the store writes NaN) becomes NaN."""
    if v is None:
        return float("nan")
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if hasattr(v, "item"):
        try:
            return float(v.item())
        except (TypeError, ValueError):
            return None
    return None


def run_params(config: Mapping, backend: str | None = None) -> dict[str, Any]:
    """What a run logs as params: the flattened resolved config, the effective clip bounds and rule
    semantics (`rule.*`), the run id and the resolved sampler backend. (The trainer logs the same.)"""
    from clipbench.config import flatten, run_id
    from clipbench.objectives import effective_bounds

    params = flatten(dict(config))
    obj = dict(config.get("objective", {}))
    method = obj.pop("method", None)
    if method is not None:
        try:
            params.update({f"rule.{k}": v for k, v in effective_bounds(method, obj).items()})
        except ValueError:
            pass
    params["run_id"] = run_id(dict(config))
    if backend:
        params["sampler.resolved_backend"] = backend
    return params


def run_tags(config: Mapping, *, sweep: str, run_id: str) -> dict[str, str]:
    return {"sweep": sweep, "run_id": run_id, "method": str(config.get("objective", {}).get("method", "")),
            "seed": str(config.get("seed", "")), "model": str(config.get("model", {}).get("name", "")),
            ROLE_TAG: "run"}


# ---------------------------------------------------------------------------------------------
# Client-side lookups (raise on trouble; callers decide)


def client_for(uri: str):
    _apply_http_defaults()
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial tables..."
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def get_or_create_experiment(client, name: str, location: str | None) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created meanwhile by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def _q(s: str) -> str:
    return str(s).replace("\\", "\\\\").replace("'", "\\'")


def find_runs(client, experiment_id: str, *, sweep: str, role: str, run_id: str | None = None) -> list:
    """Active MLflow runs tagged with this sweep (and run id), oldest first."""
    filt = f"tags.sweep = '{_q(sweep)}' AND tags.`{ROLE_TAG}` = '{role}'"
    if run_id is not None:
        filt += f" AND tags.run_id = '{_q(run_id)}'"
    return list(client.search_runs([experiment_id], filter_string=filt, max_results=1000,
                                   order_by=["attributes.start_time ASC"]))


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
# The sink


class MlflowSink:
    """A `MetricSink` bound to one MLflow run. Every public method swallows errors (offline mode)."""

    def __init__(self, client, mlflow_run_id: str | None, *, uri: str, rd: RunDir | None = None,
                 batch_every: int = 10, logged_params: Mapping[str, str] | None = None,
                 logged_steps: Mapping[str, Iterable[int]] | None = None, offline_reason: str | None = None,
                 sync_hint: str = "clipbench sync"):
        self.client = client
        self.mlflow_run_id = mlflow_run_id
        self.uri = uri
        self.rd = rd
        self.batch_every = max(1, int(batch_every))
        self._params: dict[str, str] = dict(logged_params or {})
        self._logged: dict[str, set[int]] = {k: set(v) for k, v in (logged_steps or {}).items()}
        self._buf: list = []
        self._calls = 0
        self._closed = False
        self.sync_hint = sync_hint
        self.offline = offline_reason is not None or mlflow_run_id is None
        self.error = offline_reason
        self.n_metrics = 0  # points sent

    # offline handling
    def _fail(self, what: str, exc: BaseException) -> None:
        if not self.offline:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            log.warning("MLflow at %s failed during %s (%s); going offline. Training continues and the results "
                        "store keeps everything; replay it later with `%s`.", self.uri, what, msg, self.sync_hint)
            self.error = msg
        self.offline = True
        self._buf.clear()
        self._note(offline=True, error=self.error)

    def _note(self, **info: Any) -> None:
        if self.rd is None:
            return
        try:
            record_mlflow_run(self.rd, self.uri, **info)
        except OSError:
            pass

    # MetricSink
    def log_params(self, params: dict) -> None:
        if self.offline:
            return
        try:
            from mlflow.entities import Param

            todo = []
            for k, v in params.items():
                k, v = metric_name(k), param_value(v)
                old = self._params.get(k)
                if old is None:
                    todo.append(Param(k, v))
                    self._params[k] = v
                elif old != v:
                    log.debug("param %s already logged as %r; not changing it to %r", k, old, v)
            for i in range(0, len(todo), MAX_PARAMS_PER_BATCH):
                self.client.log_batch(self.mlflow_run_id, params=todo[i:i + MAX_PARAMS_PER_BATCH], synchronous=True)
        except Exception as e:  # noqa: BLE001 - never into training
            self._fail("log_params", e)

    def log_metrics(self, step: int, metrics: dict) -> None:
        if self.offline:
            return
        try:
            from mlflow.entities import Metric

            ts = int(time.time() * 1000)
            step = int(step)
            for k, v in metrics.items():
                val = metric_value(v)
                if val is None:
                    continue
                name = metric_name(k)
                seen = self._logged.setdefault(name, set())
                if step in seen:
                    continue  # already in MLflow (a resumed run replays steps after its checkpoint)
                seen.add(step)
                self._buf.append(Metric(name, val, ts, step))
            self._calls += 1
            if self._calls >= self.batch_every:
                self.flush()
        except Exception as e:  # noqa: BLE001
            self._fail("log_metrics", e)

    def flush(self) -> None:
        self._calls = 0
        if self.offline or not self._buf:
            return
        try:
            buf, self._buf = self._buf, []
            for i in range(0, len(buf), MAX_METRICS_PER_BATCH):
                self.client.log_batch(self.mlflow_run_id, metrics=buf[i:i + MAX_METRICS_PER_BATCH], synchronous=True)
                self.n_metrics += len(buf[i:i + MAX_METRICS_PER_BATCH])
        except Exception as e:  # noqa: BLE001
            self._fail("log_batch", e)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        if self.offline or not Path(path).is_file():
            return
        try:
            self.client.log_artifact(self.mlflow_run_id, str(path), artifact_path)
        except Exception as e:  # noqa: BLE001
            self._fail("log_artifact", e)

    def close(self, status: str = "FINISHED") -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self.offline:
            self._note(offline=True, error=self.error)
            return
        try:
            self.client.set_terminated(self.mlflow_run_id, status)
            self._note(offline=False, error=None, status=status)
        except Exception as e:  # noqa: BLE001
            self._fail("set_terminated", e)


def offline_sink(uri: str, rd: RunDir | None, reason: str, sync_hint: str = "clipbench sync") -> MlflowSink:
    s = MlflowSink(None, None, uri=uri, rd=rd, offline_reason=reason, sync_hint=sync_hint)
    s._note(offline=True, error=reason)
    return s


def run_sink(cfg, rd: RunDir, *, results_dir: str | Path, sweep: str, tracking_uri: str | None = None,
             parent_run_id: str | None = None, run_name: str | None = None, resume: bool | None = None):
    """The sink for one run: find its MLflow child run (tag run_id) or create it. Never raises.

    `resume=False` (a fresh start) replaces a child left by an earlier attempt (deleted, recreated),
    since the store restarts that run from scratch; otherwise the child is reused and steps already
    in MLflow are not sent again."""
    from clipbench.config import RunConfig, to_dict

    config = to_dict(cfg) if isinstance(cfg, RunConfig) else dict(cfg)
    tracking = config.get("tracking", {})
    uri = resolve_tracking_uri(tracking_uri, tracking.get("tracking_uri"), results_dir)
    hint = f"clipbench sync {sweep} --results-dir {results_dir}"
    try:
        client = client_for(uri)
        exp_id = get_or_create_experiment(client, tracking.get("experiment", "clipbench"),
                                          artifact_location(uri, results_dir))
        rid = rd.run_id
        found = find_runs(client, exp_id, sweep=sweep, role="run", run_id=rid)
        run = found[0] if found else None
        for extra in found[1:]:  # an earlier crash between create and record: keep one
            client.delete_run(extra.info.run_id)
        if run is not None and resume is False:
            client.delete_run(run.info.run_id)
            run = None
        params: dict[str, str] = {}
        steps: dict[str, dict[int, int]] = {}
        if run is None:
            tags = run_tags(config, sweep=sweep, run_id=rid)
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id
            name = run_name or f"{tags['method']} seed={tags['seed']} {rid}"
            run = client.create_run(exp_id, tags=tags, run_name=name)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            params = dict(run.data.params)
            steps = metric_steps(client, run.info.run_id, run.data.metrics.keys())
        mid = run.info.run_id
        record_mlflow_run(rd, uri, experiment_id=exp_id, run_id=mid, parent_run_id=parent_run_id,
                          offline=False, error=None)
        return MlflowSink(client, mid, uri=uri, rd=rd, batch_every=tracking.get("batch_every", 10),
                          logged_params=params, logged_steps=steps, sync_hint=hint)
    except Exception as e:  # noqa: BLE001 - tracking trouble never stops training
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        log.warning("MLflow at %s is unavailable (%s); training continues offline. The results store keeps "
                    "everything; replay it later with `%s`.", uri, msg, hint)
        return offline_sink(uri, rd, msg, hint)


# ---------------------------------------------------------------------------------------------
# The sweep's parent run


def sweep_parent_run(*, results_dir: str | Path, sweep: str, experiment: str, tracking_uri: str | None,
                     config_uri: str | None = None, manifest_path: str | Path | None = None,
                     client=None) -> str | None:
    """Find or create the parent run of a sweep (tags sweep, clipbench.role=sweep), mark it RUNNING and
    attach the manifest. Returns its id, or None (one warning) when MLflow is unreachable."""
    uri = resolve_tracking_uri(tracking_uri, config_uri, results_dir)
    try:
        client = client or client_for(uri)
        exp_id = get_or_create_experiment(client, experiment, artifact_location(uri, results_dir))
        found = find_runs(client, exp_id, sweep=sweep, role="sweep")
        if found:
            pid = found[0].info.run_id
            client.update_run(pid, status="RUNNING")
        else:
            pid = client.create_run(exp_id, tags={"sweep": sweep, ROLE_TAG: "sweep"}, run_name=sweep).info.run_id
        if manifest_path is not None and Path(manifest_path).is_file():
            client.log_artifact(pid, str(manifest_path))
        return pid
    except Exception as e:  # noqa: BLE001
        log.warning("MLflow at %s is unavailable (%s: %s); the sweep runs offline. Replay it later with "
                    "`clipbench sync %s --results-dir %s`.", uri, type(e).__name__,
                    (str(e).splitlines() or [""])[0][:200], sweep, results_dir)
        return None


def finish_parent_run(parent_run_id: str | None, status: str, *, uri: str) -> None:
    if not parent_run_id:
        return
    try:
        client_for(uri).set_terminated(parent_run_id, status)
    except Exception as e:  # noqa: BLE001
        log.debug("could not terminate the parent run: %s", e)
