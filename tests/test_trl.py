"""clipbench rules inside TRL's GRPOTrainer (CPU, the tiny built-in model, real TRL training steps):

* grpo and dapo as clipbench rules give TRL's own loss_type losses and gradients, step by step;
* the loss of an optimizer step does not depend on how it is split into micro-batches (exact global
  counts), and the settings where no exact count exists are refused (trl#5619);
* `engine: trl` runs write the built-in loop's results store, resume from their checkpoint with the
  same numbers, sit next to built-in runs in one sweep (`engine` as an axis) and in its report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from clipbench.config import load_run_config  # noqa: E402
from clipbench.engines import check as check_run  # noqa: E402
from clipbench.errors import ConfigError  # noqa: E402
from clipbench.integrations.trl import ClipbenchGRPOTrainer  # noqa: E402
from clipbench.models import load_model_and_tokenizer, resolve_model_name  # noqa: E402
from clipbench.tasks import build_task  # noqa: E402
from clipbench.tracking.provenance import clipbench_version  # noqa: E402
from clipbench.tracking.store import RunDir

pytestmark = pytest.mark.slow  # TRL's GRPOTrainer training

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "arith_tiny.yaml"
TASK = build_task(load_run_config(RECIPE).task)
PROBLEMS = list(TASK.train_problems())[:32]
DATASET = Dataset.from_dict({"prompt": [p.prompt for p in PROBLEMS], "problem": list(range(len(PROBLEMS)))})


def reward(prompts, completions, problem, **kw):
    return [TASK.reward(c, PROBLEMS[i]) for c, i in zip(completions, problem)]


class GradsPerStep(TrainerCallback):
    """Every parameter's accumulated gradient at each optimizer step (after accumulation, before the update)."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def train(
    trainer_cls,
    *,
    loss_type: str = "dapo",
    bs: int = 8,
    ga: int = 2,
    spg: int | None = None,
    steps: int = 3,
    epsilon_high: float | None = None,
    dtype: torch.dtype = torch.float32,
    **kw,
):
    """A few real GRPO steps of the tiny model: 2 prompts x 4 samples per generation, 2 iterations
    over each generation (the second one off-policy), AdamW lr 1e-3 (ratios up to ~2: clipping acts)."""
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(resolve_model_name("builtin:arith-tiny"))
    model = model.to(dtype)
    args = GRPOConfig(
        output_dir="/tmp/clipbench-test-trl",
        use_cpu=True,
        per_device_train_batch_size=bs,
        num_generations=4,
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        max_completion_length=8,
        max_steps=steps,
        num_iterations=2,
        learning_rate=1e-3,
        seed=0,
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=epsilon_high or (0.28 if loss_type == "dapo" else 0.2),
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    grads = GradsPerStep()
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=DATASET,
        processing_class=tok,
        callbacks=[grads],
        **kw,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs, grads.grads


def rel_err(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    return num / max(sum(float(a[k].norm() ** 2) for k in a) ** 0.5, 1e-30)


@pytest.mark.parametrize("method", ["grpo", "dapo"])
def test_clipbench_rule_inside_trl_equals_trls_own_loss(method):
    """TRL's loss_type=grpo (seq-mean-token-mean) and dapo (global token-mean) against clipbench's rule
    of the same name inside TRL: same seed, data and batch, 3 optimizer steps (one off-policy)."""
    trl_logs, trl_grads = train(GRPOTrainer, loss_type=method)
    cb_logs, cb_grads = train(ClipbenchGRPOTrainer, loss_type=method, method=method)
    assert len(trl_grads) == len(cb_grads) == 3
    for step, (x, y) in enumerate(zip(trl_grads, cb_grads)):
        assert rel_err(x, y) <= 1e-6, (method, step, rel_err(x, y))
    assert [h["loss"] for h in cb_logs] == pytest.approx([h["loss"] for h in trl_logs], rel=1e-6, abs=1e-9)
    # the off-policy step clipped tokens, and the diagnostics reached TRL's logs
    assert cb_logs[1]["clip_events"] > 0 and cb_logs[1]["ratio/max"] > 1.28
    assert cb_logs[1]["clip_events"] == sum(
        cb_logs[1][f"{c}/out_of_band"] for c in ("q1", "q2", "q3", "q4", "zero_adv")
    )
    assert 0 < cb_logs[1]["entropy"] < 3


def test_a_plugin_rule_inside_trl(unload_plugins):
    """docs/plugins.md's one-file rule (PPO clip with only the lower bound) as TRL's loss: it is TRL's
    own grpo loss with an upper bound that never binds, gradient for gradient."""
    from clipbench.objectives.plugins import load_plugins

    load_plugins([str(REPO / "examples" / "plugins" / "lower_only.py")])
    trl_logs, trl_grads = train(GRPOTrainer, loss_type="grpo", epsilon_high=1e9)
    cb_logs, cb_grads = train(ClipbenchGRPOTrainer, loss_type="grpo", method="lower_only", params={"eps_low": 0.2})
    for step, (x, y) in enumerate(zip(trl_grads, cb_grads)):
        assert rel_err(x, y) <= 1e-6, (step, rel_err(x, y))
    assert cb_logs[1]["q3/out_of_band"] > 0 and cb_logs[1]["q3/zero_grad"] > 0  # the lower bound acted


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_optimizer_step_does_not_depend_on_its_micro_batches(agg):
    """One optimizer step over 8 sequences as 1 micro-batch of 8 or 2 of 4: the same loss and gradient
    (TRL's bnpo normalises each micro-batch by its own count; ours by the step's).

    In float64: a group's identical completions with advantages of opposite sign cancel in the
    gradient, so the step's gradient can be ~1e-4 of its terms, and float32's summation-order
    round-off (1e-7 of the terms) read as a relative difference of 1.7e-3 with one build of the
    tiny model. In float64 (TRL's advantages stay float32) it is ~5e-8; a wrong count (TRL's
    per-micro-batch normalisation) is an O(1) difference in either precision."""
    whole_logs, whole = train(
        ClipbenchGRPOTrainer, bs=8, ga=1, spg=1, steps=2, method="dapo", agg=agg, dtype=torch.float64
    )
    split_logs, split = train(
        ClipbenchGRPOTrainer, bs=4, ga=2, spg=2, steps=2, method="dapo", agg=agg, dtype=torch.float64
    )
    for step, (x, y) in enumerate(zip(whole, split)):
        assert rel_err(x, y) <= 1e-6, (agg, step, rel_err(x, y))
    # (abs: the on-policy step's loss is 0 up to round-off, its advantages summing to 0)
    assert [h["loss"] for h in split_logs] == pytest.approx([h["loss"] for h in whole_logs], rel=1e-5, abs=1e-7)
    assert [h["q3/tokens"] for h in split_logs] == [h["q3/tokens"] for h in whole_logs]


def test_rules_reading_the_entropy_or_a_mini_batch_statistic_run_inside_trl():
    """aspo reads TRL's entropies of the same forward; bapo computes its bounds per micro-batch (as
    its source); both train and log their diagnostics (bapo's bounds as stat/*). topr (the reward)
    and prompt-mean (the prompt groups) are refused: TRL's loss inputs have neither."""
    logs, grads = train(ClipbenchGRPOTrainer, method="aspo", steps=2)
    assert len(grads) == 2 and all(torch.isfinite(g).all() for g in grads[-1].values())
    logs, _ = train(ClipbenchGRPOTrainer, method="bapo", steps=2)  # (stat/*: the largest over the step's micro-batches)
    assert all(
        0.6 - 1e-6 <= h["stat/clip_low"] <= 0.8 + 1e-6 and 1.2 - 1e-6 <= h["stat/clip_high"] <= 2.0 + 1e-6 for h in logs
    )
    with pytest.raises(ValueError, match="reads each sequence's reward"):
        train(ClipbenchGRPOTrainer, method="topr", steps=1)
    with pytest.raises(ValueError, match="prompt group"):
        train(ClipbenchGRPOTrainer, method="grpo", agg="prompt-mean", steps=1)


def test_the_rules_of_issue_38_run_inside_trl_but_rollout_is():
    """opsm (a sequence mask), ipo and kimi15 (penalties that move zero-advantage tokens) and cispo's
    unified mask train as TRL's loss; rollout_is reads the sampler's log-probs, which TRL's loss inputs
    do not carry: refused in one line before TRL loads anything."""
    for method, params in (("opsm", {"delta": 0.01}), ("ipo", {}), ("kimi15", {}), ("cispo", {"unified_mask": True})):
        _, grads = train(ClipbenchGRPOTrainer, method=method, params=params, steps=1)
        assert all(torch.isfinite(g).all() for g in grads[-1].values()), method
    with pytest.raises(ValueError, match="reads the sampler's log-probs of the sampled tokens") as err:
        train(ClipbenchGRPOTrainer, method="rollout_is", steps=1)
    assert "\n" not in str(err.value)


def test_windows_without_an_exact_count_are_refused():
    with pytest.raises(ValueError, match=r"trl#5619"):
        train(ClipbenchGRPOTrainer, bs=4, ga=4, spg=1, steps=1, method="grpo")  # 1 x 2 iterations < 4


# ---------------------------------------------------------------------------------------------
# engine: trl


def test_engine_trl_maps_the_correction_onto_trls_importance_sampling():
    from clipbench.config.schema import SLOTS
    from clipbench.config.slots import checked, read_slot
    from clipbench.engines.trl import correction_args

    def correction(setting: dict):  # a validated sampler.correction
        return checked(SLOTS["correction"], read_slot(SLOTS["correction"], setting)[0], "sampler.correction.name")

    assert correction_args(correction({"name": "none"})) == {"vllm_importance_sampling_correction": False}
    assert correction_args(correction({"name": "tis", "level": "sequence", "cap": 3.0})) == {
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "sequence_truncate",
        "vllm_importance_sampling_clip_min": None,
        "vllm_importance_sampling_clip_max": 3.0,
    }
    assert correction_args(correction({"name": "icepop"})) == {
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_mask",
        "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": 5.0,
    }
    from clipbench.engines.keys import KEYS

    support = KEYS["trl"]["sampler.correction"]
    for name in ("geo_mask", "veto", "kl_rs"):
        assert support.problem(correction({"name": name}), correction({"name": "none"})), name
    assert support.problem(correction({"name": "icepop", "weight": "one"}), correction({"name": "none"}))


def test_engine_trl_config_checks():
    def check(*overrides):
        check_run(load_run_config(RECIPE, ["engine=trl", *overrides]), "recipe.yaml")

    check("trl.gradient_accumulation_steps=2", "trl.vllm_mode=server")
    for over, key, reason in [
        ("train.advantage=rloo", "train.advantage", "advantage 'rloo' has no counterpart in TRL's scale_rewards"),
        ("train.dynamic_sampling=true", "train.dynamic_sampling", "no DAPO dynamic sampling"),
        ("trl.vlm_mode=server", "trl.vlm_mode", "not a GRPOConfig field (did you mean 'vllm_mode'?)"),
        ("trl.learning_rate=0.1", "trl.learning_rate", "clipbench sets it from the run config"),
        ("trl.gradient_accumulation_steps=3", "trl.gradient_accumulation_steps", "splits each mini-batch"),
        ("train.agg=prompt-mean", "train.agg", "reads each row's prompt group, which TRL's loss call does not pass"),
        ("objective.method=topr", "objective", "reads each sequence's reward (the input 'reward')"),
        ("sampler.correction=icepop", "sampler.correction.name", "only with sampler.backend=vllm"),
    ]:
        with pytest.raises(ConfigError) as e:
            check(over)
        assert e.value.key == key and reason in e.value.reason, str(e.value)


TINY = {
    "objective.method": "nsr",
    "train.steps": 2,
    "train.prompts_per_step": 2,
    "sampler.group_size": 4,
    "sampler.max_new_tokens": 8,
    "train.mini_batches": 2,
    "train.checkpoint_every": 1,
    "eval.limit": 8,
    "eval.n": 2,
    "tracking.mlflow": False,
}


def clipbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clipbench.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=600
    )


@pytest.mark.slow
def test_engine_axis_sweep_trains_with_trl_and_reports_side_by_side(tmp_path):
    """A sweep over engine: [builtin, trl] of 2-step nsr runs: the TRL run writes the same store (metrics
    rows per optimizer step with the quadrant counts, histograms, evals, a checkpoint), and the report
    puts both runs in its tables."""
    f = tmp_path / "engines.yaml"
    f.write_text(
        yaml.safe_dump(
            {"name": "engines", "base": str(RECIPE), "overrides": TINY, "grid": {"engine": ["builtin", "trl"]}}
        )
    )
    res = tmp_path / "results"
    p = clipbench("sweep", str(f), "--results-dir", str(res))
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((res / "engines" / "manifest.json").read_text())
    runs = {cfg["engine"]: RunDir(res / "engines" / rid) for rid, cfg in manifest["runs"].items()}
    builtin, trl = runs["builtin"], runs["trl"]
    assert trl.status()["state"] == "finished" and trl.status()["engine"] == "trl"
    rows, ref = trl.read_metrics(), builtin.read_metrics()
    assert [(r["step"], r["opt_step"], r["mini_batch"]) for r in rows] == [(0, 1, 0), (0, 2, 1), (1, 3, 0), (1, 4, 1)]
    # (micro_batches: forward/backward calls per step of the built-in loop's micro-batching)
    shared = set(ref[0]) - {"skipped_nonfinite", "time/sample", "time/score", "time/update", "micro_batches"}
    assert shared <= set(rows[0]), shared - set(rows[0])  # every metric of the built-in loop, by name
    for r in rows:
        cells = sum(r[f"{c}/tokens"] for c in ("q1", "q2", "q3", "q4", "zero_adv", "on_policy"))
        assert cells > 0 and r["clip_events"] == sum(
            r[f"{c}/out_of_band"] for c in ("q1", "q2", "q3", "q4", "zero_adv")
        )
        assert r["q1/rescued"] <= r["q1/out_of_band"] and r["q3/rescued"] <= r["q3/out_of_band"]
    hist = [json.loads(line) for line in trl.hist_path.read_text().splitlines()]
    assert [h["step"] for h in hist] == [0, 1]
    # every non-zero-advantage token of a rollout step is in its histogram
    for h in hist:
        per_step = [r for r in rows if r["step"] == h["step"]]
        n_adv = sum(r[f"{c}/tokens"] for r in per_step for c in ("q1", "q2", "q3", "q4", "on_policy"))
        assert sum(h["pos"]) + sum(h["neg"]) == n_adv
    assert sorted(trl.read_evals()) == [0, 2]
    # the checkpoint names whose it is (train/checkpoint.py's checkpoint_owner): run id, seed, version
    owner = {"run_id": trl.path.name, "seed": 0, "clipbench": clipbench_version()}
    assert json.loads((trl.checkpoint_dir / "state.json").read_text()) == {
        "step": 2,
        "opt_step": 4,
        "engine": "trl",
        **owner,
    }
    assert (trl.checkpoint_dir / "model" / "model.safetensors").is_file()

    rep = clipbench("report", "engines", "--results-dir", str(res))
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert "nsr(engine=trl)" in rep.stdout and "nsr(engine=builtin)" in rep.stdout


@pytest.mark.slow
def test_engine_trl_run_resumes_from_its_checkpoint_with_the_same_numbers(tmp_path):
    """Interrupted after 2 of 3 rollout steps (checkpoint after each), resumed through TRL's own resume:
    every metric of every optimizer step and the final evaluation equal an uninterrupted run's. Its
    checkpoint names the run; one that does not (the older layout) is set aside and the run restarts."""
    import shutil

    from clipbench.config import run_id
    from clipbench.engines import train_run

    cfg = load_run_config(RECIPE, ["engine=trl", *(f"{k}={v}" for k, v in {**TINY, "train.steps": 3}.items())])
    train_run(cfg, tmp_path / "full")

    class Stop(Exception):
        pass

    def stop(ev):
        if ev["step"] == 2:  # rows of rollout step 1 written, its checkpoint not yet
            raise Stop

    with pytest.raises(Stop):
        train_run(cfg, tmp_path / "cut", progress=stop)
    cut = RunDir(tmp_path / "cut")
    assert cut.status()["state"] == "running" and len(cut.read_metrics()) == 4
    state = json.loads((cut.checkpoint_dir / "state.json").read_text())
    assert state["step"] == 1 and (state["run_id"], state["seed"]) == (run_id(cfg), cfg.seed)
    # the same checkpoint in the layout from before checkpoints named their run: not shown to be this run's
    shutil.copytree(cut.path, tmp_path / "old")
    old = RunDir(tmp_path / "old")
    (old.checkpoint_dir / "state.json").write_text(json.dumps({"step": 1, "opt_step": 2, "engine": "trl"}))
    train_run(cfg, cut.path, resume=True)
    full = RunDir(tmp_path / "full")
    train_run(cfg, old.path, resume=True)
    assert old.status()["checkpoint_notes"] == [
        "checkpoint checkpoints/last set aside (removed): it does not name its run (a checkpoint of an older "
        "clipbench, written before checkpoints recorded their run id and seed): it cannot show it is this run's own",
        "the run restarts from step 0",
    ]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "trl/step_time"} for r in rows]  # noqa: E731
    assert strip(old.read_metrics()) == strip(full.read_metrics())  # trained from step 0
    assert strip(cut.read_metrics()) == strip(full.read_metrics())
    assert cut.read_evals()[3]["arith"]["correct"] == full.read_evals()[3]["arith"]["correct"]
    assert cut.status()["state"] == "finished"
    # provenance: one record per start (the resume appends one), the shipped model's checksum in each
    from clipbench.models import builtin_path, weights_sha256
    from clipbench.tracking.provenance import read_provenance

    starts = read_provenance(cut.path)
    assert [(s["engine"], s["step"], s["world_size"]) for s in starts] == [("trl", 0, 1), ("trl", 1, 1)]
    assert {s["base_model"]["weights_sha256"] for s in starts} == {weights_sha256(builtin_path("arith-tiny"))}


