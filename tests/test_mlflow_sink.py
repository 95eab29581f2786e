"""The MLflow sink and `clipbench sync` against the embedded sqlite store (no server, no training):
names, truncation, batching, nesting and tags, offline behaviour, resume without duplicates, and
sync replaying exactly what is missing."""

from __future__ import annotations

import logging
import math
import socket
import time
from pathlib import Path

import pytest

from clipbench.commands.sync import sync_command
from clipbench.config import load_run_config, run_id, to_dict
from clipbench.tracking import mlflow_client as mc
from clipbench.tracking import mlflow_sink as ms
from clipbench.tracking.mirror import default_tracking_uri, expected_metrics, mirror_points, run_params
from clipbench.tracking.store import RunDir

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "arith_tiny.yaml"


def cfg(**over):
    return load_run_config(RECIPE, [f"{k}={v}" for k, v in over.items()])


def client(results: Path):
    return mc.client_for(default_tracking_uri(results))


def history(c, mid: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in c.get_metric_history(mid, key))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,name",
    [
        ("eval/arith/pass@8", "eval/arith/pass_at_8"),
        ("eval/arith/avg@n", "eval/arith/avg_at_n"),
        ("q1/out_of_band", "q1/out_of_band"),
        ("ratio/mean", "ratio/mean"),
        ("a b:c-d.e", "a b:c-d.e"),
        ("x#y(z)", "x_y_z_"),
        ("/lead//slash/", "lead/slash"),
    ],
)
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
    p = run_params(to_dict(c), "hf")
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
    sink.log_params(run_params(to_dict(c)))
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
    for k, v in {
        "sweep": "sw",
        "run_id": rd.run_id,
        "method": "nsr",
        "seed": "3",
        "model": "builtin:arith-tiny",
        "mlflow.runName": "nsr seed=3",
    }.items():
        assert run.data.tags[k] == v
    assert run.data.params["objective.p"] == "0.5" and run.data.params["rule.method"] == "nsr"
    assert history(cl, sink.mlflow_run_id, "loss") == [(s, s / 10) for s in range(1, 26)]
    assert len(history(cl, sink.mlflow_run_id, "eval/arith/pass_at_8")) == 25
    assert "note" not in run.data.metrics
    art = Path(run.info.artifact_uri.replace("file://", ""))
    assert art.is_relative_to(res.resolve() / "mlartifacts")
    assert (art / "config.yaml").read_text() == rd.config_path.read_text()
    assert mc.recorded_mlflow_run(rd, default_tracking_uri(res))["run_id"] == sink.mlflow_run_id
    # MLflow 3 opens the experiment on its runs (model development), not in its GenAI (traces) view
    assert cl.get_experiment_by_name("clipbench").tags["mlflow.experimentKind"] == "custom_model_development"


def test_an_existing_experiment_is_tagged_model_development_unless_its_kind_is_set(tmp_path):
    cl = mc.client_for(default_tracking_uri(tmp_path))
    old = cl.create_experiment("made-before")  # an experiment an older clipbench created: no kind
    mine = cl.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    assert mc.get_or_create_experiment(cl, "made-before", None) == old
    assert cl.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    assert mc.get_or_create_experiment(cl, "chosen", None) == mine
    assert cl.get_experiment(mine).tags["mlflow.experimentKind"] == "genai_development"  # a user's choice kept


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
    assert len(warns) == 1
    assert f"`clipbench sync sw --results-dir {res} --tracking-uri {uri}`" in warns[0].getMessage()  # exact
    assert mc.recorded_mlflow_run(rd, uri)["offline"] is True and mc.recorded_mlflow_run(rd, uri)["needs_sync"] is True


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


def summarize_public(correct) -> dict:
    from clipbench.eval.passk import summarize

    s = summarize(correct)
    s.pop("per_problem")
    return s


def fake_run(res: Path, sweep: str, seed: int, steps: int = 6, mb: int = 2) -> RunDir:
    """A finished run written the way the trainer writes it (no training needed)."""
    c = cfg(seed=seed, **{"train.steps": steps})
    rd = RunDir(res / sweep / run_id(c))
    rd.write_config(to_dict(c))
    rows, opt = [], 0
    for step in range(steps):
        for m in range(mb):
            opt += 1
            rows.append(
                {
                    "step": step,
                    "opt_step": opt,
                    "mini_batch": m,
                    "loss": 0.1 * opt + seed,
                    "reward/mean": step / steps,
                    "grad_norm": float("nan") if opt == 3 else 1.0,
                    "q4/out_of_band": opt % 3,
                }
            )
    rd.append_metrics(rows)
    rd.append_hist([{"step": s, "opt_step": 1, "edges": [0, 1], "pos": [1], "neg": [2]} for s in range(steps)])
    for step in (0, steps):  # 8 problems x 2 samples; at the end two problems are solved once each
        correct = [[1, 0], [0, 1]] + [[0, 0]] * 6 if step else [[0, 0]] * 8
        rd.write_eval(
            step,
            "arith",
            {
                "step": step,
                "n": 2,
                "problem_ids": [f"p{i}" for i in range(8)],
                "correct": correct,
                "summary": summarize_public(correct),
            },
        )
    rd.set_status("finished", backend="hf", started=1_700_000_000.0)
    return rd


