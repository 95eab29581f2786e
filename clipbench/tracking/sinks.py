"""The mirrors besides MLflow: Weights & Biases and TensorBoard (`tracking.sinks: [mlflow, wandb,
tensorboard]`, optional extras `clipbench[wandb]`, `clipbench[tensorboard]`), and the fan-out that
gives every run one `MetricSink` whatever its mirrors.

    sinks = extra_sinks(config, rd, sweep="nsr_vs_decay", run_name="nsr seed=0", resume=False)
    sink = FanoutSink([mlflow_sink, *sinks], rd)     # what the trainer calls (tracking.sink.MetricSink)
    replay_sink(name, config, rd, sweep=...)          # `clipbench sync --sink NAME`: what the store holds

The same guarantees as the MLflow mirror where the tracker allows them:
- one step axis: the optimizer step (`opt_step`), evaluations at the optimizer step their rollout step
  reached (`tracking.mirror.mirror_points`, the function the MLflow sink uses);
- parent and child: a W&B run per run, grouped by sweep (`group`); TensorBoard: one event directory
  per run, `<run_dir>/tensorboard`, so `tensorboard --logdir <results>/<sweep>` shows the sweep;
- a resumed run continues its tracker run, not a second one: W&B resumes the run of the same id
  (`<sweep>-<run_id>`) and skips what `<run_dir>/wandb.json` says it sent (written at every flush: a
  kill -9 may repeat the points of the last `tracking.batch_every` calls); TensorBoard reads its event
  files back and skips every point already there. A fresh start (`resume=False`) of a run that had
  an earlier attempt starts afresh, as the store does: a new TensorBoard directory, a new W&B run
  (`<sweep>-<run_id>-N`; the earlier one stays in W&B);
- a sink that fails never fails the run: the first failure is one warning naming the sink and the
  `clipbench sync --sink NAME` command that replays the store later; the sink is then off for the run
  and `<run_dir>/sinks.json` records it.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from clipbench.config.stored import setting
from clipbench.tracking.files import atomic_write_json, read_json
from clipbench.tracking.mirror import expected_metrics, metric_name, mirror_points, opt_step_after, param_value
from clipbench.tracking.store import RunDir, RunState

log = logging.getLogger("clipbench.tracking")

EXTRAS = {"wandb": "wandb", "tensorboard": "tensorboard"}  # sink -> the package (and extra) it needs
SINKS_JSON = "sinks.json"


def missing_package(name: str) -> str | None:
    """The pip command that makes sink `name` usable here, or None when it is."""

    pkg = EXTRAS.get(name)
    if pkg is None or importlib.util.find_spec(pkg) is not None:
        return None
    return f"pip install 'clipbench[{name}]'"


def _note(rd: RunDir | None, name: str, **info: Any) -> None:
    if rd is None:
        return
    try:
        data = read_json(rd.path / SINKS_JSON, {}, kind="mlflow")
        data[name] = {**data.get(name, {}), **info}
        atomic_write_json(rd.path / SINKS_JSON, data)
    except Exception:  # noqa: BLE001 - bookkeeping never fails a run
        pass


class MirrorSink:
    """A mirror fed the trainer's calls on clipbench's step axis; subclasses send points and params."""

    name = ""

    def __init__(self, rd: RunDir):
        self.rd = rd
        self._opt_at: dict[int, int] = {}  # rollout step -> the largest opt_step logged for it
        self.sent: dict[str, int] = {}  # metric name -> the largest step sent
        self.n_points = 0

    def _opt_step_after(self, k: int) -> int:
        if k <= 0:
            return 0
        if k - 1 in self._opt_at:
            return self._opt_at[k - 1]
        return opt_step_after(self.rd.read_metrics(), k)

    def _is_new(self, name: str, at: int) -> bool:
        return at > self.sent.get(name, -1)

    def log_metrics(self, step: int, metrics: dict) -> None:
        if isinstance(metrics.get("opt_step"), (int, float)) and isinstance(metrics.get("step"), (int, float)):
            k = int(metrics["step"])
            self._opt_at[k] = max(self._opt_at.get(k, 0), int(metrics["opt_step"]))
        points, params = mirror_points(step, metrics, self._opt_step_after)
        if params:
            self.log_params(params)
        self.send([(n, at, v) for n, at, v in points if self._is_new(n, at)])

    def send(self, points: list[tuple[str, int, float]]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, at, val in points:
            by_step.setdefault(at, {})[name] = val
        for at in sorted(by_step):
            self._write(at, by_step[at])
            for name in by_step[at]:
                self.sent[name] = max(self.sent.get(name, -1), at)
            self.n_points += len(by_step[at])

    def replay(self) -> int:
        """Send what the store holds and this tracker lacks (a resumed run at close; `clipbench sync`)."""
        before = self.n_points
        points = [
            (n, at, v)
            for n, steps in expected_metrics(self.rd).items()
            for at, v in steps.items()
            if self._is_new(n, at)
        ]
        self.send(points)
        return self.n_points - before

    def _write(self, at: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def log_params(self, params: dict) -> None:
        pass

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


class TensorBoardSink(MirrorSink):
    """Scalars into `<run_dir>/tensorboard` (torch.utils.tensorboard); params as one text summary."""

    name = "tensorboard"

    def __init__(self, rd: RunDir, *, resume: bool | None):
        super().__init__(rd)
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - torch is heavy

        self.dir = rd.path / "tensorboard"
        if resume is False and self.dir.exists():
            shutil.rmtree(self.dir)  # an earlier attempt of a run the store restarts from scratch
        self.sent, self._texts = read_scalars(self.dir)
        self.writer = SummaryWriter(str(self.dir))

    def _write(self, at: int, values: dict[str, float]) -> None:
        for name, val in values.items():
            self.writer.add_scalar(name, val, at)

    def log_params(self, params: dict) -> None:
        new = {
            metric_name(k): param_value(v) for k, v in params.items() if f"params/{metric_name(k)}" not in self._texts
        }
        for k, v in new.items():
            self.writer.add_text(f"params/{k}", v, 0)
            self._texts.add(f"params/{k}")

    def flush(self) -> None:
        self.writer.flush()

    def close(self, status: str = "FINISHED") -> None:
        self.writer.close()


def read_scalars(log_dir: Path) -> tuple[dict[str, int], set[str]]:
    """({scalar tag: largest step}, {text tags}) of the event files under `log_dir` (tensorboard's reader)."""
    if not log_dir.is_dir():
        return {}, set()
    # PLC0415, deferred: optional: tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    return ({t: max(e.step for e in acc.Scalars(t)) for t in tags.get("scalars", [])}, set(tags.get("tensors", [])))


class WandbSink(MirrorSink):
    """One W&B run per run (id `<sweep>-<run_id>`, group = the sweep), logging against `opt_step`.
    WANDB_MODE=offline (W&B's own setting) writes it under `<run_dir>/wandb` for `wandb sync`."""

    name = "wandb"

    def __init__(self, rd: RunDir, config: Mapping, *, sweep: str, run_name: str, resume: bool | None):
        super().__init__(rd)
        import wandb  # noqa: PLC0415 - optional: wandb

        self.record = rd.path / "wandb.json"
        rec = read_json(self.record, {}, kind="mlflow")
        self.attempt = int(rec.get("attempt", 0))
        run_id = rec.get("run") or wandb_id(sweep, rd.run_id)
        if resume is False and rec:  # the store restarts the run from scratch: a new W&B run, not the old one's
            self.attempt += 1
            run_id = f"{wandb_id(sweep, rd.run_id)}-{self.attempt}"
        else:
            self.sent = {k: int(v) for k, v in rec.get("sent", {}).items()}
        self.run = wandb.init(
            project=setting(config, "tracking.experiment"),
            id=run_id,
            name=run_name,
            group=sweep,
            job_type="run",
            dir=str(rd.path),
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("opt_step")
        self.run.define_metric("*", step_metric="opt_step")
        self.batch_every = max(1, int(setting(config, "tracking.batch_every")))
        self._calls = 0

    def log_metrics(self, step: int, metrics: dict) -> None:
        super().log_metrics(step, metrics)
        self._calls += 1
        if self._calls % self.batch_every == 0:
            self.flush()

    def _write(self, at: int, values: dict[str, float]) -> None:
        self.run.log({**values, "opt_step": at})

    def log_params(self, params: dict) -> None:
        self.run.config.update({metric_name(k): param_value(v) for k, v in params.items()}, allow_val_change=True)

    def flush(self) -> None:
        atomic_write_json(self.record, {"run": self.run.id, "attempt": self.attempt, "sent": self.sent})

    def close(self, status: str = "FINISHED") -> None:
        self.flush()
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def wandb_id(sweep: str, run_id: str) -> str:
    """The W&B run id of a store run (`-N` appended for its N-th restart from scratch): the same on
    every resume, so a resume continues it."""
    return f"{sweep}-{run_id}"


def open_sink(name: str, config: Mapping, rd: RunDir, *, sweep: str, run_name: str, resume: bool | None) -> MirrorSink:
    if name == "tensorboard":
        return TensorBoardSink(rd, resume=resume)
    if name == "wandb":
        return WandbSink(rd, config, sweep=sweep, run_name=run_name, resume=resume)
    raise ValueError(f"unknown sink {name!r}")


def sync_hint(name: str, sweep: str, results_dir: Path) -> str:
    return f"clipbench sync {sweep} --sink {name} --results-dir {results_dir}"


def extra_sinks(config: Mapping, rd: RunDir, *, sweep: str, run_name: str, resume: bool | None) -> list:
    """The run's mirrors other than MLflow, opened; one that cannot open is left out with one warning."""
    out = []
    for name in setting(config, "tracking.sinks"):
        if name == "mlflow":
            continue
        try:
            sink = open_sink(name, config, rd, sweep=sweep, run_name=run_name, resume=resume)
        except Exception as e:  # noqa: BLE001 - a mirror never stops training
            _warn_once(name, "opening", e, sync_hint(name, sweep, rd.path.parent.parent), rd)
            continue
        _note(rd, name, needs_sync=False, error=None)
        out.append(sink)
    return out


def _warn_once(name: str, what: str, exc: BaseException, hint: str, rd: RunDir | None) -> None:
    msg = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]
    log.warning(
        "%s sink failed during %s (%s); it is off for this run. Training continues and the results "
        "store keeps everything; replay it later with `%s`.",
        name,
        what,
        msg,
        hint,
    )
    _note(rd, name, needs_sync=True, error=msg)


class FanoutSink:
    """Every call to each sink in turn; a sink that raises is warned about once and dropped, never raised."""

    def __init__(self, sinks: list, rd: RunDir | None = None, *, sweep: str = "train", backfill: bool = False):
        self.sinks = list(sinks)
        self.rd = rd
        self.sweep = sweep
        self.backfill = backfill  # a resumed run: at close, what the store holds and a mirror lacks

    def _each(self, what: str, call: Callable[[Any], None]) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as e:  # noqa: BLE001
                name = getattr(sink, "name", "") or type(sink).__name__
                results = self.rd.path.parent.parent if self.rd is not None else Path("results")
                _warn_once(name, what, e, sync_hint(name, self.sweep, results), self.rd)
                self.sinks.remove(sink)

    def log_params(self, params: dict) -> None:
        self._each("log_params", lambda s: s.log_params(params))

    def log_metrics(self, step: int, metrics: dict) -> None:
        self._each("log_metrics", lambda s: s.log_metrics(step, metrics))

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self._each("log_artifact", lambda s: s.log_artifact(path, artifact_path))

    def flush(self) -> None:
        self._each("flush", lambda s: s.flush())

    def close(self, status: str = "FINISHED") -> None:
        if self.backfill:
            self._each("replaying the store", lambda s: s.replay() if isinstance(s, MirrorSink) else None)
        self._each("close", lambda s: s.close(status))


def replay_sink(name: str, config: Mapping, rd: RunDir, *, sweep: str, run_name: str) -> int:
    """`clipbench sync --sink NAME` for one run: open its tracker run (continued), send what it lacks."""
    sink = open_sink(name, config, rd, sweep=sweep, run_name=run_name, resume=True)
    try:
        n = sink.replay()
    finally:
        sink.close("FINISHED" if rd.state is RunState.FINISHED else "FAILED")
    _note(rd, name, needs_sync=False, error=None)
    return n
