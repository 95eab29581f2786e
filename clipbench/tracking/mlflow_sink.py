"""MLflow mirror of the results store: one parent run per sweep, one nested child run per run.

    sink = run_sink(cfg, RunDir(path), results_dir="results", sweep="nsr_vs_decay",
                    parent_run_id=parent, run_name="nsr p=0.5 seed=0")
    sink.log_params(...); sink.log_metrics(opt_step, {...}); sink.log_artifact(path, "eval/step_000040")
    sink.close("FINISHED")

- Tracking URI: `--tracking-uri`, else MLFLOW_TRACKING_URI, else `tracking.tracking_uri`, else an
  embedded sqlite store `sqlite:///<results>/mlflow.db` with artifacts in `<results>/mlartifacts`.
- Only `MlflowClient` with explicit run ids (no active-run globals): works in worker processes.
- What a call becomes in MLflow (step axis, bookkeeping as params, names) is decided by
  `clipbench.tracking.mirror`, the same functions `clipbench sync` uses. Metrics are buffered and
  sent with `log_batch` every `tracking.batch_every` calls and at close.
- A resumed run (a kill -9 loses the sink's buffer) sends at close whatever the store holds and
  MLflow lacks (metrics, params, artifacts), so a run that resumed with the server up is complete.
- Never raises into training: the first failure logs one warning with the exact `clipbench sync`
  command and the sink goes offline; `<run_dir>/mlflow.json` then says `needs_sync`. Short HTTP
  timeouts/retries (MLFLOW_HTTP_REQUEST_* defaults below, unless set) keep a dead server from
  stalling a run.
- The child's MLflow run id and name are stored in `<run_dir>/mlflow.json` ({tracking uri: {...}}).
- A sweep's parent run is found by tags or created by whoever reaches MLflow first (the sweep
  command, a run whose server came back mid-sweep, or `clipbench sync`), under the sweep's manifest
  lock, so there is one; it is closed by the sweep command or by `clipbench sync`.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from clipbench.config import RunConfig, to_dict
from clipbench.config.stored import setting
from clipbench.errors import StoreError
from clipbench.tracking.files import read_json
from clipbench.tracking.lock import manifest_lock
from clipbench.tracking.mirror import (
    ROLE_TAG,
    expected_metrics,
    expected_params,
    metric_name,
    mirror_points,
    opt_step_after,
    param_value,
    run_name_of,
    run_tags,
    sync_hint,
)
from clipbench.tracking.mlflow_client import (
    artifact_location,
    artifact_sizes,
    client_for,
    find_runs,
    get_or_create_experiment,
    metric_steps,
    record_mlflow_run,
    resolve_tracking_uri,
    send_missing_artifacts,
    send_params,
    send_points,
)
from clipbench.tracking.sink import NullSink
from clipbench.tracking.sinks import FanoutSink, extra_sinks
from clipbench.tracking.store import RunDir

log = logging.getLogger("clipbench.tracking")

# ---------------------------------------------------------------------------------------------
# The sink


class MlflowSink:
    """A `MetricSink` bound to one MLflow run. Every public method swallows errors (offline mode)."""

    def __init__(
        self,
        client,
        mlflow_run_id: str | None,
        *,
        uri: str,
        rd: RunDir | None = None,
        batch_every: int = 10,
        logged_params: Mapping[str, str] | None = None,
        logged_steps: Mapping[str, Iterable[int]] | None = None,
        offline_reason: str | None = None,
        sync_hint: str = "clipbench sync",
        config: Mapping | None = None,
        backfill: bool = False,
    ):
        self.client = client
        self.mlflow_run_id = mlflow_run_id
        self.uri = uri
        self.rd = rd
        self.config = dict(config or {})
        self.batch_every = max(1, int(batch_every))
        self._params: dict[str, str] = dict(logged_params or {})
        self._logged: dict[str, set[int]] = {k: set(v) for k, v in (logged_steps or {}).items()}
        self._opt_at: dict[int, int] = {}  # rollout step -> the largest opt_step logged for it
        self._buf: list = []
        self._calls = 0
        self._closed = False
        self.sync_hint = sync_hint
        self.backfill = backfill  # a resumed run: send at close what the store has and MLflow lacks
        self.offline = offline_reason is not None or mlflow_run_id is None
        self.error = offline_reason
        self.n_metrics = 0  # points sent

    # offline handling
    def _fail(self, what: str, exc: BaseException) -> None:
        if not self.offline:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            log.warning(
                "MLflow at %s failed during %s (%s); going offline. Training continues and the results "
                "store keeps everything; replay it later with `%s`.",
                self.uri,
                what,
                msg,
                self.sync_hint,
            )
            self.error = msg
        self.offline = True
        self._buf.clear()
        self._note(offline=True, needs_sync=True, error=self.error)

    def _note(self, **info: Any) -> None:
        if self.rd is None:
            return
        try:
            record_mlflow_run(self.rd, self.uri, **info)
        except OSError:
            pass

    def _opt_step_after(self, k: int) -> int:
        """`mirror.opt_step_after` on the rows this sink logged; the store's rows when it has not seen them."""
        if k <= 0:
            return 0
        if k - 1 in self._opt_at:
            return self._opt_at[k - 1]
        return opt_step_after(self.rd.read_metrics(), k) if self.rd is not None else 0

    # MetricSink
    def log_params(self, params: dict) -> None:
        if self.offline:
            return
        try:
            todo = {}
            for k, v in params.items():
                k, v = metric_name(k), param_value(v)
                old = self._params.get(k)
                if old is None:
                    todo[k] = v
                    self._params[k] = v
                elif old != v:
                    log.debug("param %s already logged as %r; not changing it to %r", k, old, v)
            send_params(self.client, self.mlflow_run_id, todo)
        except Exception as e:  # noqa: BLE001 - never into training
            self._fail("log_params", e)

    def log_metrics(self, step: int, metrics: dict) -> None:
        """A training row (`opt_step` is its MLflow step) or evaluation metrics (`eval/...` keys; `step` is
        the rollout step of the store): see `clipbench.tracking.mirror` for what MLflow gets."""
        if self.offline:
            return
        try:
            from mlflow.entities import Metric  # noqa: PLC0415 - mlflow is heavy

            if isinstance(metrics.get("opt_step"), (int, float)) and isinstance(metrics.get("step"), (int, float)):
                k = int(metrics["step"])
                self._opt_at[k] = max(self._opt_at.get(k, 0), int(metrics["opt_step"]))
            points, params = mirror_points(step, metrics, self._opt_step_after)
            if params:
                self.log_params(params)
            ts = int(time.time() * 1000)
            for name, at, val in points:
                seen = self._logged.setdefault(name, set())
                if at in seen:
                    continue  # already in MLflow (a resumed run replays steps after its checkpoint)
                seen.add(at)
                self._buf.append(Metric(name, val, ts, at))
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
            self.n_metrics += send_points(self.client, self.mlflow_run_id, buf)
        except Exception as e:  # noqa: BLE001
            self._fail("log_batch", e)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        if self.offline or not Path(path).is_file():
            return
        try:
            self.client.log_artifact(self.mlflow_run_id, str(path), artifact_path)
        except Exception as e:  # noqa: BLE001
            self._fail("log_artifact", e)

    def _send_missing(self) -> None:
        """What the store holds and MLflow lacks (lost with a killed process's buffer): metrics, params, artifacts."""
        from mlflow.entities import Metric  # noqa: PLC0415 - mlflow is heavy

        ts = int(time.time() * 1000)
        todo = [
            Metric(name, val, ts, step)
            for name, steps in expected_metrics(self.rd).items()
            for step, val in steps.items()
            if step not in self._logged.get(name, ())
        ]
        for m in todo:
            self._logged.setdefault(m.key, set()).add(m.step)
        self.n_metrics += send_points(self.client, self.mlflow_run_id, todo)
        if self.config:
            want = expected_params(self.rd, self.config, self.rd.status())
            send_params(self.client, self.mlflow_run_id, {k: v for k, v in want.items() if k not in self._params})
        send_missing_artifacts(self.client, self.mlflow_run_id, self.rd)

    def close(self, status: str = "FINISHED") -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self.backfill and not self.offline and self.rd is not None:
            try:
                self._send_missing()
            except Exception as e:  # noqa: BLE001
                self._fail("sending what the store has and MLflow lacks", e)
        if self.offline:
            self._note(offline=True, needs_sync=True, error=self.error)
            return
        try:
            self.client.set_terminated(self.mlflow_run_id, status)
            self._note(offline=False, needs_sync=False, error=None, status=status)
        except Exception as e:  # noqa: BLE001
            self._fail("set_terminated", e)


