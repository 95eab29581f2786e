"""The HF sampler draws each prompt's samples from that prompt's own seed (Gumbel-max over the sampled
distribution, noise from one generator per prompt group): the same completions whichever call,
position or process samples the prompt, an exact draw from the distribution, and its log-probs are
the distribution's (the real built-in model, real `generate`)."""

from __future__ import annotations

import math

import pytest
import torch

from clipbench.models import load_model_and_tokenizer, resolve_model_name
from clipbench.rollout.base import prompt_seeds
from clipbench.rollout.hf import GroupNoise, HFSampler

PROMPTS = ["12+34=", "7+8=", "45-12=", "3+4="]


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model_and_tokenizer(resolve_model_name("builtin:arith-tiny"), dtype="float32", device="cpu")
    return model, tok


def test_a_prompts_samples_do_not_depend_on_the_call_it_is_sampled_in(tiny):
    model, tok = tiny
    s = HFSampler(model, tok, max_new_tokens=8, temperature=1.3)  # hot: varied completions
    seeds = [11, 22, 33, 44]
    whole = s.generate(PROMPTS, 6, seed=seeds)
    assert len(set(whole.texts)) > 4  # really random
    # the last two prompts alone, and the prompts reordered: the same rows, moved with their prompt
    assert s.generate(PROMPTS[2:], 6, seed=seeds[2:]).completion_ids == whole.completion_ids[12:]
    swapped = s.generate([PROMPTS[3], PROMPTS[0]], 6, seed=[44, 11])
    assert swapped.completion_ids == whole.completion_ids[18:] + whole.completion_ids[:6]
    # in calls of one prompt (max_batch): the same again
    assert (
        HFSampler(model, tok, max_new_tokens=8, temperature=1.3, max_batch=1)
        .generate(PROMPTS, 6, seed=seeds)
        .completion_ids
        == whole.completion_ids
    )
    # another seed, other samples; a call seed: per-prompt seeds from (seed, position), deterministic
    assert s.generate(PROMPTS, 6, seed=[12, 22, 33, 44]).completion_ids[:6] != whole.completion_ids[:6]
    assert s.generate(PROMPTS, 6, seed=5).completion_ids == s.generate(PROMPTS, 6, seed=5).completion_ids
    ordered = sorted(prompt_seeds(5, 50) + prompt_seeds([1, 2, 3], 3))  # 56 bits, far apart (vLLM: seed + j)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 10_000 and ordered[-1] < 2**56


def test_the_global_rng_is_neither_read_nor_advanced(tiny):
    model, tok = tiny
    s = HFSampler(model, tok, max_new_tokens=6)
    state = torch.random.get_rng_state()
    a = s.generate(PROMPTS, 3, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(12345)  # another global state: the same samples
    assert s.generate(PROMPTS, 3, seed=1).completion_ids == a.completion_ids


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampler_logp_is_the_log_prob_under_the_sampled_distribution(tiny, temperature, top_p):
    """Teacher-forced: log_softmax(top_p(logits / T)) of the model at each sampled token, computed
    here with one forward of the whole row, equals what the sampler returned (float32: 1e-5)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    model, tok = tiny
    s = HFSampler(model, tok, max_new_tokens=8, temperature=temperature, top_p=top_p, return_logprobs=True)
    r = s.generate(PROMPTS, 2, seed=7)
    for p_ids, c_ids, lp in zip(r.prompt_ids, r.completion_ids, r.sampler_logp):
        assert len(lp) == len(c_ids) > 0
        ids = torch.tensor([p_ids + c_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(p_ids) - 1 : -1].float()  # (T, V): predicts each completion token
        scores = TemperatureLogitsWarper(temperature)(ids, logits)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(ids, scores)
        want = scores.log_softmax(-1).gather(1, torch.tensor(c_ids)[:, None]).squeeze(1)
        assert (torch.tensor(lp) - want).abs().max() < 1e-5


def test_gumbel_max_draws_follow_the_distribution():
    """20,000 rows over fixed logits: each category's frequency within 4.5 standard errors of its
    probability (p = softmax(logits / 0.8)); tokens outside top-p 0.9 are never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20_000
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    noise = GroupNoise([TemperatureLogitsWarper(0.8)], [torch.Generator().manual_seed(0)], n, record=False)
    draws = noise(torch.zeros(n, 1, dtype=torch.long), logits.repeat(n, 1)).argmax(-1)
    p = (logits / 0.8).softmax(-1)
    freq = torch.bincount(draws, minlength=6).double() / n
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 4.5 * se + 1e-12).all(), (freq, p)

    nucleus = GroupNoise([TopPLogitsWarper(0.9)], [torch.Generator().manual_seed(1)], n, record=False)
    kept = set(nucleus(torch.zeros(n, 1, dtype=torch.long), logits.repeat(n, 1)).argmax(-1).tolist())
    cum = torch.cumsum(logits.softmax(-1), 0)
    allowed = {i for i in range(6) if i == 0 or cum[i - 1] < 0.9 - 1e-9}  # the smallest set with mass >= 0.9
    assert kept <= allowed and len(kept) >= 2
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)
