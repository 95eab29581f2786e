"""Issue 25's speed work changes no number: the attention with shared key/value heads equals
transformers' SDPA bit for bit where it is used (and is not used where it would not); a sweep's runs
that share the start's evaluation store exactly what they would have computed; whole runs on the
fast path equal the readable reference path (bench/bench_run.py's `reference_path`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from clipbench.config.load import load_run_config
from clipbench.models import attention, load_model_and_tokenizer, resolve_model_name
from clipbench.rollout.hf import HFSampler
from clipbench.tracking.provenance import record_start
from clipbench.tracking.store import RunDir
from clipbench.train.logprobs import completion_logprobs
from clipbench.train.packing import pack
from clipbench.train.shared_eval import start_eval_key

REPO = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("_bench_bench_run", REPO / "bench" / "bench_run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    fast, tok = load_model_and_tokenizer(resolve_model_name("builtin:arith-steps"))
    ref, _ = load_model_and_tokenizer(resolve_model_name("builtin:arith-steps"))
    ref.set_attn_implementation("sdpa")
    assert fast.config._attn_implementation == attention.NAME and ref.config._attn_implementation == "sdpa"
    assert fast.config.num_attention_heads == 2 * fast.config.num_key_value_heads  # grouped-query: 4 heads, 2 shared
    return fast, ref, tok


def count_kernel_calls(monkeypatch) -> dict:
    """Counts SDPA calls by how they got the key/value heads: shared inside the kernel, or copied."""
    calls = {"shared": 0, "copied": 0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*a, enable_gqa=False, **k):
        calls["shared" if enable_gqa else "copied"] += 1
        return sdpa(*a, enable_gqa=enable_gqa, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_with_shared_heads_equals_copied_heads(dtype):
    # prefill (queries = keys), one decoding query over a cache, and a training-sized block; a
    # boolean mask with left padding, as transformers builds it
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator().manual_seed(0)
    for B, Lq, Lk in [(128, 20, 20), (128, 1, 33), (16, 36, 36), (3, 70, 70)]:
        q, k, v = (torch.randn(B, h, L, 32, generator=g).to(dtype) for h, L in ((4, Lq), (2, Lk), (2, Lk)))
        mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        mask[: B // 2, :, :, :3] = False
        mask[:, :, :, -1] = True
        copied = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)
        shared = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.equal(copied, shared), (dtype, B, Lq, Lk)


def test_sampling_is_bitwise_the_same(models, monkeypatch):
    fast, ref, tok = models
    prompts = ["37+45-12=", "3+4-1=", "99-50+7=", "1+1-1="]
    out = {}
    for name, model in (("ref", ref), ("fast", fast)):
        calls = count_kernel_calls(monkeypatch)
        s = HFSampler(model, tok, max_new_tokens=24, return_logprobs=True)
        out[name] = s.generate(prompts, 4, seed=[11, 12, 13, 14])
        shared = name == "fast"  # the fast model shares the heads in every call, the reference in none
        assert calls["shared" if shared else "copied"] > 20 and calls["copied" if shared else "shared"] == 0
    assert out["fast"].completion_ids == out["ref"].completion_ids
    assert out["fast"].sampler_logp == out["ref"].sampler_logp  # floats, compared exactly
    assert max(len(c) for c in out["fast"].completion_ids) > 10  # real completions, not empty ones


def test_log_probs_and_gradients_are_bitwise_the_same(models, monkeypatch):
    fast, ref, tok = models
    prompts = [tok(p)["input_ids"] for p in ["37+45-12=", "3+4-1=", "99-50+7="]]
    comps = [tok("37+45=82 82-12=70 #70")["input_ids"][1 : 1 + k] for k in (5, 12, 20)]
    batch = pack(prompts, comps, tok.pad_token_id)  # left-padded prompts, right-padded completions
    calls = count_kernel_calls(monkeypatch)
    with torch.no_grad():  # the old log-probs: the fast model shares the heads, the reference copies them
        assert torch.equal(completion_logprobs(fast, batch)[0], completion_logprobs(ref, batch)[0])
    layers = fast.config.num_hidden_layers
    assert calls == {"shared": layers, "copied": layers}
    grads = {}
    for name, model in (("fast", fast), ("ref", ref)):  # with a gradient: transformers' own path
        model.zero_grad()
        logp, ent = completion_logprobs(model, batch)
        (logp * batch.completion_mask).sum().backward()
        grads[name] = (logp.detach(), ent, [p.grad.clone() for p in model.parameters()])
    assert calls == {"shared": layers, "copied": 3 * layers}  # with a gradient both copy: transformers' own path
    assert torch.equal(grads["fast"][0], grads["ref"][0]) and torch.equal(grads["fast"][1], grads["ref"][1])
    assert all(torch.equal(a, b) for a, b in zip(grads["fast"][2], grads["ref"][2]))


def test_start_eval_key_covers_what_the_evaluation_reads(tmp_path):
    sweep = tmp_path / "s"

    def key(*over, run="r", in_sweep=True, backend="hf", world=1):
        cfg = load_run_config(REPO / "recipes" / "quickstart.yaml", list(over))
        rd = RunDir(sweep / run)
        rd.path.mkdir(parents=True, exist_ok=True)
        if in_sweep:
            (sweep / "manifest.json").write_text("{}")
        else:
            (sweep / "manifest.json").unlink(missing_ok=True)
        record_start(rd, cfg.model.name, engine="builtin", world_size=world, device="cpu", fresh=True)
        return start_eval_key(cfg, rd, backend=backend, device=torch.device("cpu"), world=world)

    base = key()
    assert base is not None and len(base) == 24
    # what a run trains cannot reach the evaluation before its first step: the same key
    assert key("objective.method=dapo", run="r2") == key("train.lr=2e-4", "train.epochs=1") == base
    # what the evaluation reads: another key
    for over in (
        "seed=1",
        "model.dtype=bfloat16",
        "sampler.temperature=0.7",
        "eval.n=4",
        "eval.limit=100",
        "task.digits=3",
        "sampler.max_new_tokens=40",
    ):
        assert key(over) not in (None, base), over
    # not shared: outside a sweep, with vLLM, over several processes
    assert key(in_sweep=False) is None and key(backend="vllm") is None and key(world=2) is None


@pytest.mark.slow
def test_runs_equal_the_reference_path_and_share_the_start(tmp_path):
    """Two runs of a sweep (grpo, dapo; tiny settings), on the reference path and on the fast path:
    every metric and evaluation identical; on the fast path the second run stored the first's
    evaluation before its first step instead of sampling it (its wall-clock seconds are the first's)."""
    bench = load_bench()
    over = [
        "train.steps=3",
        "train.prompts_per_step=4",
        "sampler.group_size=4",
        "train.mini_batches=2",
        "train.epochs=2",
        "eval.limit=24",
        "eval.n=2",
        "eval.every=0",
        "train.checkpoint_every=100",
    ]
    configs = bench.run_configs(REPO / "recipes" / "quickstart.yaml", ["grpo", "dapo"], over)
    ref = bench.run_sweep(configs, tmp_path / "ref" / "s", reference=True)
    fast = bench.run_sweep(configs, tmp_path / "fast" / "s", reference=False)
    for r, f in zip(ref, fast):
        assert r["run_id"] == f["run_id"]
        assert r["numbers"] == f["numbers"]
        assert sorted(f["numbers"]["evals"]) == [0, 3] and len(f["numbers"]["metrics"]) == 3 * 2 * 2
    assert r["numbers"]["metrics"][-1]["loss"] != ref[0]["numbers"]["metrics"][-1]["loss"]  # two rules, two runs
    assert not (tmp_path / "ref" / "s" / ".shared").exists()
    shared = list((tmp_path / "fast" / "s" / ".shared" / "eval_step_0").iterdir())
    assert len(shared) == 1 and [p.name for p in shared[0].iterdir()] == ["arith.json"]
    first, second = (RunDir(tmp_path / "fast" / "s" / f["run_id"]).read_evals()[0]["arith"] for f in fast)
    assert first == second  # seconds included: stored, not sampled again
