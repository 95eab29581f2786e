"""Mixture-of-experts routing beyond metrics.jsonl: the report's routing section, and the routes in
`train.record` that `clipbench replay` routes its forwards by (docs/moe.md, docs/replay.md).

Fast: the routing section's numbers from metrics rows (golden arithmetic); no section without
routing metrics.
Slow (a sweep of 3 real recorded runs of builtin:arith-steps-moe, routing replay r2, r3 and none,
2 rollout steps of 4 optimizer steps): the r2/r3 records hold the replayed routes; the trained rule
replays every logged loss exactly; at the recorded states the parameter level's forward, routed by
the record, is training's (log-probs equal, gradient norm as logged) and is not without the routes
(none: the free forward is training's);
a record of r2 without its routes is refused in one line, an older one is noted; the report's
routing section adds up with the runs' metrics.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from clipbench.report.routing import label_routing, run_routing
from clipbench.report.routing_table import routing_table

REPO = Path(__file__).resolve().parent.parent
RECIPE = str(REPO / "recipes" / "arith_tiny.yaml")
MOE = "builtin:arith-steps-moe"
# test_moe.py's cheap MoE run (the steps task: rewards vary within groups), with a final evaluation
RUN = [
    f"model.name={MOE}",
    "task.format=steps",
    "task.operands=3",
    "sampler.max_new_tokens=32",
    "sampler.group_size=8",
    "train.prompts_per_step=4",
    "train.steps=2",
    "train.lr=1e-3",
    "train.checkpoint_every=1",
    "eval.every=0",
    "eval.limit=4",
    "eval.n=2",
    "tracking.mlflow=false",
]
RECORD = ["train.record.every=1", "train.record.state=last"]


# ---- fast: the section's arithmetic ----------------------------------------------------------------


def _row(step, changed, moved, kept, agree, maxvio):
    """A metrics row: per quadrant (moved tokens, moved out of band) and (kept tokens, kept out of band)."""
    r = {"step": step, "routing/changed_frac": changed, "routing/load_maxvio": maxvio}
    r.update({f"routing/agree/l{i}": a for i, a in enumerate(agree)})
    for q in ("q1", "q2", "q3", "q4"):
        (mt, mo), (kt, ko) = moved.get(q, (0, 0)), kept.get(q, (0, 0))
        r.update({f"experts_moved/{q}/tokens": mt, f"experts_moved/{q}/out_of_band": mo})
        r.update({f"experts_kept/{q}/tokens": kt, f"experts_kept/{q}/out_of_band": ko})
        r.update({f"{q}/tokens": mt + kt, f"{q}/out_of_band": mo + ko})
    return r


def test_the_routing_section_numbers_from_metrics_rows():
    rows = [
        # rollout step 0: its first optimizer step is on-policy (nothing moved) and is left out
        _row(0, 0.0, {}, {"q1": (10, 0)}, (1.0, 1.0), 0.5),
        _row(0, 0.4, {"q1": (4, 2)}, {"q1": (6, 1)}, (0.8, 0.7), 1.5),
        _row(1, 0.0, {}, {"q2": (20, 0)}, (1.0, 1.0), 0.2),
        _row(1, 0.2, {"q3": (2, 1)}, {"q3": (8, 0)}, (0.9, 0.9), 0.6),
    ]
    got = run_routing(rows)
    assert got["steps"] == 4 and got["off_policy_steps"] == 2 and got["tokens"] == 20  # 10 + 10
    assert got["moved"] == pytest.approx(100 * 6 / 20)  # (4 + 2) moved of 20
    assert got["moved_first"] == 0.0  # 0 of the first steps' 10 + 20 tokens
    assert got["agree"] == pytest.approx({"l0": 100 * (10 * 0.8 + 10 * 0.9) / 20, "l1": 100 * (7 + 9) / 20})
    assert got["load_maxvio"] == pytest.approx((0.5 + 1.5 + 0.2 + 0.6) / 4) and got["load_maxvio_max"] == 1.5
    s = got["split"]
    assert s["q1/moved"] == pytest.approx(50.0) and s["q1/kept"] == pytest.approx(100 / 6)  # 2/4, 1/6
    assert s["q3/moved"] == pytest.approx(50.0) and s["q3/kept"] == 0.0  # 1/2, 0/8
    assert math.isnan(s["q2/moved"]) and math.isnan(s["q4/kept"])  # no such token off-policy
    assert s["all/moved"] == pytest.approx(50.0) and s["all/kept"] == pytest.approx(100 / 14)  # 3/6, 1/14
    assert s["all/moved_tokens"] + s["all/kept_tokens"] == s["all/tokens"] == 20
    assert run_routing([{"step": 0, "q1/tokens": 3}]) is None

    class Run:
        def __init__(self, metrics):
            self.metrics = metrics

    both = label_routing([Run(rows), Run(rows[:2])])  # the second seed: rollout step 0 only
    assert both["seeds"] == 2 and both["moved"]["mean"] == pytest.approx((30 + 40) / 2)  # 6/20, 4/10
    t = routing_table({"m": {"grpo": both}}, None)
    assert t.rows[0][:4] == ["grpo", "2", "0.0", "35.0 ± 7.1"]  # sample std of 30, 40: 7.07
    assert t.notes[0].startswith("Reading: ") and "more often than" in t.notes[0]
    assert routing_table({}, None) is None


# ---- slow: real runs ---------------------------------------------------------------------------------


def _train(path: Path, *extra: str):
    from clipbench.config import load_run_config
    from clipbench.train.loop import run_training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_training(load_run_config(RECIPE, RUN + list(extra)), path)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """<root>/moe/<run_id> x 3: routing replay r2, r3 and none, each recorded."""
    from clipbench.config import load_run_config, run_id

    root = tmp_path_factory.mktemp("moe_report")
    for mode in ("r2", "r3", "none"):
        over = [f"model.routing_replay={mode}", *RECORD]
        _train(root / "moe" / run_id(load_run_config(RECIPE, RUN + over)), *over)
    return root


def _run(sweep: Path, mode: str) -> Path:
    from clipbench.tracking.store import RunDir

    (path,) = [
        p
        for p in (sweep / "moe").iterdir()
        if (p / "config.yaml").is_file() and RunDir(p).read_config()["model"]["routing_replay"] == mode
    ]
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["r2", "r3", "none"])
def test_a_moe_record_replays_its_losses_and_routes_its_forwards_as_training_did(sweep, mode):
    """r2, r3: the record holds the route table the update replayed, and the parameter level's forward
    routed by it is training's (routing freely is not: the routes had moved by the saved state);
    none: no routes, and the free forward is training's."""
    from clipbench.replay import params as P
    from clipbench.replay.rules import RuleSpec
    from clipbench.replay.tokens import OptStepView, replay_rule
    from clipbench.tracking.provenance import recorded_threads
    from clipbench.tracking.records import list_records, load_record
    from clipbench.tracking.store import RunDir

    run = _run(sweep, mode)
    logged = {r["opt_step"]: r for r in RunDir(run).read_metrics()}
    n = states = 0
    for path in list_records(run):
        record = load_record(path)
        routes = record.get("routes")
        assert record.index["routing_replay"] == mode
        if mode == "none":
            assert routes is None
        else:
            B, W = record.get("prompt_ids").shape[0], record.get("prompt_ids").shape[1] + record.get("mask").shape[1]
            assert routes.dtype == torch.int16 and tuple(routes.shape) == (B, 4, W, 2)  # rows x layers x columns x k
            assert int(routes.min()) >= 0 and int(routes.max()) <= 8  # expert + 1 (0: none)
        trained = RuleSpec.of("grpo", record.index["objective"]["params"])
        for opt in record.index["opt_steps"]:
            step = OptStepView(record, opt)
            assert replay_rule(step, trained).loss == logged[opt["opt_step"]]["loss"]  # exact
            n += 1
            state = P.load_state(record, opt)
            if state is None:
                continue
            states += 1
            assert logged[opt["opt_step"]]["routing/changed_frac"] > 0  # the routes had moved by then
            assert recorded_threads(run) == 1  # _train's; the replay's forward runs on it (replay/run.py)
            with P.threads(recorded_threads(record.run_dir)):
                grads, diff = P.param_gradients(state, step, {"grpo": replay_rule(step, trained)})
            assert diff == 0.0  # training's forward (r2, r3: routed by the record)
            assert P.global_norm(grads["grpo"]) == pytest.approx(logged[opt["opt_step"]]["grad_norm"], rel=1e-5)
            if mode != "none":
                state.routes = None  # free routing: another forward (the replay before routes were recorded)
                with P.threads(1):
                    _, free = P.param_gradients(state, step, {"grpo": replay_rule(step, trained)})
                assert free > 1e-4, free
    assert n == 8 and states == 2  # 2 rollout steps x 4 optimizer steps; state: last