def test_expected_metrics_mirror_what_the_trainer_sends(tmp_path):
    rd = fake_run(tmp_path, "sw", seed=0, steps=3, mb=2)
    exp = expected_metrics(rd)
    assert sorted(exp["loss"]) == [1, 2, 3, 4, 5, 6]  # keyed by opt_step
    assert exp["grad_norm"][3] != exp["grad_norm"][3]  # NaN (stored as null) is sent as NaN
    # one step axis: the evaluation at rollout step 3 is logged at the optimizer step reached after 3
    # rollout steps (3 x 2 mini-batches = 6); at rollout step 0 (the base model) at 0
    assert exp["eval/arith/avg_at_2"] == {0: 0.0, 6: 0.125}  # Avg@n names its n (n = 2)
    assert exp["eval/arith/pass_at_2"] == {0: 0.0, 6: 0.25}
    # bookkeeping is the step axis or a param, never a metric
    assert not {"step", "opt_step", "mini_batch", "epoch", "eval/arith/n", "eval/arith/num_problems"} & set(exp)


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
        mid = mc.recorded_mlflow_run(rd, default_tracking_uri(res))["run_id"]
        run = cl.get_run(mid)
        assert run.info.status == "FINISHED"
        for key, steps in expected_metrics(rd).items():
            got = [m.step for m in cl.get_metric_history(mid, key)]
            assert sorted(got) == sorted(steps), key  # nothing missing, nothing twice
        arts = {f.path for f in cl.list_artifacts(mid)} | {f.path for f in cl.list_artifacts(mid, "eval/step_000000")}
        assert {"config.yaml", "hist", "eval", "eval/step_000000/arith.json"} <= arts
        assert run.data.tags["run_id"] == rd.run_id and run.data.tags.get("mlflow.parentRunId")
    parents = mc.find_runs(cl, cl.get_experiment_by_name("clipbench").experiment_id, sweep="sw", role="sweep")
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


# ---- one step axis, bookkeeping as params, the same rows live and replayed ----------------------


@pytest.fixture(scope="module")
def shared_res(tmp_path_factory) -> Path:
    """One results dir (one embedded MLflow store: its tables are created once) for the tests below,
    each in its own sweep."""
    return tmp_path_factory.mktemp("mirror") / "results"


def loop_calls(rd: RunDir, sink, evals_at=(0, 3)) -> None:
    """Feed a sink exactly as the trainer does: each metrics row at its opt_step (numeric values), each
    evaluation as flat eval/<benchmark>/<stat> metrics at its rollout step."""
    rows = rd.read_metrics()
    evals = rd.read_evals()
    for k in sorted(set(evals) | {r["step"] + 1 for r in rows}):
        if k in evals and k in evals_at:
            flat = {f"eval/{b}/{s}": v for b, p in evals[k].items() for s, v in p["summary"].items()}
            sink.log_metrics(k, flat)
        for row in (r for r in rows if r["step"] == k):
            sink.log_metrics(row["opt_step"], trainer_row(row))


def trainer_row(row: dict) -> dict:
    """A stored row as the trainer passed it to the sink (NaN is stored as null)."""
    return {k: float("nan") if v is None else v for k, v in row.items() if v is None or isinstance(v, (int, float))}


def test_live_rows_equal_the_replayed_rows_with_bookkeeping_as_params(shared_res):
    res = shared_res
    rd = fake_run(res, "live", seed=0, steps=3, mb=2)
    rows = rd.read_metrics()
    for r in rows:
        r.update(epoch=0, old_logp_source=0)  # what the trainer also writes
    rd.metrics_path.unlink()
    rd.append_metrics(rows)
    sink = ms.run_sink(rd.read_config(), rd, results_dir=res, sweep="live", resume=False)
    loop_calls(rd, sink)
    sink.close("FINISHED")
    cl = client(res)
    run = cl.get_run(sink.mlflow_run_id)
    expected = expected_metrics(rd)
    assert set(run.data.metrics) == set(expected)
    for key, steps in expected.items():
        assert sorted(m.step for m in cl.get_metric_history(sink.mlflow_run_id, key)) == sorted(steps), key
    assert not {
        "step",
        "opt_step",
        "epoch",
        "mini_batch",
        "old_logp_source",
        "eval/arith/n",
        "eval/arith/num_problems",
    } & set(run.data.metrics)
    assert run.data.params["eval/arith/n"] == "2" and run.data.params["eval/arith/num_problems"] == "8"
    assert history(cl, sink.mlflow_run_id, "eval/arith/avg_at_2") == [(0, 0.0), (6, 0.125)]  # opt steps
    # and under verl's and TRL's names (tracking/aliases.py; docs/metrics.md)
    assert history(cl, sink.mlflow_run_id, "val-core/arith/reward/mean_at_2") == [(0, 0.0), (6, 0.125)]
    assert history(cl, sink.mlflow_run_id, "reward") == history(cl, sink.mlflow_run_id, "reward/mean")
    assert {"actor/grad_norm", "reward_std"} & set(run.data.metrics) == {"actor/grad_norm"}  # no reward/std here


