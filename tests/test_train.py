"""The GRPO loop on the real tiny model: packing, on/off-policy ratios, resume, skipped steps, errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clipbench.config import load_run_config
from clipbench.models import load_model_and_tokenizer, resolve_model_name
from clipbench.tracking.store import RunDir
from clipbench.train.logprobs import completion_logprobs
from clipbench.train.loop import run_training
from clipbench.train.packing import pack

pytestmark = pytest.mark.slow  # real training runs

RECIPE = "recipes/arith_tiny.yaml"  # the answer-only regime: the fastest real runs
# A few seconds per run: 4 prompts x 4 samples, short answers, no MLflow.
SMALL = [
    "train.prompts_per_step=4",
    "sampler.group_size=4",
    "sampler.max_new_tokens=8",
    "eval.limit=8",
    "eval.n=2",
    "eval.every=0",
    "tracking.mlflow=false",
]


def small_cfg(*extra):
    return load_run_config(RECIPE, SMALL + list(extra))


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer(resolve_model_name("builtin:arith-tiny"))


def test_packed_logprobs_equal_each_sequence_alone(tiny):
    """Left-padded prompts + right-padded completions with real-token position ids give the same
    log-probs as running every sequence on its own, unpadded (so padding never leaks in)."""
    model, tok = tiny
    prompts = [tok("12+7=")["input_ids"], tok("3-45=")["input_ids"], tok("99+99=")["input_ids"]]
    completions = [tok("19")["input_ids"] + [tok.eos_token_id], [tok.eos_token_id], tok("-42")["input_ids"]]
    batch = pack(prompts, completions, tok.pad_token_id)
    assert batch.input_ids.shape[1] == max(map(len, prompts)) + max(map(len, completions))
    with torch.no_grad():
        logp, ent = completion_logprobs(model, batch)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            alone = pack([p], [c], tok.pad_token_id)
            lp1, ent1 = completion_logprobs(model, alone)
            n = len(c)
            assert torch.allclose(logp[i, :n], lp1[0, :n], atol=1e-5), i
            assert torch.allclose(ent[i, :n], ent1[0, :n], atol=1e-5), i
            assert batch.completion_mask[i].sum() == n
    # temperature divides the logits: log-probs change, and still match a direct computation
    with torch.no_grad():
        lp_t, _ = completion_logprobs(model, batch, temperature=0.5, with_entropy=False)
        full = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits
        T = batch.completion_ids.shape[1]
        direct = (full[:, -T - 1 : -1] / 0.5).log_softmax(-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    m = batch.completion_mask.bool()
    assert torch.allclose(lp_t[m], direct[m], atol=1e-5)


def test_single_minibatch_is_on_policy_every_ratio_is_one(tmp_path):
    run_training(
        small_cfg("train.mini_batches=1", "train.epochs=1", "train.steps=3", "eval.benchmarks=[]"), tmp_path / "run"
    )
    rows = RunDir(tmp_path / "run").read_metrics()
    assert len(rows) == 3
    for r in rows:
        assert abs(r["ratio/max"] - 1) < 1e-6 and abs(r["ratio/min"] - 1) < 1e-6, r
        assert r["clip_events"] == 0 and r["q1/tokens"] + r["q2/tokens"] + r["q3/tokens"] + r["q4/tokens"] == 0


def test_minibatches_make_later_updates_off_policy_with_clip_events(tmp_path):
    run_training(
        small_cfg("train.mini_batches=4", "train.steps=4", "train.lr=5e-4", "eval.benchmarks=[]"), tmp_path / "run"
    )
    rows = RunDir(tmp_path / "run").read_metrics()
    assert len(rows) == 16  # 4 steps x 4 mini-batches
    first = [r for r in rows if r["mini_batch"] == 0]
    later = [r for r in rows if r["mini_batch"] > 0]
    for r in first:  # the first update of each rollout batch is on-policy
        assert abs(r["ratio/max"] - 1) < 1e-6 and abs(r["ratio/min"] - 1) < 1e-6
    # off-policy once an earlier step of the same rollout batch moved the policy (a mini-batch of
    # all-equal groups has zero gradient and leaves it where it was)
    moved = [
        r
        for r in later
        if any(q["grad_norm"] > 0 for q in rows if q["step"] == r["step"] and q["mini_batch"] < r["mini_batch"])
    ]
    assert len(moved) >= 6 and all(r["ratio/max"] - r["ratio/min"] > 1e-4 for r in moved)
    assert sum(r["clip_events"] for r in later) > 0
    cells = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
    for r in rows:  # every valid token is in exactly one cell
        assert sum(r[f"{c}/tokens"] for c in cells) > 0


def test_resume_replays_an_uninterrupted_run_exactly(tmp_path):
    cfg = small_cfg("train.steps=6", "train.checkpoint_every=2", "objective.method=nsr")
    run_training(cfg, tmp_path / "full")

    class Interrupt(Exception):
        pass

    def stop_at_5(ev):
        if ev["step"] == 5:
            raise Interrupt

    with pytest.raises(Interrupt):
        run_training(cfg, tmp_path / "cut", progress=stop_at_5)
    cut = RunDir(tmp_path / "cut")
    assert json.loads((cut.checkpoint_dir / "state.json").read_text())["step"] == 4
    assert len(cut.read_metrics()) == 5 * 4  # step 5 was written but is not checkpointed
    run_training(cfg, tmp_path / "cut", resume=True)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    full_rows = strip(RunDir(tmp_path / "full").read_metrics())
    assert strip(cut.read_metrics()) == full_rows
    assert len(full_rows) == 6 * 4

    def evals(rd):  # correctness matrices and summaries, not wall-clock seconds
        return {
            s: {b: {k: v for k, v in p.items() if k != "seconds"} for b, p in e.items()}
            for s, e in rd.read_evals().items()
        }

    assert evals(RunDir(tmp_path / "full")) == evals(cut) and sorted(evals(cut)) == [0, 6]
    assert cut.status()["state"] == "finished"


def test_non_finite_loss_skips_the_step_and_the_run_goes_on(tmp_path, monkeypatch):
    """A fake around the real loss (logic test): the 2nd optimizer step's loss is NaN."""
    import clipbench.train.step as step

    real = step.Objective.loss  # the run's bound rule, called once per micro-batch
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1  # one call per micro-batch: one per optimizer step here
        if calls["n"] == 2:
            out = dataclasses.replace(out, loss=out.loss * float("nan"))
        return out

    monkeypatch.setattr(step.Objective, "loss", flaky)
    run_training(small_cfg("train.steps=2", "eval.benchmarks=[]", "train.max_skipped_frac=0.2"), tmp_path / "run")
    rows = RunDir(tmp_path / "run").read_metrics()
    assert [r["skipped_nonfinite"] for r in rows] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert RunDir(tmp_path / "run").status()["skipped_nonfinite"] == 1
    assert rows[1]["grad_norm"] is None  # NaN, stored as null: no optimizer step
    assert rows[2]["lr"] == rows[0]["lr"]  # the skipped step did not advance the schedule either
    cells = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
    for i, r in enumerate(rows):
        if i == 1:
            continue
        all_zero_adv = r["zero_adv/tokens"] == sum(r[f"{c}/tokens"] for c in cells)
        # a mini-batch whose advantages are all 0 has an exactly zero gradient; any other a positive one
        assert isinstance(r["grad_norm"], float) and (r["grad_norm"] == 0.0 if all_zero_adv else r["grad_norm"] > 0), (
            i,
            r,
        )


