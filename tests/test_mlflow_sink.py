"""The MLflow sink and `clipbench sync` against the embedded sqlite store (no server, no training):
names, truncation, batching, nesting and tags, offline behaviour, resume without duplicates, and
sync replaying exactly what is missing."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest

from clipbench.config import load_run_config, run_id, to_dict
from clipbench.tracking import mlflow_sink as ms
from clipbench.tracking.store import RunDir
from clipbench.tracking.sync import expected_metrics, sync_command

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "arith_tiny.yaml"


def cfg(**over):
    return load_run_config(RECIPE, [f"{k}={v}" for k, v in over.items()])


def client(results: Path):
    return ms.client_for(ms.default_tracking_uri(results))


def history(c, mid: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in c.get_metric_history(mid, key))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw,name", [
    ("eval/arith/pass@8", "eval/arith/pass_at_8"),
    ("eval/arith/avg@n", "eval/arith/avg_at_n"),
    ("q1/out_of_band", "q1/out_of_band"),
    ("ratio/mean", "ratio/mean"),
    ("a b:c-d.e", "a b:c-d.e"),
    ("x#y(z)", "x_y_z_"),
    ("/lead//slash/", "lead/slash"),
])
def test_metric_names_are_sanitised(raw, name):
    from mlflow.utils.validation import _validate_metric_name

    assert ms.metric_name(raw) == name
    _validate_metric_name(name)  # raises if MLflow would refuse it


def test_long_params_are_truncated_to_mlflows_limit():
    v = ms.param_value("x" * 7000)
    assert len(v) == 6000 and v.endswith("...")
    assert ms.param_value([0.9, 0.999]) == "[0.9, 0.999]"


def test_run_params_hold_config_and_rule_semantics():
    c = cfg(**{"objective.method": "dapo"})
    p = ms.run_params(to_dict(c), "hf")
    assert p["objective.method"] == "dapo" and p["objective.eps_high"] == 0.28
    assert p["train.lr"] == c.train.lr and p["run_id"] == run_id(c)
    assert p["rule.ref_band_pos"] == "[0.8, 1.28]"  # 1 - 0.2, 1 + 0.28
    assert p["sampler.resolved_backend"] == "hf"


class SpyClient:
    """Wraps an MlflowClient, counting log_batch calls and optionally failing after `fail_after`."""

    def __init__(self, inner, fail_after: int | None = None):
        self.inner, self.fail_after, self.batches = inner, fail_after, []

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        if self.fail_after is not None and len(self.batches) >= self.fail_after:
            raise ConnectionError("server went away")
        self.batches.append((len(metrics), len(params)))
        return self.inner.log_batch(run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_sink_batches_nests_tags_and_stores_artifacts(tmp_path):
    res = tmp_path / "results"
    c = cfg(**{"tracking.batch_every": 10, "objective.method": "nsr", "seed": 3})
    rd = RunDir(res / "sw" / run_id(c))
    parent = ms.sweep_parent_run(results_dir=res, sweep="sw", experiment="clipbench", tracking_uri=None)
    assert parent is not None
    sink = ms.run_sink(c, rd, results_dir=res, sweep="sw", parent_run_id=parent, run_name="nsr seed=3")
    assert not sink.offline
    spy = SpyClient(sink.client)
    sink.client = spy
    sink.log_params(ms.run_params(to_dict(c)))
    for step in range(1, 26):
        sink.log_metrics(step, {"loss": step / 10, "eval/arith/pass@8": 0.5, "note": "text is skipped"})
    rd.path.mkdir(parents=True, exist_ok=True)
    rd.write_config(to_dict(c))
    sink.log_artifact(rd.config_path)
    sink.close("FINISHED")
    # params: 1 batch of <= 100; metrics: 25 calls, batch_every=10 -> flushes after 10, 20 and at close
    metric_batches = [n for n, p in spy.batches if n]
    assert metric_batches == [20, 20, 10]  # 2 numeric metrics per step
    cl = client(res)
    run = cl.get_run(sink.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == parent
    for k, v in {"sweep": "sw", "run_id": rd.run_id, "method": "nsr", "seed": "3",
                 "model": "builtin:arith-tiny", "mlflow.runName": "nsr seed=3"}.items():
        assert run.data.tags[k] == v
    assert run.data.params["objective.p"] == "0.5" and run.data.params["rule.method"] == "nsr"
    assert history(cl, sink.mlflow_run_id, "loss") == [(s, s / 10) for s in range(1, 26)]
    assert len(history(cl, sink.mlflow_run_id, "eval/arith/pass_at_8")) == 25
    assert "note" not in run.data.metrics
    art = Path(run.info.artifact_uri.replace("file://", ""))
    assert art.is_relative_to(res.resolve() / "mlartifacts")
    assert (art / "config.yaml").read_text() == rd.config_path.read_text()
    assert ms.recorded_mlflow_run(rd, ms.default_tracking_uri(res))["run_id"] == sink.mlflow_run_id


def test_dead_server_goes_offline_fast_with_one_warning(tmp_path, caplog):
    res = tmp_path / "results"
    c = cfg()
    rd = RunDir(res / "sw" / run_id(c))
    uri = f"http://127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, logger="clipbench.tracking")
    t0 = time.perf_counter()
    sink = ms.run_sink(c, rd, results_dir=res, sweep="sw", tracking_uri=uri)
    dt = time.perf_counter() - t0
    assert sink.offline and dt < 15, dt
    for step in range(50):
        sink.log_metrics(step, {"loss": 1.0})
    sink.log_params({"a": 1})
    sink.log_artifact(__file__)
    sink.close("FINISHED")
    assert time.perf_counter() - t0 < 15
    warns = [r for r in caplog.records if r.name == "clipbench.tracking" and r.levelno == logging.WARNING]
    assert len(warns) == 1 and "clipbench sync sw" in warns[0].getMessage()
    assert ms.recorded_mlflow_run(rd, uri)["offline"] is True


def test_failure_mid_run_goes_offline_and_never_raises(tmp_path, caplog):
    res = tmp_path / "results"
    c = cfg(**{"tracking.batch_every": 5})
    rd = RunDir(res / "sw" / run_id(c))
    sink = ms.run_sink(c, rd, results_dir=res, sweep="sw")
    sink.client = SpyClient(sink.client, fail_after=2)
    caplog.set_level(logging.WARNING, logger="clipbench.tracking")
    for step in range(1, 31):
        sink.log_metrics(step, {"loss": float(step)})
    sink.close("FINISHED")
    assert sink.offline
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    # the first two batches (steps 1-10) made it; nothing after
    assert [s for s, _ in history(client(res), sink.mlflow_run_id, "loss")] == list(range(1, 11))


def test_resumed_run_does_not_duplicate_steps_and_fresh_start_replaces_the_child(tmp_path):
    res = tmp_path / "results"
    c = cfg()
    rd = RunDir(res / "sw" / run_id(c))
    s1 = ms.run_sink(c, rd, results_dir=res, sweep="sw")
    for step in range(1, 11):
        s1.log_metrics(step, {"loss": float(step)})
    s1.close("KILLED")
    # resume from a checkpoint at step 5: the trainer replays 6..15; 6..10 are already in MLflow
    s2 = ms.run_sink(c, rd, results_dir=res, sweep="sw", resume=True)
    assert s2.mlflow_run_id == s1.mlflow_run_id
    for step in range(6, 16):
        s2.log_metrics(step, {"loss": float(step)})
    s2.close("FINISHED")
    cl = client(res)
    assert history(cl, s1.mlflow_run_id, "loss") == [(s, float(s)) for s in range(1, 16)]
    # a fresh start (no checkpoint) restarts the run in the store, so its MLflow child is replaced
    s3 = ms.run_sink(c, rd, results_dir=res, sweep="sw", resume=False)
    assert s3.mlflow_run_id != s1.mlflow_run_id
    s3.log_metrics(1, {"loss": 1.0})
    s3.close()
    assert cl.get_run(s1.mlflow_run_id).info.lifecycle_stage == "deleted"
    assert history(cl, s3.mlflow_run_id, "loss") == [(1, 1.0)]


def fake_run(res: Path, sweep: str, seed: int, steps: int = 6, mb: int = 2) -> RunDir:
    """A finished run written the way the trainer writes it (no training needed)."""
    c = cfg(seed=seed, **{"train.steps": steps})
    rd = RunDir(res / sweep / run_id(c))
    rd.write_config(to_dict(c))
    rows, opt = [], 0
    for step in range(steps):
        for m in range(mb):
            opt += 1
            rows.append({"step": step, "opt_step": opt, "mini_batch": m, "loss": 0.1 * opt + seed,
                         "reward/mean": step / steps, "grad_norm": float("nan") if opt == 3 else 1.0,
                         "q4/out_of_band": opt % 3})
    rd.append_metrics(rows)
    rd.append_hist([{"step": s, "opt_step": 1, "edges": [0, 1], "pos": [1], "neg": [2]} for s in range(steps)])
    for step in (0, steps):
        rd.write_eval(step, "arith", {"step": step, "summary": {"num_problems": 8, "n": 2, "avg@n": 0.25 * (step > 0),
                                                                "pass@1": 0.25, "pass@2": 0.5}})
    rd.set_status("finished", backend="hf", started=1_700_000_000.0)
    return rd


def test_expected_metrics_mirror_what_the_trainer_sends(tmp_path):
    rd = fake_run(tmp_path, "sw", seed=0, steps=3, mb=2)
    exp = expected_metrics(rd)
    assert sorted(exp["loss"]) == [1, 2, 3, 4, 5, 6]  # keyed by opt_step
    assert exp["grad_norm"][3] != exp["grad_norm"][3]  # NaN (stored as null) is sent as NaN
    assert exp["eval/arith/avg_at_n"] == {0: 0.0, 3: 0.25}  # keyed by rollout step
    assert exp["eval/arith/pass_at_2"] == {0: 0.5, 3: 0.5}


def test_sync_replays_missing_runs_and_points_once(tmp_path):
    res = tmp_path / "results"
    runs = [fake_run(res, "sw", seed=s) for s in range(3)]
    (res / "sw" / "manifest.json").write_text('{"sweep": "sw", "runs": {}}\n')
    # run 0 was mirrored live up to opt_step 5 before the server went away; runs 1 and 2 never were
    c0 = runs[0].read_config()
    s = ms.run_sink(c0, runs[0], results_dir=res, sweep="sw")
    for row in runs[0].read_metrics()[:5]:
        s.log_metrics(row["opt_step"], {k: v for k, v in row.items() if isinstance(v, (int, float))})
    s.flush()
    first = sync_command("sw", results_dir=res, tracking_uri=None)
    by = {r["run_id"]: r for r in first}
    assert by[runs[0].run_id]["created"] is False and by[runs[1].run_id]["created"] is True
    assert all(r["duplicates_seen"] == 0 for r in first)
    cl = client(res)
    for rd in runs:
        mid = ms.recorded_mlflow_run(rd, ms.default_tracking_uri(res))["run_id"]
        run = cl.get_run(mid)
        assert run.info.status == "FINISHED"
        for key, steps in expected_metrics(rd).items():
            got = [m.step for m in cl.get_metric_history(mid, key)]
            assert sorted(got) == sorted(steps), key  # nothing missing, nothing twice
        arts = {f.path for f in cl.list_artifacts(mid)} | {f.path for f in cl.list_artifacts(mid, "eval/step_000000")}
        assert {"config.yaml", "hist", "eval", "eval/step_000000/arith.json"} <= arts
        assert run.data.tags["run_id"] == rd.run_id and run.data.tags.get("mlflow.parentRunId")
    parents = ms.find_runs(cl, cl.get_experiment_by_name("clipbench").experiment_id, sweep="sw", role="sweep")
    assert len(parents) == 1 and [f.path for f in cl.list_artifacts(parents[0].info.run_id)] == ["manifest.json"]
    # a second sync finds nothing to do
    second = sync_command("sw", results_dir=res, tracking_uri=None)
    assert all(r["metrics"] == 0 and r["params"] == 0 and r["artifacts"] == 0 and not r["created"] for r in second)


def test_sync_errors_are_one_line_user_errors(tmp_path):
    from clipbench.errors import UserError

    res = tmp_path / "results"
    fake_run(res, "sw", seed=0)
    with pytest.raises(UserError, match="no runs for sweep 'swx'.*did you mean 'sw'"):
        sync_command("swx", results_dir=res)
    with pytest.raises(UserError, match="cannot reach MLflow at http://127.0.0.1"):
        sync_command("sw", results_dir=res, tracking_uri=f"http://127.0.0.1:{free_port()}")