def offline_sink(
    uri: str, rd: RunDir | None, reason: str, sync_hint: str = "clipbench sync", run_name: str | None = None
) -> MlflowSink:
    s = MlflowSink(None, None, uri=uri, rd=rd, offline_reason=reason, sync_hint=sync_hint)
    s._note(offline=True, needs_sync=True, error=reason, **({"run_name": run_name} if run_name else {}))
    return s


def run_sink(
    cfg,
    rd: RunDir,
    *,
    results_dir: str | Path,
    sweep: str,
    tracking_uri: str | None = None,
    parent_run_id: str | None = None,
    run_name: str | None = None,
    resume: bool | None = None,
):
    """The sink for one run (the one factory: `clipbench train` and every sweep worker): its MLflow child
    run (tag run_id), found or created, unless tracking.mlflow is off or `mlflow` is not in
    tracking.sinks; with the run's other mirrors (`tracking.sinks`: wandb, tensorboard; sinks.py) a
    FanoutSink over all of them; a NullSink when there is none. Never raises.

    `resume=False` (a fresh start) replaces a child left by an earlier attempt (deleted, recreated),
    since the store restarts that run from scratch; otherwise the child is reused, steps already
    in MLflow are not sent again, and at close whatever the store holds and MLflow lacks is sent.
    A sweep run without a parent (MLflow was down when the sweep started) finds or creates it."""

    config = to_dict(cfg) if isinstance(cfg, RunConfig) else dict(cfg)
    name = run_name or run_name_of(config, rd.run_id)
    extras = extra_sinks(config, rd, sweep=sweep, run_name=name, resume=resume)
    on = setting(config, "tracking.mlflow") and "mlflow" in setting(config, "tracking.sinks")
    sinks = (
        [
            _mlflow_run_sink(
                config,
                rd,
                results_dir=results_dir,
                sweep=sweep,
                tracking_uri=tracking_uri,
                parent_run_id=parent_run_id,
                name=name,
                resume=resume,
            )
        ]
        if on
        else []
    ) + extras
    if not sinks:
        return NullSink()
    if len(sinks) == 1 and not extras:
        return sinks[0]
    return FanoutSink(sinks, rd, sweep=sweep, backfill=resume is not False)