def test_a_run_that_skips_too_many_steps_fails_with_a_clear_message(tmp_path, monkeypatch):
    import clipbench.train.step as step
    from clipbench.errors import RunFailed

    real = step.Objective.loss

    def nan_loss(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return dataclasses.replace(out, loss=out.loss * float("nan"))

    monkeypatch.setattr(step.Objective, "loss", nan_loss)
    # 3 steps x 4 mini-batches = 12 planned optimizer steps; 0.25 of them allows 3 skips: the 4th fails
    with pytest.raises(RunFailed, match=r"train.max_skipped_frac: 4 of the run's 12 optimizer steps were skipped"):
        run_training(small_cfg("train.steps=3", "eval.benchmarks=[]", "train.max_skipped_frac=0.25"), tmp_path / "run")
    assert len(RunDir(tmp_path / "run").read_metrics()) == 4  # the failing step's rows are logged first


def _cli(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "clipbench.cli", "train", RECIPE, *args, "--results-dir", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.name=/no/such/model", "model.name: no such path '/no/such/model'"),
        ("task.name=algebra", "task.name: unknown value 'algebra'"),
        ("objective.method=cispoo", "did you mean 'cispo'"),
        ("objective.tau_pos=2", "tau_pos"),
        ("eval.benchmarks=[aime2024]", "did you mean 'aime24'"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, override, words):
    res = _cli(tmp_path, override)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "results").exists()


def test_dynamic_sampling_drops_all_equal_groups(tmp_path):
    """DAPO dynamic sampling: groups with all-equal rewards are replaced by fresh prompts, so the
    trained batch has fewer of them than were sampled (and none when enough were found)."""
    run_training(
        small_cfg("train.steps=3", "train.dynamic_sampling=true", "train.max_resample_rounds=4", "eval.benchmarks=[]"),
        tmp_path / "ds",
    )
    ds = [r for r in RunDir(tmp_path / "ds").read_metrics() if r["mini_batch"] == 0]
    assert all(r["groups_kept"] == 4 for r in ds)
    assert any(r["zero_var_groups_frac"] > 0 for r in ds)  # there was something to drop
    assert all(r["zero_var_groups_frac/kept"] < r["zero_var_groups_frac"] or r["zero_var_groups_frac"] == 0 for r in ds)
    run_training(small_cfg("train.steps=3", "eval.benchmarks=[]"), tmp_path / "plain")
    plain = [r for r in RunDir(tmp_path / "plain").read_metrics() if r["mini_batch"] == 0]
    assert all(r["zero_var_groups_frac/kept"] == r["zero_var_groups_frac"] for r in plain)


def test_bf16_compute_keeps_float32_master_weights_that_move(tmp_path):
    """model.dtype=bfloat16 trains under autocast with float32 master weights: an lr-1e-6 AdamW
    step (~1e-6 per weight) survives, whereas bf16 weights (spacing ~1e-4 near 0.02) would round it away."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from clipbench.train.checkpoint import load_policy

    cfg = small_cfg("model.dtype=bfloat16", "train.lr=1e-6", "train.steps=1", "eval.benchmarks=[]")
    run_training(cfg, tmp_path / "run")
    ckpt = RunDir(tmp_path / "run").checkpoint_dir
    stored = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    assert {m.properties.dtype for k, m in stored.items() if k.startswith("model.")} == {torch.float32}
    after = load_policy(ckpt)[0].state_dict()
    before = load_file(str(Path(resolve_model_name("builtin:arith-tiny")) / "model.safetensors"))
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(moved) >= len(before) // 2
    assert max((before[k] - after[k]).abs().max().item() for k in moved) < 1e-4  # small steps, kept


def test_lr_schedule_warmup_then_cosine():
    from types import SimpleNamespace

    from clipbench.train.build import lr_lambda

    f = lr_lambda(SimpleNamespace(steps=2, mini_batches=4, epochs=1, warmup_steps=2, lr_schedule="cosine"))
    # warmup (s+1)/2 for s < 2; then cos over the 8 - 2 = 6 remaining steps: s=5 -> progress 0.5 -> 0.5
    assert [round(f(s), 6) for s in (0, 1, 2, 5, 8)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    g = lr_lambda(SimpleNamespace(steps=2, mini_batches=4, epochs=1, warmup_steps=0, lr_schedule="constant"))
    assert {g(s) for s in range(8)} == {1.0}


def test_kl_to_reference_is_zero_before_the_first_update_then_grows(tmp_path):
    run_training(small_cfg("train.beta=0.1", "train.steps=2", "train.lr=5e-4", "eval.benchmarks=[]"), tmp_path / "run")
    rows = RunDir(tmp_path / "run").read_metrics()
    assert abs(rows[0]["kl_ref"]) < 1e-7  # policy == reference before any update (k3 of identical logp = 0)
    assert rows[-1]["kl_ref"] > 1e-6 and all(r["kl_ref"] >= 0 for r in rows)


def test_cli_train_end_to_end_with_embedded_mlflow_then_resume_is_a_no_op(tmp_path):
    args = [
        "train.steps=2",
        "train.prompts_per_step=2",
        "sampler.group_size=4",
        "sampler.max_new_tokens=8",
        "eval.limit=4",
        "eval.n=2",
    ]
    res = _cli(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert "clip events" in res.stderr and "skipped 0" in res.stderr  # the progress line counts skipped steps
    (run_dir,) = (tmp_path / "results" / "train").iterdir()
    rd = RunDir(run_dir)
    assert rd.status()["state"] == "finished" and len(rd.read_metrics()) == 2 * 4
    assert sorted(rd.read_evals()) == [0, 2]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    (exp,) = [e for e in client.search_experiments() if e.name == "clipbench"]
    (run,) = client.search_runs([exp.experiment_id], f"tags.run_id = '{run_dir.name}'")
    assert run.data.params["objective.method"] == "grpo"
    assert any(k.startswith("rule.") for k in run.data.params)  # the effective clip bounds are logged
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 8  # one per optimizer step
    before = rd.metrics_path.read_text()
    res = _cli(tmp_path, *args, "--resume")
    assert res.returncode == 0, res.stderr
    assert rd.metrics_path.read_text() == before  # a finished run resumes to nothing new


def test_rollout_is_gets_the_samplers_logprobs_in_the_builtin_loop(tmp_path):
    """rollout_is reads the sampler's log-probs: with the hf sampler and old log-probs recomputed (no
    correction), the loop asks the sampler for them (the mismatch is then measured) and passes them to
    the rule per micro-batch; hf samples from the training model itself, so the two agree to round-off."""
    run_training(
        small_cfg("objective.name=rollout_is", "train.mini_batches=2", "train.steps=1", "eval.benchmarks=[]"),
        tmp_path / "run",
    )
    rows = RunDir(tmp_path / "run").read_metrics()
    assert len(rows) == 2
    for r in rows:
        assert r["mismatch/abs_mean"] < 1e-4 and r["mismatch/rho_min"] > 0.999, r
        assert r["q1/tokens"] + r["q2/tokens"] + r["q3/tokens"] + r["q4/tokens"] + r["on_policy/tokens"] > 0