def test_the_clip_fraction_and_others_under_the_names_verl_and_trl_log():
    """One optimizer step's row: 100 valid tokens (q1 30, q2 20, q3 25, q4 15, zero_adv 10), 6 of q1 past
    1 + eps_high and 4 of q3 below 1 - eps_low: the clip binds on 10 tokens, verl's pg_clipfrac and TRL's
    clip_ratio/region_mean 0.10, TRL's high_mean 6 / 100, low_mean 4 / 100 (q2's and q4's out-of-band
    tokens are not clipped by PPO's clip, so they count in neither)."""
    from clipbench.tracking.aliases import aliases

    row = {"q1/tokens": 30, "q2/tokens": 20, "q3/tokens": 25, "q4/tokens": 15, "zero_adv/tokens": 10}
    row |= {"q1/out_of_band": 6, "q2/out_of_band": 3, "q3/out_of_band": 4, "q4/out_of_band": 9}
    row |= {"entropy": 0.7, "grad_norm": None, "reward/mean": 0.25, "response_length/mean": 41.0}
    got = aliases(row)
    assert got["actor/pg_clipfrac"] == got["clip_ratio/region_mean"] == pytest.approx(0.10)
    assert got["clip_ratio/high_mean"] == pytest.approx(0.06) and got["clip_ratio/low_mean"] == pytest.approx(0.04)
    assert got["actor/entropy"] == 0.7 and math.isnan(got["actor/grad_norm"]) and got["reward"] == 0.25
    assert got["completions/mean_length"] == 41.0 and "reward_std" not in got
    assert aliases({"eval/aime24/avg@8": 0.3, "eval/aime24/pass@8": 0.5}) == {"val-core/aime24/reward/mean@8": 0.3}
    points, _ = mirror_points(0, {"eval/aime24/avg@8": 0.3}, lambda k: 0)
    assert sorted(points) == [("eval/aime24/avg_at_8", 0, 0.3), ("val-core/aime24/reward/mean_at_8", 0, 0.3)]


def test_a_store_written_before_avg_at_n_named_its_n_is_read_as_such(tmp_path):
    rd = fake_run(tmp_path, "sw", seed=0, steps=3, mb=2)
    p = rd.eval_path(3, "arith")
    payload = __import__("json").loads(p.read_text())
    payload["summary"]["avg@n"] = payload["summary"].pop("avg@2")
    p.write_text(__import__("json").dumps(payload))
    assert expected_metrics(rd)["eval/arith/avg_at_2"] == {0: 0.0, 6: 0.125}


def test_a_resumed_run_sends_what_the_store_has_and_mlflow_lacks(shared_res):
    """kill -9 with the server up: the sink's buffer (never flushed) is lost; the resumed run's sink
    sends at close everything the store holds and MLflow lacks, once."""
    res = shared_res
    rd = fake_run(res, "resumed", seed=0, steps=6, mb=2)
    config = {**rd.read_config(), "tracking": {**rd.read_config()["tracking"], "batch_every": 100}}
    s1 = ms.run_sink(config, rd, results_dir=res, sweep="resumed", resume=False)
    s1.log_params(run_params(config))
    loop_calls(rd, s1, evals_at=(0,))  # ... then SIGKILL: no flush, no close
    assert s1._buf and s1.n_metrics == 0
    s2 = ms.run_sink(config, rd, results_dir=res, sweep="resumed", resume=True)  # resumed from a checkpoint at step 2
    assert s2.mlflow_run_id == s1.mlflow_run_id
    for row in (r for r in rd.read_metrics() if r["step"] >= 2):
        s2.log_metrics(row["opt_step"], trainer_row(row))
    s2.close("FINISHED")
    cl = client(res)
    mid = s2.mlflow_run_id
    for key, steps in expected_metrics(rd).items():
        assert sorted(m.step for m in cl.get_metric_history(mid, key)) == sorted(steps), key  # each point once
    arts = {f.path for f in cl.list_artifacts(mid)} | {f.path for f in cl.list_artifacts(mid, "eval/step_000006")}
    assert {"config.yaml", "hist", "eval/step_000006/arith.json"} <= arts
    assert cl.get_run(mid).info.status == "FINISHED"
    rec = mc.recorded_mlflow_run(rd, default_tracking_uri(res))
    assert rec["offline"] is False and rec["needs_sync"] is False