@pytest.mark.slow
def test_the_documented_trl_example_runs(monkeypatch, capsys, tmp_path):
    import runpy

    monkeypatch.setattr(
        sys, "argv", ["trl_clipbench_rule.py", "--max-steps", "2", "--method", "nsr", "--output-dir", str(tmp_path)]
    )
    runpy.run_path(str(REPO / "examples" / "trl_clipbench_rule.py"), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("clip events" in line and "entropy" in line for line in lines)


@pytest.mark.slow
def test_engine_trl_over_two_processes(tmp_path):
    """`engine: trl` under torchrun (2 CPU processes, gloo; accelerate reads torchrun's environment): each
    optimizer step's counts are summed over both processes (they cover every completion token of the
    rollout, which TRL gathers), and rank 0 alone writes one row per optimizer step."""
    args = [f"{k}={v}" for k, v in TINY.items()]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "clipbench.cli",
            "train",
            str(RECIPE),
            "engine=trl",
            *args,
            "--results-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (rd,) = [RunDir(d) for d in (tmp_path / "train").iterdir()]
    rows = rd.read_metrics()
    assert rd.status()["state"] == "finished" and [r["opt_step"] for r in rows] == [1, 2, 3, 4]
    for step in (0, 1):
        mine = [r for r in rows if r["step"] == step]
        tokens = sum(r[f"{c}/tokens"] for r in mine for c in ("q1", "q2", "q3", "q4", "zero_adv", "on_policy"))
        assert tokens == pytest.approx(mine[0]["response_length/mean"] * 8)  # 2 prompts x 4 samples
    assert [json.loads(line)["step"] for line in rd.hist_path.read_text().splitlines()] == [0, 1]


@pytest.mark.slow
def test_engine_trl_records_through_its_loss_hook_and_replays_exactly(tmp_path):
    """train.record.every=1 on engine trl: one record per generation batch; the trained rule (nsr, its
    recorded draws) replays each optimizer step's summed hook loss and the logged quadrant counts."""
    from clipbench.engines import train_run
    from clipbench.replay.rules import RuleSpec
    from clipbench.replay.tokens import OptStepView, replay_rule
    from clipbench.tracking.records import list_records, load_record

    cfg = load_run_config(RECIPE, ["engine=trl", "train.record.every=1", *(f"{k}={v}" for k, v in TINY.items())])
    train_run(cfg, tmp_path / "run")
    rd = RunDir(tmp_path / "run")
    logged = {r["opt_step"]: r for r in rd.read_metrics()}
    assert rd.status()["records"] == [0, 1]
    n = 0
    for path in list_records(rd.path):
        rec = load_record(path)
        assert rec.index["engine"] == "trl" and rec.get("uniforms") is not None
        for opt in rec.index["opt_steps"]:
            res = replay_rule(OptStepView(rec, opt), RuleSpec.of("nsr", rec.index["objective"]["params"]))
            assert res.loss == pytest.approx(opt["hook_loss"], rel=1e-6)
            for key in ("q1/out_of_band", "q2/zero_grad", "q3/tokens", "q4/rescued", "clip_events"):
                assert res.stats[key] == logged[opt["opt_step"]][key], key
            n += 1
    assert n == 4  # 2 generation batches x 2 optimizer steps
