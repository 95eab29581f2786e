"""Recording (train.record) and counterfactual replay (clipbench replay, docs/replay.md).

Fast: rule specs and grids; the engines' table of the new keys; recording is outside the run id; a
loss hook's record (LossRecorder: TRL's and verl's format) replays its own losses exactly, draws
included.
Slow (real training runs of the tiny model, 2 rollout steps, 2 epochs, micro-batches that split):
the trained rule replays every logged loss and quadrant count exactly and its gradient norm to
float32 round-off; the lookahead of the trained rule lands on the next recorded state; recording
changes nothing the run computes; a resumed run's records equal an uninterrupted run's; the budget;
the CLI's JSON lines; the report's replay section.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clipbench.config import load_run_config, run_id
from clipbench.errors import UserError
from clipbench.objectives import policy_loss
from clipbench.replay.rules import RuleSpec, parse_rules
from clipbench.replay.tokens import OptStepView, replay_rule
from clipbench.tracking.records import list_records, load_record

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "arith_tiny.yaml"
# 2 prompts x 4 samples, 2 mini-batches x 2 epochs, a 24-token budget: 2-3 micro-batches per step
SMALL = [
    "train.prompts_per_step=2",
    "sampler.group_size=4",
    "sampler.max_new_tokens=8",
    "train.steps=2",
    "train.epochs=2",
    "train.mini_batches=2",
    "train.micro_batch_tokens=24",
    "train.checkpoint_every=1",
    "train.lr=2e-3",
    "eval.limit=4",
    "eval.n=2",
    "eval.every=0",
    "tracking.mlflow=false",
    "objective.method=nsr",
]
RECORD = ["train.record.every=1", "train.record.state=all"]


# ---- fast ---------------------------------------------------------------------------------------


def test_rule_specs_grids_and_labels():
    rules = parse_rules("grpo,dapo(eps_high=0.28,0.4),nsr(p=0.25,0.75, delta=0.1)")
    assert [r.label for r in rules] == ["grpo", "dapo", "dapo(eps_high=0.4)", "nsr(p=0.25)", "nsr(p=0.75)"]
    assert rules[2].kwargs == {"eps_low": 0.2, "eps_high": 0.4}
    assert len(parse_rules("all")) == len(parse_rules(None)) >= 23
    assert parse_rules("grpo,grpo(eps_low=0.2)") == [RuleSpec.of("grpo", {})]  # same rule once
    for bad, why in (
        ("grpoo", "did you mean"),
        ("dapo(eps_hgh=0.3)", "eps_high"),
        ("dapo(eps_high=x)", "number"),
        ("dapo(0.3)", "parameter name"),
        ("dapo(eps_high=0.3", "unbalanced"),
    ):
        with pytest.raises(UserError, match=why):
            parse_rules(bad)


def test_record_keys_have_an_entry_for_every_engine_and_stay_out_of_the_run_id():
    from clipbench.config.schema import leaf_keys
    from clipbench.engines.keys import KEYS, refusals

    keys = [k for k in leaf_keys() if k.startswith("train.record.")]
    assert keys == ["train.record.every", "train.record.state", "train.record.max_mb"]
    assert all(k in KEYS[e] for e in KEYS for k in keys)
    plain = load_run_config(RECIPE)
    recorded = load_run_config(RECIPE, ["train.record.every=5", "train.record.state=all", "train.record.max_mb=7"])
    assert run_id(plain) == run_id(recorded)  # recording observes a run: the same run
    assert [k for k, _ in refusals(recorded, "builtin")] == []
    assert [k for k, _ in refusals(recorded, "trl")] == ["train.record.state"]  # TRL records no policy state
    assert [k for k, _ in refusals(recorded, "verl")] == ["train.record.every", "train.record.state"]
    assert [k for k, _ in refusals(load_run_config(RECIPE, ["train.record.every=1"]), "verl")] == []


def test_a_loss_hooks_record_replays_its_losses_exactly_draws_included(tmp_path):
    """LossRecorder (the TRL and verl hooks' writer): 3 micro-batches of nsr in 2 optimizer steps with
    the hook's own uniforms and global counts; the replay of the trained rule gives each step's summed
    hook loss bit for bit, and other draws give other losses."""
    from clipbench.integrations.record import LossRecorder

    g = torch.Generator().manual_seed(0)
    params = {"eps_low": 0.2, "eps_high": 0.28, "delta": 0.1, "p": 0.5}
    meta = {
        "engine": "trl",
        "seed": 3,
        "objective": {"method": "nsr", "params": params, "agg": "token-mean", "beta": 0.0, "max_len": 9},
    }
    rec = LossRecorder(tmp_path / "record", max_mb=10, meta=meta)
    expected = {}
    for opt_step, b, w in ((1, 3, 7), (1, 2, 9), (2, 4, 5)):
        lens = torch.randint(1, w + 1, (b,), generator=g)
        mask = (torch.arange(w) < lens[:, None]).float()
        old = -torch.rand(b, w, generator=g) * 3 * mask
        logp = old + 0.4 * torch.randn(b, w, generator=g) * mask  # ratios well off 1: clipping and rescues
        adv, u = torch.randn(b, generator=g), torch.rand(b, w, generator=g)
        out = policy_loss("nsr", logp, old, adv, mask, uniforms=u, global_tokens=11.0, global_seqs=5.0, **params)
        expected[opt_step] = expected.get(opt_step, 0.0) + float(out.loss)
        rec.add(
            opt_step,
            0,
            {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask, "uniforms": u},
            11.0,
            5.0,
            out.loss,
        )
    rec.write(0)
    (path,) = list_records(tmp_path)
    record = load_record(path)
    trained = RuleSpec.of("nsr", params)
    for opt in record.index["opt_steps"]:
        step = OptStepView(record, opt)
        assert replay_rule(step, trained).loss == pytest.approx(expected[opt["opt_step"]], rel=1e-6)
        assert opt["hook_loss"] == pytest.approx(expected[opt["opt_step"]], rel=1e-6)
        assert replay_rule(step, trained, draw=1).loss != replay_rule(step, trained).loss  # fresh coin flips


# ---- slow: real runs ------------------------------------------------------------------------------


def _train(path: Path, *extra: str, progress=None, resume: bool = False):
    from clipbench.train.loop import run_training

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_training(load_run_config(RECIPE, SMALL + list(extra)), path, resume=resume, progress=progress)
    finally:  # the other test files of this worker keep their thread count
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A finished recorded run in a results store: <root>/rec/<run_id>/."""
    root = tmp_path_factory.mktemp("replay")
    cfg = load_run_config(RECIPE, SMALL + RECORD)
    path = root / "rec" / run_id(cfg)
    _train(path, *RECORD)
    return path


@pytest.mark.slow
def test_the_trained_rule_replays_every_logged_loss_and_count_exactly(recorded):
    from clipbench.tracking.store import RunDir

    rd = RunDir(recorded)
    logged = {r["opt_step"]: r for r in rd.read_metrics()}
    assert rd.status()["records"] == [0, 1]
    n = 0
    for path in list_records(recorded):
        record = load_record(path)
        assert record.get("uniforms") is not None  # nsr draws: its draws are recorded
        for opt in record.index["opt_steps"]:
            assert max(len(rank) for rank in opt["ranks"]) >= 2  # the micro-batches really split
            res = replay_rule(OptStepView(record, opt), RuleSpec.of("nsr", record.index["objective"]["params"]))
            row = logged[opt["opt_step"]]
            assert res.loss == row["loss"]  # exact: the same float32 terms summed in the same order
            for key, v in res.stats.items():
                if key.split("/")[-1] in ("tokens", "out_of_band", "zero_grad", "rescued", "in_band_near"):
                    assert v == row[key], key
            n += 1
    assert n == 8  # 2 rollout steps x 2 epochs x 2 mini-batches


@pytest.mark.slow
def test_parameter_level_gradient_norm_and_lookahead_reproduce_training(recorded):
    """The trained rule's parameter gradient at the recorded state has the logged norm (float32
    round-off), and one AdamW step with it lands on the next recorded state's weights."""
    from clipbench.replay import params as P
    from clipbench.tracking.store import RunDir

    logged = {r["opt_step"]: r for r in RunDir(recorded).read_metrics()}
    record = load_record(list_records(recorded)[0])
    trained = RuleSpec.of("nsr", record.index["objective"]["params"])
    opts = record.index["opt_steps"]
    for opt, nxt in zip(opts, opts[1:]):
        step = OptStepView(record, opt)
        state = P.load_state(record, opt)
        grads, diff = P.param_gradients(state, step, {"nsr": replay_rule(step, trained)})
        assert diff == 0.0  # the same forward as training, on the same machine
        assert P.global_norm(grads["nsr"]) == pytest.approx(logged[opt["opt_step"]]["grad_norm"], rel=1e-5)
        P.lookahead(state, step, grads["nsr"])  # leaves the model at the saved state
        params = [p for p in state.model.parameters()]
        for p, g in zip(params, grads["nsr"]):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(params, state.grad_clip)
        state.optimizer.step()
        after = P.load_state(record, nxt).model.state_dict()
        for name, w in state.model.state_dict().items():
            torch.testing.assert_close(w, after[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_the_lookahead_at_another_learning_rate(recorded):
    """Issue 36: each rule's look-ahead at its own tuned rate (`clipbench replay --lr`). AdamW's step from
    a recorded state is linear in the rate (lr x (m_hat / (sqrt(v_hat) + eps) + wd x theta)), so at the
    recorded rate it is the default look-ahead exactly; and for small steps (1/1000 and 1/500 of the
    recorded rate) the KL is quadratic in the step to leading order, so doubling the rate makes it
    about 4x (measured 3.94; 3.5-4.5x allowed for the next order)."""
    from clipbench.replay import params as P

    record = load_record(list_records(recorded)[0])
    opt = record.index["opt_steps"][0]
    step = OptStepView(record, opt)
    state = P.load_state(record, opt)
    grads, _ = P.param_gradients(
        state, step, {"nsr": replay_rule(step, RuleSpec.of("nsr", record.index["objective"]["params"]))}
    )
    lr = state.optimizer.param_groups[0]["lr"]
    same = P.lookahead(state, step, grads["nsr"])
    assert same["lookahead/lr"] == lr and P.lookahead(state, step, grads["nsr"], lr=lr) == same
    small, double = (P.lookahead(state, step, grads["nsr"], lr=f * lr) for f in (0.001, 0.002))
    assert double["lookahead/lr"] == 0.002 * lr and 3.5 < double["lookahead/kl"] / small["lookahead/kl"] < 4.5
    assert state.optimizer.param_groups[0]["lr"] == lr  # the recorded state is restored


def test_replay_lr_names_rules_of_rules_and_rates_in_range():
    from clipbench.commands.replay import parse_rates
    from clipbench.replay.rules import parse_rules

    specs = parse_rules("grpo,cispo,dapo(eps_high=0.3,0.4)")
    assert parse_rates("cispo=1e-4, grpo=2e-4", specs) == {"cispo": 1e-4, "grpo": 2e-4}
    assert parse_rates("dapo(eps_high=0.4)=3e-4", specs) == {"dapo(eps_high=0.4)": 3e-4}
    for text, message in (
        ("cispoo=1e-4", "--lr: unknown rule of --rules 'cispoo'"),
        ("dapo=1e-4", "--lr: 'dapo' names 2 rules of --rules (dapo(eps_high=0.3), dapo(eps_high=0.4))"),
        ("cispo", "--lr: 'cispo' is not RULE=RATE"),
        ("cispo=fast", "--lr: 'cispo=fast': 'fast' is not a number"),
        ("cispo=2", "--lr: 'cispo=2': a learning rate in (0, 1], got 2"),
    ):
        with pytest.raises(UserError) as e:
            parse_rates(text, specs)
        assert str(e.value).startswith(message), str(e.value)


@pytest.mark.slow
def test_recording_changes_nothing_the_run_computes(recorded, tmp_path):
    from clipbench.tracking.store import RunDir

    _train(tmp_path / "plain")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert strip(RunDir(tmp_path / "plain").read_metrics()) == strip(RunDir(recorded).read_metrics())
    assert not (tmp_path / "plain" / "record").exists()


@pytest.mark.slow
def test_a_resumed_run_records_what_an_uninterrupted_one_does(recorded, tmp_path):
    class Stop(Exception):
        pass

    def stop(ev):
        if ev["step"] == 2:  # rollout step 1 logged (its record written), its checkpoint not yet
            raise Stop

    with pytest.raises(Stop):
        _train(tmp_path / "cut", *RECORD, progress=stop)
    assert [p.name for p in list_records(tmp_path / "cut")] == ["step_000000", "step_000001"]
    _train(tmp_path / "cut", *RECORD, resume=True)  # from the checkpoint after step 0: step 1 again
    for a, b in zip(list_records(tmp_path / "cut"), list_records(recorded), strict=True):
        ra, rb = load_record(a), load_record(b)
        assert ra.index == {**rb.index} and ra.tensors.keys() == rb.tensors.keys()
        for k in ra.tensors:
            assert torch.equal(ra.tensors[k], rb.tensors[k]), k


@pytest.mark.slow
def test_the_record_budget_stops_recording_with_a_note(tmp_path):
    from clipbench.tracking.store import RunDir

    _train(tmp_path / "run", "train.record.every=1", "train.record.max_mb=1", "train.record.state=all")
    st = RunDir(tmp_path / "run").status()
    assert list_records(tmp_path / "run") == [] and "train.record.max_mb=1" in st["record_note"]


@pytest.mark.slow
def test_a_lagged_run_whose_ratio_is_the_samplers_records_and_replays_exactly(tmp_path):
    """sampler.old_logp: sampler makes old_logp the sampler's log-probs themselves (one tensor): the
    record keeps both names (safetensors refuses a storage under two names), and the trained rule
    replays every logged loss of the lagged run exactly."""
    from clipbench.tracking.store import RunDir

    _train(
        tmp_path / "run", "train.record.every=1", "train.record.state=none", "sampler.old_logp=sampler", "sampler.lag=1"
    )
    logged = {r["opt_step"]: r for r in RunDir(tmp_path / "run").read_metrics()}
    records = list_records(tmp_path / "run")
    assert len(records) == len({r["step"] for r in logged.values()})
    rec = load_record(records[-1])
    assert torch.equal(rec.tensors["old_logp"], rec.tensors["sampler_logp"])
    for opt in rec.index["opt_steps"]:
        res = replay_rule(
            OptStepView(rec, opt), RuleSpec.of(rec.index["objective"]["method"], rec.index["objective"]["params"])
        )
        assert res.loss == logged[opt["opt_step"]]["loss"]


@pytest.mark.slow
def test_cli_replay_json_lines_and_report(recorded, tmp_path):
    env_py = [sys.executable, "-m", "clipbench"]
    out = subprocess.run(
        [
            *env_py,
            "replay",
            str(recorded),
            "--rules",
            "grpo,dapo(eps_high=0.28,0.4),nsr",
            "--json",
            "--draws",
            "2",
            "--no-params",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 8 * 4  # 8 optimizer steps x (nsr trained + grpo + 2 dapo)
    for row in rows:
        for key in (
            "opt_step",
            "rule",
            "trained",
            "loss",
            "grad_cosine",
            "q1/out_of_band",
            "q1/zero_grad",
            "q4/rescued",
            "q2/tokens",
        ):
            assert key in row, key
    trained = [r for r in rows if r["trained"]]
    assert {r["rule"] for r in trained} == {"nsr"} and all(r["grad_cosine"] == 1.0 for r in trained)
    assert all(r["loss"] == r["logged/loss"] and r["draws"] == 2 for r in trained)
    bad = subprocess.run(
        [*env_py, "replay", str(recorded), "--rules", "nope"], capture_output=True, text=True, cwd=REPO
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nope" in bad.stderr

    rep = subprocess.run(
        [
            *env_py,
            "report",
            "rec",
            "--results-dir",
            str(recorded.parent.parent),
            "--format",
            "markdown",
            "--out",
            str(tmp_path / "rep"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert rep.returncode == 0, rep.stderr[-2000:]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Replay vs nsr" in md and "one optimizer step ahead" in md and "replay_zero_grad.png" in md
    own = subprocess.run(
        [*env_py, "replay", str(recorded), "--rules", "grpo,abc", "--format", "html", "--out", str(tmp_path / "own")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert own.returncode == 0, own.stderr[-2000:]
    assert "Replay vs nsr" in (tmp_path / "own" / "replay.html").read_text()


@pytest.mark.slow
def test_records_without_their_index_are_called_damaged_not_missing(recorded, tmp_path):
    """Issue 28 item 6: a record with no index.json is skipped with a note; all of them: refused as damaged."""
    import shutil

    from clipbench.replay.rules import parse_rules
    from clipbench.replay.run import replay_runs

    run = tmp_path / "rec" / recorded.name
    shutil.copytree(recorded, run)
    steps = sorted((run / "record").glob("step_*"))
    (steps[0] / "index.json").unlink()
    res = replay_runs([run], parse_rules("grpo"), params=False)
    assert [n for n in res.notes if "damaged record skipped" in n and steps[0].name in n]
    for d in steps[1:]:
        (d / "index.json").unlink()
    out = subprocess.run(
        [sys.executable, "-m", "clipbench", "replay", str(run), "--rules", "grpo"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "damaged record" in out.stderr and "index.json" in out.stderr and "train.record.every" not in out.stderr


@pytest.mark.slow
def test_a_record_of_another_rule_is_refused_in_one_line(recorded, tmp_path):
    """Issue 28 item 6: a record whose index claims another rule than the run's config is not replayed."""
    import shutil

    run = tmp_path / "rec" / recorded.name
    shutil.copytree(recorded, run)
    index = sorted((run / "record").glob("step_*"))[-1] / "index.json"
    data = json.loads(index.read_text())
    data["objective"]["method"] = "grpo" if data["objective"]["method"] != "grpo" else "dapo"
    index.write_text(json.dumps(data))
    out = subprocess.run(
        [sys.executable, "-m", "clipbench", "replay", str(run), "--rules", "grpo"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "not this run's record" in out.stderr and index.parent.name in out.stderr


def _replay_cli(run: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clipbench", "replay", str(run), "--rules", "grpo", *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["shifted", "twice"])
def test_records_whose_opt_steps_are_not_the_runs_are_refused(recorded, tmp_path, damage):
    """Issue 28 item 6: shifted or out-of-range opt_step values paired rows with the wrong logged
    loss; the same step in two records gave duplicate keys. Both are refused in one line, exit 2."""
    import shutil

    run = tmp_path / "rec" / recorded.name
    shutil.copytree(recorded, run)
    first, last = (sorted((run / "record").glob("step_*"))[i] / "index.json" for i in (0, -1))
    data = json.loads(last.read_text())
    if damage == "shifted":
        for opt in data["opt_steps"]:
            opt["opt_step"] += 1000
    else:
        data["opt_steps"][0]["opt_step"] = json.loads(first.read_text())["opt_steps"][0]["opt_step"]
    last.write_text(json.dumps(data))
    out = _replay_cli(run)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    want = "is not an optimizer step the run logged" if damage == "shifted" else "is recorded twice"
    assert want in out.stderr and last.parent.name in out.stderr


@pytest.mark.slow
def test_a_truncated_saved_policy_state_is_one_line(recorded, tmp_path):
    """Issue 28 item 6: a truncated saved policy state gave an 87-line traceback."""
    import shutil

    run = tmp_path / "rec" / recorded.name
    shutil.copytree(recorded, run)
    shards = sorted((run / "record").rglob("*.distcp"))
    assert shards
    for f in shards:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    out = _replay_cli(run)
    last = out.stderr.strip().splitlines()[-1]  # after the progress lines of the steps replayed before it
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert last.startswith("error: ") and "the saved policy state does not load (RuntimeError: " in last


def test_replay_rules_and_rates_from_the_sweep(tmp_path):
    """`--rules sweep --lr sweep` (issue 36): every rule the target's runs trained, each at its rate."""
    import yaml

    from clipbench.commands.replay import sweep_rates, trained_settings

    runs = []
    for i, (obj, lr) in enumerate(
        [
            ({"method": "grpo"}, 2e-4),
            ({"method": "cispo"}, 1e-4),
            ({"method": "grpo"}, 2e-4),
            ({"method": "dapo", "eps_high": 0.3}, 4e-4),
        ]
    ):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump({"seed": i, "objective": obj, "train": {"lr": lr}}))
        runs.append(d)
    settings = trained_settings(runs)
    assert [(s.label, lr) for s, lr in settings] == [("grpo", 2e-4), ("cispo", 1e-4), ("dapo(eps_high=0.3)", 4e-4)]
    assert sweep_rates(settings, "s") == {"grpo": 2e-4, "cispo": 1e-4, "dapo(eps_high=0.3)": 4e-4}
    with pytest.raises(UserError, match=r"--lr sweep: rule grpo trained at 2 rates in s \(0.0001, 0.0002\)"):
        sweep_rates([*settings, (settings[0][0], 1e-4)], "s")


@pytest.mark.slow
def test_a_sweeps_replay_is_of_its_finished_runs_and_names_the_others(recorded, tmp_path):
    """A sweep's runs still training have records of part of their steps and write more while the
    replay reads: `clipbench replay SWEEP` (and the report's replay section) read its finished runs
    and name the others; before, they were replayed with the finished ones without a word."""
    import shutil

    sweep = tmp_path / "rec"
    shutil.copytree(recorded, sweep / recorded.name)
    running = sweep / ("0" * len(recorded.name))
    shutil.copytree(recorded, running)
    status = json.loads((running / "status.json").read_text())
    (running / "status.json").write_text(json.dumps({**status, "state": "running"}))

    out = subprocess.run(
        [sys.executable, "-m", "clipbench", "replay", "rec", "--results-dir", str(tmp_path), "--rules", "grpo",
         "--no-params", "--format", "markdown", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "out" / "replay.md").read_text()
    assert "'rec': 1 run(s) with records, 8 optimizer steps" in md  # the finished run's 8, not 16
    assert f"left out: 1 run(s) with records that have not finished (running 1: {running.name})" in md

    from clipbench.report.load import load_results
    from clipbench.report.replay import sweep_replay

    summary = sweep_replay(load_results(tmp_path, "rec"), "grpo")
    assert [r["runs"] for r in summary["references"]] == [[recorded.name]]
    assert any(f"running 1: {running.name}" in n for n in summary["notes"])

    shutil.rmtree(sweep / recorded.name)  # only the running run has records: one line, exit 2
    only = subprocess.run(
        [sys.executable, "-m", "clipbench", "replay", "rec", "--results-dir", str(tmp_path), "--no-params"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert only.returncode == 2 and only.stderr.count("\n") == 1, only.stderr[-2000:]
    assert "no finished run has records yet" in only.stderr and running.name in only.stderr
    alone = _replay_cli(running, "--no-params", "--format", "markdown", "--out", str(tmp_path / "alone"))
    assert alone.returncode == 0, alone.stderr[-2000:]  # a run named on its own: as it stands, said
    assert "running: its records cover the steps it has run so far" in (tmp_path / "alone" / "replay.md").read_text()


@pytest.mark.slow
def test_report_no_replay_leaves_the_section_to_clipbench_replay_and_says_so(recorded, tmp_path):
    rep = subprocess.run(
        [sys.executable, "-m", "clipbench", "report", "rec", "--results-dir", str(recorded.parent.parent),
         "--no-replay", "--format", "markdown", "--out", str(tmp_path / "rep")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert rep.returncode == 0, rep.stderr[-2000:]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Replay vs" not in md and "replay_zero_grad.png" not in md
    assert "the runs' records were not replayed (--no-replay): `clipbench replay rec` writes that section" in md


@pytest.mark.slow
def test_a_deleted_record_is_named_and_the_replay_marked_partial(recorded, tmp_path):
    """A record the run wrote (status.json lists it) deleted: the replay replayed the other steps with
    no word (8 optimizer steps of 12, every number different). Now its first line says PARTIAL and
    names the rollout step and its optimizer steps; --json says it on stderr."""
    import shutil

    run = tmp_path / "rec" / recorded.name
    shutil.copytree(recorded, run)
    shutil.rmtree(run / "record" / "step_000001")  # rollout step 1: optimizer steps 5 to 8 (2 x 2 per step)
    line = (
        f"PARTIAL: this replay lacks recorded steps ({run.name}: the record(s) of rollout step(s) 1 are missing "
        f"from {run / 'record'} (status.json lists them): optimizer steps 5, 6, 7, 8 are not replayed); its "
        "numbers are of the other steps only."
    )
    out = _replay_cli(run, "--no-params", "--out", str(tmp_path / "rep"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert " ".join(out.stdout.split()).startswith(line)
    assert line in (tmp_path / "rep" / "replay.md").read_text()
    js = _replay_cli(run, "--no-params", "--json")
    assert js.returncode == 0 and f"warning: {line}" in js.stderr
    assert sorted({json.loads(r)["opt_step"] for r in js.stdout.splitlines()}) == [1, 2, 3, 4]