def _mlflow_run_sink(
    config: dict,
    rd: RunDir,
    *,
    results_dir,
    sweep: str,
    tracking_uri: str | None,
    parent_run_id: str | None,
    name: str,
    resume: bool | None,
):
    """The run's MLflow child run (see run_sink), or an offline MlflowSink when MLflow is unavailable."""
    uri = resolve_tracking_uri(tracking_uri, setting(config, "tracking.tracking_uri"), results_dir)
    hint = sync_hint(sweep, results_dir, uri)
    rid = rd.run_id
    try:
        client = client_for(uri)
        exp_id = get_or_create_experiment(
            client, setting(config, "tracking.experiment"), artifact_location(uri, results_dir)
        )
        if parent_run_id is None and sweep != "train":
            parent_run_id = parent_run(client, exp_id, sweep, rd.path.parent)
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
            run = client.create_run(exp_id, tags=tags, run_name=name)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            if parent_run_id and run.data.tags.get("mlflow.parentRunId") != parent_run_id:
                client.set_tag(run.info.run_id, "mlflow.parentRunId", parent_run_id)
            params = dict(run.data.params)
            steps = metric_steps(client, run.info.run_id, run.data.metrics.keys())
        mid = run.info.run_id
        record_mlflow_run(
            rd,
            uri,
            experiment_id=exp_id,
            run_id=mid,
            parent_run_id=parent_run_id,
            run_name=name,
            offline=False,
            needs_sync=False,
            error=None,
        )
        return MlflowSink(
            client,
            mid,
            uri=uri,
            rd=rd,
            batch_every=setting(config, "tracking.batch_every"),
            logged_params=params,
            logged_steps=steps,
            sync_hint=hint,
            config=config,
            backfill=resume is not False,
        )
    except Exception as e:  # noqa: BLE001 - tracking trouble never stops training
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        log.warning(
            "MLflow at %s is unavailable (%s); training continues offline. The results store keeps "
            "everything; replay it later with `%s`.",
            uri,
            msg,
            hint,
        )
        return offline_sink(uri, rd, msg, hint, run_name=name)