@pytest.mark.slow
def test_a_moe_record_without_its_routes_is_refused_or_noted_in_one_line(sweep, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from clipbench.errors import StoreError
    from clipbench.replay.rules import parse_rules
    from clipbench.replay.run import replay_runs

    run = tmp_path / "run"
    shutil.copytree(_run(sweep, "r2"), run)
    rec = run / "record" / "step_000000"
    tensors = load_file(str(rec / "tensors.safetensors"))
    del tensors["routes"]
    save_file(tensors, str(rec / "tensors.safetensors"), metadata={"format": "1"})
    with pytest.raises(StoreError) as e:
        replay_runs([run], parse_rules("grpo"), opt_steps={4})
    assert "routes" in str(e.value) and "step_000000" in str(e.value) and "\n" not in str(e.value)
    assert len(replay_runs([run], parse_rules("grpo"), opt_steps={4}, params=False).rows) == 1  # token level
    index = json.loads((rec / "index.json").read_text())
    del index["routing_replay"]  # a record from before routes were recorded
    (rec / "index.json").write_text(json.dumps(index))
    res = replay_runs([run], parse_rules("grpo"), opt_steps={4})
    (note,) = [n for n in res.notes if "routes" in n]
    assert "1 record(s) (step_000000)" in note and "routes freely" in note
    assert res.rows[0]["state/logp_max_abs_diff"] > 1e-4  # and it shows


@pytest.mark.slow
def test_clipbench_replay_forwards_on_the_runs_thread_count(sweep):
    """The runs trained on 1 thread; the replay, asked on 2, runs its parameter level on the run's 1 and
    gives training's log-probs bit for bit (on 2 threads the summation order differs: CI saw 2^-20)."""
    from clipbench.replay.rules import parse_rules
    from clipbench.replay.run import replay_runs

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        res = replay_runs([_run(sweep, "r2"), _run(sweep, "none")], parse_rules("grpo"), opt_steps={4, 8})
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(threads)
    diffs = [r["state/logp_max_abs_diff"] for r in res.rows if "state/logp_max_abs_diff" in r]
    assert len(diffs) == 4 and diffs == [0.0] * 4, diffs  # r2 and none, each at its 2 saved states


@pytest.mark.slow
def test_the_report_has_a_routing_section_that_adds_up_with_the_runs_metrics(sweep, tmp_path):
    import json

    from clipbench.report.build import build_report, write_report
    from clipbench.report.routing import off_policy_rows
    from clipbench.tracking.store import RunDir

    root = tmp_path / "results"  # without the record: the report's replay section (every rule) is replay's
    shutil.copytree(sweep, root, ignore=shutil.ignore_patterns("record"))
    s, result, tables, header = build_report(root, "moe", baseline=None)
    written = write_report(s, result, tables, header, "markdown", tmp_path / "rep")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Mixture-of-experts routing" in md and "Reading: " in md
    (t,) = [t for t in tables if t.key == "routing"]
    assert len(t.rows) == 3
    routing = json.loads((tmp_path / "rep" / "report.json").read_text())["routing"]
    (labels,) = routing.values()
    assert len(labels) == 3 and tmp_path / "rep" / "report.json" in written
    for run in (root / "moe").iterdir():
        if not (run / "config.yaml").is_file():
            continue
        rows = RunDir(run).read_metrics()
        mode = RunDir(run).read_config()["model"]["routing_replay"]
        (e,) = [e for lb, e in labels.items() if mode in lb]
        off = off_policy_rows(rows)
        assert e["seeds"] == 1 and len(off) == 6  # 2 rollout steps x (4 - 1) optimizer steps
        assert e["moved_first"]["mean"] == 0.0  # none, r2: the old forward; r3: the sampler's routes, the same here
        split = e["split"]
        for q in ("q1", "q2", "q3", "q4", "all"):  # moved + kept = the quadrant's tokens
            assert (
                split[f"{q}/moved_tokens"]["mean"] + split[f"{q}/kept_tokens"]["mean"] == split[f"{q}/tokens"]["mean"]
            )
        cells = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
        moved = sum(r[f"experts_moved/{c}/tokens"] for r in off for c in cells)
        tokens = sum(r[f"{c}/tokens"] for r in off for c in cells)
        assert e["moved"]["mean"] == pytest.approx(100 * moved / tokens) and 0 < e["moved"]["mean"] < 100
        oob = sum(r["experts_moved/q1/out_of_band"] + r["experts_moved/q4/out_of_band"] for r in off)
        n = sum(r["experts_moved/q1/tokens"] + r["experts_moved/q4/tokens"] for r in off)
        assert n > 0 and oob <= n  # ratios above 1 among the moved tokens
        assert e["load_maxvio_max"]["mean"] == max(r["routing/load_maxvio"] for r in rows)
