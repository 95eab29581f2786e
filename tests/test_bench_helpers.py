"""The `make bench` scripts' helpers at a tiny size (no timing is asserted: targets live in `make bench`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses in the module look themselves up here
    spec.loader.exec_module(mod)
    return mod


def test_gpu_bench_shapes_tokenizer_and_skip(tmp_path):
    g = load("bench_gpu")
    # Qwen3-1.7B: per layer q 2048*2048 + k, v 2*2048*1024 + o 2048*2048 = 12,582,912; MLP 3*2048*6144 =
    # 37,748,736; norms 2*2048 + q/k norms 2*128 = 4,352 -> 50,336,000 x 28 = 1,409,408,000; tied
    # embedding 151,936*2048 = 311,164,928; final norm 2,048: 1,720,574,976
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3ForCausalLM(Qwen3Config(**g.QWEN3_1_7B)).parameters())
    assert n == 1_720_574_976
    assert g.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert g.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert g.peak_tflops("NVIDIA H200") == 989.4
    assert g.peak_tflops("Some GPU") is None and g.peak_tflops("Some GPU", 100.0) == 100.0

    from clipbench.models import load_model_and_tokenizer

    n_tiny = g.build_model_dir(g.QWEN3_TINY, tmp_path / "m")
    model, tok = load_model_and_tokenizer(str(tmp_path / "m"))
    assert len(tok) == model.config.vocab_size == 1024
    assert sum(p.numel() for p in model.parameters()) == n_tiny
    ids = tok("37+45=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 7 and tok.unk_token_id not in ids
    assert tok.decode([1023]) == "<f1023>"  # every id the random model samples decodes
    if not torch.cuda.is_available():
        out = tmp_path / "gpu.json"
        assert g.main(["--out", str(out)]) == {"skipped": "no CUDA device"}
        assert "skipped" in out.read_text()


def test_compile_bench_batch_and_step():
    """bench_compile's micro-batch is the packed shape training feeds `completion_logprobs`, and its
    step returns the eager log-probs and gradient (the arm the compiled one is measured against)."""
    c = load("bench_compile")
    from clipbench.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("builtin:arith-steps")
    b = c.micro_batch(model.config.vocab_size, 2, torch.Generator().manual_seed(0))
    assert b.input_ids.shape == (16, 12 + 26) and b.completion_ids.shape == (16, 26)
    # rows 0-3 have 3 pad columns: their first real token sits at position 0, their last at 38 - 3 - 1 = 34
    assert b.position_ids[0, 3].item() == 0 and b.position_ids[0, -1].item() == 34
    assert b.position_ids[4, -1].item() == 37 and b.attention_mask[:4, :3].sum().item() == 0
    logp, grad = c.step(model, b)
    assert logp.shape == (16, 26) and bool((logp <= 0).all())
    assert grad.numel() == sum(p.numel() for p in model.parameters()) and bool(grad.isfinite().all())


def test_sampling_bench_flops_per_token_and_run(tmp_path):
    """The organism model's arithmetic per generated token. Per layer: q 128*4*32 = 16,384; k, v
    2*128*2*32 = 16,384; o 4*32*128 = 16,384; MLP 3*128*256 = 98,304 -> 147,456 x 3 layers = 442,368,
    + the tied output layer 128*20 = 2,560: 444,928 matmul parameters, x 2 = 889,856 FLOPs; attention
    4*3 layers*4 heads*32*context = 1,536 per position of context: 30,720 at 20 -> 920,576."""
    import json

    from transformers import AutoConfig

    from clipbench.models import builtin_path

    b = load("bench_sampling")
    config = AutoConfig.from_pretrained(builtin_path("arith-organism"))
    assert b.flops_per_token(config, 20) == 920_576
    out = tmp_path / "s.json"
    assert b.main(["--quick", "--reps", "1", "--out", str(out)]) == 0  # 0: the two paths sampled the same tokens
    got = json.loads(out.read_text())
    assert got["identical_tokens"] and got["evaluation"]["calls_prompts_n"] == [2, 4, 4]
    for shape in ("evaluation", "rollout"):
        assert 0 < got[shape]["product"]["fraction_of_bound"] and got[shape]["readable"]["tokens_per_s"] > 0


@pytest.mark.slow  # two child processes, each trains a 1-step organism run
def test_organism_bench_times_both_paths_and_compares_their_numbers(tmp_path):
    import json

    b = load("bench_organism")
    out = tmp_path / "o.json"
    over = ["--override=eval.limit=4", "--override=eval.n_ends=2", "--override=eval.every=0"]
    b.main(["--steps", "1", *over, "--out", str(out)])  # SystemExit unless the two runs' numbers are identical
    got = json.loads(out.read_text())
    assert got["identical_numbers"] and got["overrides"][-1] == "train.steps=1"
    for arm in ("before", "after"):
        assert got[arm]["cpu_s"] > 0 and got[arm]["phases_cpu_s"]["update"] > 0
    assert got["cpu_ratio"] == round(got["after"]["cpu_s"] / got["before"]["cpu_s"], 3)
