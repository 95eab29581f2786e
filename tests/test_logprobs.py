"""Chunked log-probs / entropy equal the naive full-vocabulary computation, and the log-probs training
uses (`completion_logprobs` over packed rows) equal a plain full forward pass, value and gradient."""

from __future__ import annotations

import pytest
import torch

from clipbench.train.logprobs import completion_logprobs, entropy_from_logits, selective_log_softmax
from clipbench.train.packing import pack


def naive(logits, index, temperature=1.0):
    z = logits.float() / temperature
    logp = torch.log_softmax(z, -1).gather(-1, index[..., None]).squeeze(-1)
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    return logp, ent


@pytest.mark.parametrize("V", [2, 7, 128, 1000, 5003])
@pytest.mark.parametrize("chunk", [1, 3, None])
def test_fp32_equals_naive(V, chunk):
    g = torch.Generator().manual_seed(V)
    full = (torch.randn(3, 6, V, generator=g) * 3).requires_grad_(True)
    logits = full[:, :-1]  # a non-contiguous (B, T, V) view, as out.logits[:, :-1]
    idx = torch.randint(0, V, (3, 5), generator=g)
    w = torch.randn(3, 5, generator=g)
    for temp in (1.0, 0.7):
        got = selective_log_softmax(logits, idx, temperature=temp, chunk_size=chunk)
        (g_got,) = torch.autograd.grad((got * w).sum(), full)
        want, want_ent = naive(logits, idx, temp)
        (g_want,) = torch.autograd.grad((want * w).sum(), full)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-5)
        ent = entropy_from_logits(logits, chunk, temperature=temp)
        torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)
        assert not ent.requires_grad


@pytest.mark.parametrize("V", [20, 1000])
def test_chunking_never_changes_a_number(V):
    # Whole sequences per chunk (the default whenever a sequence fits: one chunk for a built-in
    # model's micro-batch), one sequence per chunk (chunk_size = T: what every chunk held before
    # issue 25), several sequences per chunk with a remainder (chunk_size 11 = 2 sequences of 5) and
    # one position per chunk give the same log-probs, gradient and entropy bit for bit: every value
    # is computed per vocabulary row.
    g = torch.Generator().manual_seed(V)
    full = (torch.randn(7, 6, V, generator=g) * 3).requires_grad_(True)
    logits = full[:, :-1]  # (7, 5, V), non-contiguous
    idx = torch.randint(0, V, (7, 5), generator=g)
    w = torch.randn(7, 5, generator=g)
    results = []
    for chunk in (None, 5, 11, 1):
        for temp in (1.0, 0.7):
            lp = selective_log_softmax(logits, idx, temperature=temp, chunk_size=chunk)
            (grad,) = torch.autograd.grad((lp * w).sum(), full)
            results.append((chunk, temp, lp, grad, entropy_from_logits(logits, chunk, temperature=temp)))
    for chunk, temp, *values in results[2:]:
        _, _, *want = results[0] if temp == 1.0 else results[1]
        for got, ref in zip(values, want):
            assert torch.equal(got, ref), (chunk, temp)


def test_2d_input_and_errors():
    logits = torch.randn(10, 33)
    idx = torch.randint(0, 33, (10,))
    torch.testing.assert_close(
        selective_log_softmax(logits, idx, chunk_size=4),
        torch.log_softmax(logits, -1)[torch.arange(10), idx],
        rtol=0,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="index shape"):
        selective_log_softmax(logits, idx[:5])
    with pytest.raises(ValueError, match="chunk_size"):
        selective_log_softmax(logits, idx, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        selective_log_softmax(logits, idx, temperature=0.0)


def test_bf16_logits():
    # Chunks are upcast to float32, so the result equals the naive float32 computation on the
    # same bf16 values within 1e-5; versus a naive bf16 log_softmax (what a bf16 model would give
    # without upcasting) the difference is bf16 rounding (8-bit mantissa): within 1% relative. The
    # gradient is returned in bf16: within 1e-2 of the float32 one.
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(2, 9, 3001, generator=g) * 3).bfloat16().requires_grad_(True)
    idx = torch.randint(0, 3001, (2, 9), generator=g)
    got = selective_log_softmax(full, idx, chunk_size=4)
    assert got.dtype == torch.float32
    want, want_ent = naive(full.detach().float(), idx)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    bf16_naive = torch.log_softmax(full.detach(), -1).gather(-1, idx[..., None]).squeeze(-1).float()
    torch.testing.assert_close(got, bf16_naive, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(entropy_from_logits(full, 4), want_ent, rtol=0, atol=1e-5)
    (g_got,) = torch.autograd.grad(got.sum(), full)
    f32 = full.detach().float().requires_grad_(True)
    (g_want,) = torch.autograd.grad(naive(f32, idx)[0].sum(), f32)
    assert g_got.dtype == torch.bfloat16
    torch.testing.assert_close(g_got.float(), g_want, rtol=0, atol=1e-2)


def tiny_model(vocab=97):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def test_training_logprobs_equal_a_plain_forward_with_a_tiny_model():
    """Rows of different prompt and completion lengths packed as training packs them ([left-padded
    prompt | completion | right padding], real-token positions): each row's log-probs, entropy and
    their gradient equal an unpadded forward of that row alone with a full-vocabulary log-softmax."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (5, 3, 4)]
    completions = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (4, 2, 1)]
    batch = pack(prompts, completions, pad_id=0)
    mask = batch.completion_mask  # (B, T)
    w = torch.randn(mask.shape, generator=g)
    for temp in (1.0, 0.6):
        logp, ent = completion_logprobs(model, batch, temperature=temp)
        assert not ent.requires_grad and logp.shape == mask.shape == (3, 4)
        grads = torch.autograd.grad((logp * mask * w).sum(), list(model.parameters()))
        want_total = 0.0
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids = torch.tensor([p + c])
            logits = model(input_ids=ids).logits[:, len(p) - 1 : -1]  # (1, |c|, V): position j predicts j + 1
            want, want_ent = naive(logits, torch.tensor([c]), temp)
            torch.testing.assert_close(logp[i, : len(c)], want[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(ent[i, : len(c)], want_ent[0], rtol=0, atol=1e-5)
            want_total = want_total + (want[0] * w[i, : len(c)]).sum()
        want_grads = torch.autograd.grad(want_total, list(model.parameters()))
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    _, none = completion_logprobs(model, batch, with_entropy=False)
    assert none is None


def test_large_vocab_accuracy_against_float64():
    # At 151k vocabulary two float32 computations differ by a few 1e-5 (the naive entropy itself
    # is ~4e-5 off the float64 value for logits of scale 3); the chunked path stays within 2e-5
    # of float64.
    g = torch.Generator().manual_seed(2)
    full = torch.randn(2, 4, 151_000, generator=g, dtype=torch.float64) * 3
    idx = torch.randint(0, 151_000, (2, 4), generator=g)
    ref_logp = torch.log_softmax(full, -1).gather(-1, idx[..., None]).squeeze(-1)
    ref_ent = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)
    got = selective_log_softmax(full.float(), idx, chunk_size=3).double()
    ent = entropy_from_logits(full.float(), 3).double()
    torch.testing.assert_close(got, ref_logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-5)