# ---------------------------------------------------------------------------------------------
# The sweep's parent run


def parent_run(client, exp_id: str, sweep: str, sweep_dir: str | Path, *, attach_manifest: bool = False) -> str:
    """The sweep's parent run (tags sweep, clipbench.role=sweep): found, or created (named after the
    sweep, started when its manifest was created), under the sweep's manifest lock so that there is
    one. `attach_manifest`: upload manifest.json when MLflow lacks it (or holds another size)."""
    sweep_dir = Path(sweep_dir)
    manifest = sweep_dir / "manifest.json"
    with manifest_lock(sweep_dir):
        found = find_runs(client, exp_id, sweep=sweep, role="sweep")
        if found:
            pid = found[0].info.run_id
        else:
            pid = client.create_run(
                exp_id,
                tags={"sweep": sweep, ROLE_TAG: "sweep"},
                run_name=sweep,
                start_time=_manifest_created_ms(manifest),
            ).info.run_id
    if attach_manifest and manifest.is_file():
        if artifact_sizes(client, pid).get(manifest.name) != manifest.stat().st_size:
            client.log_artifact(pid, str(manifest))
    return pid


def _manifest_created_ms(manifest: Path) -> int | None:
    try:
        created = read_json(manifest, {}, kind="manifest").get("created")
        return int(dt.datetime.fromisoformat(created).timestamp() * 1000) if created else None
    except (StoreError, ValueError, TypeError):
        return None


def sweep_parent_run(
    *,
    results_dir: str | Path,
    sweep: str,
    experiment: str,
    tracking_uri: str | None,
    config_uri: str | None = None,
    manifest_path: str | Path | None = None,
    client=None,
) -> str | None:
    """Find or create the parent run of a sweep, mark it RUNNING and attach the manifest. Returns its
    id, or None (one warning) when MLflow is unreachable."""
    uri = resolve_tracking_uri(tracking_uri, config_uri, results_dir)
    try:
        client = client or client_for(uri)
        exp_id = get_or_create_experiment(client, experiment, artifact_location(uri, results_dir))
        pid = parent_run(client, exp_id, sweep, Path(results_dir) / sweep, attach_manifest=manifest_path is not None)
        client.update_run(pid, status="RUNNING")
        return pid
    except Exception as e:  # noqa: BLE001
        log.warning(
            "MLflow at %s is unavailable (%s: %s); the sweep runs offline. Replay it later with `%s`.",
            uri,
            type(e).__name__,
            (str(e).splitlines() or [""])[0][:200],
            sync_hint(sweep, results_dir, uri),
        )
        return None


def finish_parent_run(
    parent_run_id: str | None, status: str, *, uri: str, sweep: str | None = None, experiment: str = "clipbench"
) -> None:
    """Terminate the sweep's parent run; without an id (MLflow was down when the sweep started), the
    parent a run created meanwhile is found by its tags."""
    try:
        client = client_for(uri)
        if not parent_run_id and sweep:
            exp = client.get_experiment_by_name(experiment)
            found = find_runs(client, exp.experiment_id, sweep=sweep, role="sweep") if exp is not None else []
            parent_run_id = found[0].info.run_id if found else None
        if parent_run_id:
            client.set_terminated(parent_run_id, status)
    except Exception as e:  # noqa: BLE001
        log.debug("could not terminate the parent run: %s", e)
