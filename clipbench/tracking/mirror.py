"""What MLflow holds for a run: one set of functions for the live sink and for `clipbench sync`.

    points, params = mirror_points(step, metrics, opt_step_after)   # one sink call -> MLflow points
    expected_metrics(rd), expected_params(rd), expected_artifacts(rd)   # a whole run, from the store

The live sink (`mlflow_sink.MlflowSink`) and `clipbench sync` build MLflow rows with these
functions only, so a run mirrored live and a run replayed later hold exactly the same points.

Rules (docs/architecture.md, "The MLflow mirror"):
- One step axis: the optimizer step. A training row is logged at its `opt_step`. An evaluation at
  rollout step k (the store's `eval/step_<k>`: k = 0 is the base model, before any update) is logged
  at the optimizer step reached after k rollout steps: the `opt_step` of the last row of rollout step
  k - 1, 0 for k = 0 (with M mini-batches and E epochs per rollout step, k * M * E).
- Bookkeeping is not a metric: `step`, `opt_step`, `epoch`, `mini_batch` are the step axis (or follow
  from it), `old_logp_source` is the param `sampler.old_logp`; an evaluation's `n` and
  `num_problems` become the params `eval/<benchmark>/n` and `eval/<benchmark>/num_problems`.
- Avg@n names its n: the summary key `avg@<n>` (MLflow `avg_at_<n>`); a store written before that
  change (`avg@n`) is read as `avg@<n>` of its own n.
- Names are sanitised to MLflow's charset (`pass@8` -> `pass_at_8`, `/` kept: as verl's MLflow logger
  does).
- Beside clipbench's names, the names verl and TRL users look for (`actor/pg_clipfrac`,
  `clip_ratio/region_mean`, `val-core/<benchmark>/reward/mean@<n>`, ...; `aliases.py`, docs/metrics.md).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from clipbench.config import flatten, run_id
from clipbench.config.stored import recorded, recorded_slot
from clipbench.objectives import effective_bounds
from clipbench.objectives.corrections import describe
from clipbench.tracking.aliases import aliases
from clipbench.tracking.provenance import provenance_params, read_provenance
from clipbench.tracking.records import list_records
from clipbench.tracking.store import RunDir

MAX_PARAM_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
ROW_BOOKKEEPING = ("step", "opt_step", "epoch", "mini_batch", "old_logp_source")
EVAL_BOOKKEEPING = ("n", "num_problems")
EVAL_PREFIX = "eval/"

_BAD = re.compile(r"[^\w.\- :/]")


def default_tracking_uri(results_dir: str | Path) -> str:
    """The embedded MLflow store of a results dir (the sink's default; `sync_hint` names it or not)."""
    return f"sqlite:///{Path(results_dir).resolve() / 'mlflow.db'}"


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


def opt_step_after(rows: Iterable[Mapping], k: int) -> int:
    """The optimizer step reached after k rollout steps: the largest opt_step of a row with step < k."""
    return max(
        (
            int(r["opt_step"])
            for r in rows
            if isinstance(r.get("step"), int) and r["step"] < k and isinstance(r.get("opt_step"), int)
        ),
        default=0,
    )


def eval_metrics(benchmark: str, summary: Mapping) -> dict[str, Any]:
    """A benchmark summary as the flat `eval/<benchmark>/<stat>` dict the trainer logs (avg@n named)."""
    n = summary.get("n")
    return {f"{EVAL_PREFIX}{benchmark}/{f'avg@{n}' if k == 'avg@n' and n else k}": v for k, v in summary.items()}


def mirror_points(
    step: int, metrics: Mapping[str, Any], opt_step_after_k: Callable[[int], int]
) -> tuple[list[tuple[str, int, float]], dict[str, str]]:
    """One sink call -> ([(metric name, MLflow step, value)], {param: value}).

    `metrics` is a training row (it has `opt_step`: the step axis) or evaluation metrics
    (`eval/<benchmark>/<stat>` keys; `step` is then the rollout step k of the store, logged at
    `opt_step_after_k(k)`); any other call is logged at `step` as given."""
    if "opt_step" in metrics and isinstance(metrics["opt_step"], (int, float)):
        at = int(metrics["opt_step"])
    elif metrics and all(str(k).startswith(EVAL_PREFIX) for k in metrics):
        at = opt_step_after_k(int(step))
    else:
        at = int(step)
    points: list[tuple[str, int, float]] = []
    params: dict[str, str] = {}
    ns = {
        k.rsplit("/", 1)[0]: int(v)
        for k, v in metrics.items()
        if str(k).startswith(EVAL_PREFIX) and k.endswith("/n") and isinstance(v, (int, float))
    }
    named: dict[str, Any] = {}
    for k, v in metrics.items():
        k = str(k)
        if k in ROW_BOOKKEEPING:
            continue
        if k.startswith(EVAL_PREFIX):
            head, stat = k.rsplit("/", 1)
            if stat in EVAL_BOOKKEEPING:  # counts: 8, whether the trainer passed 8 or 8.0
                params[metric_name(k)] = param_value(int(v) if isinstance(v, float) and v.is_integer() else v)
                continue
            if stat == "avg@n" and ns.get(head):  # a store written before avg@n named its n
                k = f"{head}/avg@{ns[head]}"
        named[k] = v
    for k, v in [*named.items(), *aliases(named).items()]:  # and under verl's and TRL's names (aliases.py)
        val = metric_value(v)
        if val is not None:
            points.append((metric_name(k), at, val))
    return points, params


# ---------------------------------------------------------------------------------------------
# A whole run, from the store alone


def run_params(config: Mapping, backend: str | None = None) -> dict[str, Any]:
    """What a run logs as params: the flattened resolved config, the effective clip bounds and rule
    semantics (`rule.*`), the sampler correction's unit and denominators (`correction.*`), the run id
    and the resolved sampler backend. (The trainer logs the same.)"""

    params = flatten(dict(config))
    rule = recorded_slot(config, "objective")
    if rule is not None:
        try:
            params.update({f"rule.{k}": v for k, v in effective_bounds(rule.name, rule.params).items()})
        except ValueError:
            pass
    correction = recorded(config, "sampler.correction")
    if isinstance(correction, Mapping):  # its unit and which tokens stay in the denominators (correction.*)
        try:
            params.update(
                {f"correction.{k}": v for k, v in describe(correction).items() if k in ("unit", "denominator")}
            )
        except ValueError:
            pass
    params["run_id"] = run_id(dict(config))
    if backend:
        params["sampler.resolved_backend"] = backend
    return params


def shown(value: Any) -> str:
    """A recorded config value as a tag or a name part: "" where the config records none."""
    return "" if value is None else str(value)


def run_name_of(config: Mapping, run_id: str) -> str:
    """A run's display name in the mirrors: '<method> seed=<seed> <run id>'."""
    return f"{_method(config)} seed={shown(recorded(config, 'seed'))} {run_id}"


def _method(config: Mapping) -> str:
    rule = recorded_slot(config, "objective")
    return shown(rule.name if rule else None)


ROLE_TAG = "clipbench.role"  # "sweep" (a sweep's parent run) or "run"


def run_tags(config: Mapping, *, sweep: str, run_id: str) -> dict[str, str]:
    return {
        "sweep": sweep,
        "run_id": run_id,
        "method": _method(config),
        "seed": shown(recorded(config, "seed")),
        "model": shown(recorded(config, "model.name")),
        ROLE_TAG: "run",
    }


def expected_metrics(
    rd: RunDir, rows: list[dict] | None = None, evals: dict[int, dict[str, dict]] | None = None
) -> dict[str, dict[int, float]]:
    """{metric name: {MLflow step: value}}: exactly what the trainer sends live (`mirror_points`)."""
    rows = rd.read_metrics() if rows is None else rows
    evals = rd.read_evals() if evals is None else evals
    out: dict[str, dict[int, float]] = {}

    def add(points):
        for name, step, val in points:
            out.setdefault(name, {}).setdefault(step, val)

    for row in rows:
        add(mirror_points(int(row.get("step", 0)), row, lambda k: 0)[0])
    for k, per_bench in evals.items():
        for bench, payload in per_bench.items():
            add(
                mirror_points(
                    k, eval_metrics(bench, payload.get("summary") or {}), lambda kk: opt_step_after(rows, kk)
                )[0]
            )
    return out


def expected_params(
    rd: RunDir, config: Mapping, status: Mapping, evals: dict[int, dict[str, dict]] | None = None
) -> dict[str, str]:
    """{param name: value}: the run's params (`run_params`), its provenance (`provenance.*`, from
    provenance.json) and its evaluations' bookkeeping."""
    want = {metric_name(k): param_value(v) for k, v in run_params(config, status.get("backend")).items()}
    want.update({metric_name(k): param_value(v) for k, v in provenance_params(read_provenance(rd.path)).items()})
    evals = rd.read_evals() if evals is None else evals
    for k, per_bench in sorted(evals.items()):
        for bench, payload in per_bench.items():
            for name, v in mirror_points(k, eval_metrics(bench, payload.get("summary") or {}), lambda kk: 0)[1].items():
                want.setdefault(name, v)
    return want


def expected_artifacts(rd: RunDir) -> list[tuple[Path, str | None]]:
    """[(local file, artifact dir)] -- the layout the trainer uses."""
    files: list[tuple[Path, str | None]] = []
    if rd.config_path.is_file():
        files.append((rd.config_path, None))
    if rd.hist_path.is_file():
        files.append((rd.hist_path, "hist"))
    root = rd.path / "eval"
    if root.is_dir():
        for d in sorted(root.glob("step_*")):
            for f in sorted(d.glob("*.json")):
                files.append((f, f"eval/{d.name}"))
    for d in list_records(rd.path):  # train.record: each record's index (the tensors stay in the store)
        files.append((d / "index.json", f"record/{d.name}"))
    return files


def sync_hint(sweep: str, results_dir: str | Path, uri: str) -> str:
    """The exact command that replays a sweep into the MLflow at `uri` (copy-paste ready)."""

    cmd = ["clipbench", "sync", sweep, "--results-dir", str(results_dir)]
    if uri != default_tracking_uri(results_dir):
        cmd += ["--tracking-uri", uri]
    return " ".join(shlex.quote(c) for c in cmd)