def test_sync_keeps_names_and_times_and_closes_the_parent(shared_res):
    res = shared_res
    a, b = fake_run(res, "names", seed=0), fake_run(res, "names", seed=1)
    for rd, t0 in ((a, 1_700_000_000.0), (b, 1_700_000_100.0)):
        rd.set_status("finished", started=t0, finished=t0 + 42.5)
    manifest = {"sweep": "names", "created": "2023-11-14T22:00:00+00:00", "runs": {a.run_id: {}, b.run_id: {}}}
    (res / "names" / "manifest.json").write_text(__import__("json").dumps(manifest))
    uri = default_tracking_uri(res)
    ms.offline_sink(uri, a, "server down", run_name="nsr p=0.5 seed=0")  # the sweep ran offline: the name is kept
    sync_command("names", results_dir=res)
    cl = client(res)
    run = cl.get_run(mc.recorded_mlflow_run(a, uri)["run_id"])
    assert run.info.run_name == "nsr p=0.5 seed=0"
    assert (run.info.start_time, run.info.end_time) == (1_700_000_000_000, 1_700_000_042_500)  # not a 0.3 s run
    parent = mc.find_runs(cl, cl.get_experiment_by_name("clipbench").experiment_id, sweep="names", role="sweep")[0]
    assert parent.info.status == "FINISHED" and parent.info.run_name == "names"
    assert parent.info.start_time == 1_699_999_200_000  # the manifest's "created": 22:00:00 UTC = 1_700_000_000 - 800 s
    assert parent.info.end_time == 1_700_000_142_500  # the last run's end
    # a planned run that never ran: the sweep stopped early -> KILLED
    manifest["runs"]["never-ran0000"] = {}
    (res / "names" / "manifest.json").write_text(__import__("json").dumps(manifest))
    sync_command("names", results_dir=res)
    assert cl.get_run(parent.info.run_id).info.status == "KILLED"


def test_a_run_finds_or_creates_the_parent_when_the_sweep_started_offline(shared_res):
    res = shared_res
    rd = fake_run(res, "late", seed=0)
    sink = ms.run_sink(rd.read_config(), rd, results_dir=res, sweep="late", parent_run_id=None, resume=False)
    cl = client(res)
    exp = cl.get_experiment_by_name("clipbench").experiment_id
    (parent,) = mc.find_runs(cl, exp, sweep="late", role="sweep")
    assert cl.get_run(sink.mlflow_run_id).data.tags["mlflow.parentRunId"] == parent.info.run_id
    sink.close()
    ms.finish_parent_run(None, "FINISHED", uri=default_tracking_uri(res), sweep="late")
    assert cl.get_run(parent.info.run_id).info.status == "FINISHED"


def test_the_sync_hint_is_the_exact_command(tmp_path):
    from clipbench.tracking.mirror import sync_hint

    res = tmp_path / "my results"
    assert sync_hint("sw", res, default_tracking_uri(res)) == f"clipbench sync sw --results-dir '{res}'"
    assert sync_hint("sw", res, "http://host:5000") == (
        f"clipbench sync sw --results-dir '{res}' --tracking-uri http://host:5000"
    )


RACER = """
import sys, time
from clipbench.tracking.mlflow_client import client_for, get_or_create_experiment
import mlflow  # imported before the start line: the race is on opening the store, not on imports
uri, start = sys.argv[1], float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
c = client_for(uri)
run = c.create_run(get_or_create_experiment(c, "race", None))
c.log_metric(run.info.run_id, "m", 1.0, step=0)
"""


@pytest.mark.slow
def test_four_processes_opening_a_new_embedded_store_at_once(tmp_path):
    """Four processes (two sweeps, their workers) open a results dir's new sqlite store at the same
    moment: each gets a working client and the store is whole. Without the creation lock, 3 or 4 of
    the 4 failed on every try here ("duplicate column name: step", alembic's "Online migration expected
    to match one row", "table _alembic_tmp_metrics already exists") and the store was left half-migrated."""
    import subprocess
    import sys
    import time

    from clipbench.tracking.mlflow_client import client_for

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start = str(time.time() + 15)  # after every interpreter has imported mlflow
    procs = [
        subprocess.Popen([sys.executable, "-c", RACER, uri, start], stderr=subprocess.PIPE, text=True) for _ in range(4)
    ]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [e[-600:] for e in errs]
    client = client_for(uri)
    exp = client.get_experiment_by_name("race")
    assert len(client.search_runs([exp.experiment_id])) == 4
