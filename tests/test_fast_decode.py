"""The hf sampler's own decode loop (rollout/decode.py) samples transformers' `generate` tokens with
the same log-probs, bit for bit, on the built-in models at the shapes the trainer and the evaluation
use and at the edges of its shortcuts (fewer than 4 prompts: no shared prefill; rows finishing early:
the batch shrinks; truncation at max_new_tokens); and it does less work: one prefill row per prompt,
and no forward for a row after its EOS."""

from __future__ import annotations

import pytest
import torch

from clipbench.models import load_model_and_tokenizer, resolve_model_name
from clipbench.rollout import decode as decode_mod
from clipbench.rollout.hf import HFSampler

PROMPTS = ["37+45-12=", "3+4-1=", "99-50+7=", "11+12-13=", "5+5-5=", "80-9+10=", "1+2-3=", "64+16-20="] * 2


@pytest.fixture(scope="module")
def organism():
    return load_model_and_tokenizer(resolve_model_name("builtin:arith-organism"))


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as a sweep's runs have on one core each (where the own loop is used)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def both(model, tok, prompts, n, seed, **settings):
    out = {}
    for own in (False, True):
        s = HFSampler(model, tok, return_logprobs=True, **settings)
        s.own_loop = own
        out[own] = s.generate(prompts, n, seed=seed)
    return out[False], out[True]


def count_rows(model) -> tuple[list, object]:
    """(the rows of every forward of `model`, the hook's handle)."""
    rows: list[tuple[int, int]] = []
    handle = model.model.register_forward_pre_hook(
        lambda m, args, kw: rows.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    return rows, handle


@pytest.mark.parametrize(
    "prompts,n,settings",
    [
        (16, 8, {"max_new_tokens": 48}),  # a rollout step: 16 prompts x 8
        (16, 64, {"max_new_tokens": 48}),  # an evaluation's call at the ends: 16 problems x 64
        (3, 8, {"max_new_tokens": 48}),  # fewer than 4 prompts: one prefill per row, as generate
        (1, 2, {"max_new_tokens": 48}),  # 2 rows: the batch never shrinks below its start
        (5, 3, {"max_new_tokens": 48, "temperature": 0.7, "top_p": 0.9}),  # warpers first
        (16, 8, {"max_new_tokens": 12, "temperature": 1.3}),  # every row truncated
    ],
)
def test_the_own_loop_equals_generate(organism, prompts, n, settings):
    model, tok = organism
    ref, own = both(model, tok, PROMPTS[:prompts], n, seed=prompts * 1000 + n, **settings)
    assert own.completion_ids == ref.completion_ids
    assert own.sampler_logp == ref.sampler_logp  # floats, compared exactly
    assert own.truncated == ref.truncated and own.texts == ref.texts
    assert len({len(c) for c in ref.completion_ids}) > 1 or len(ref) == 2 or settings["max_new_tokens"] == 12


def test_rows_that_finish_early_leave_the_batch(organism):
    """A hot sampler (temperature 3): rows end anywhere between 1 and 48 tokens. The same tokens, and
    far fewer rows computed than generate's, which computes every row until the last one ends."""
    model, tok = organism
    seen = {}
    for own in (False, True):
        rows, handle = count_rows(model)
        s = HFSampler(model, tok, max_new_tokens=48, temperature=3.0, return_logprobs=True)
        s.own_loop = own
        seen[own] = (s.generate(PROMPTS, 8, seed=3), rows)
        handle.remove()
    (ref, ref_rows), (own, own_rows) = seen[False], seen[True]
    assert own.completion_ids == ref.completion_ids and own.sampler_logp == ref.sampler_logp
    lengths = sorted(len(c) for c in ref.completion_ids)
    assert lengths[0] < 5 and lengths[-1] == 48  # rows end far apart, some truncated
    assert ref_rows[0] == (128, 10) and own_rows[0] == (16, 10)  # the prefill: each prompt once
    assert all(r == (128, 1) for r in ref_rows[1:]) and len(ref_rows) == lengths[-1]  # every row, every position
    decoded = sum(r[0] for r in own_rows[1:])
    # each row's forwards: at most its own length and an eighth of the batch's (the gathering's lag)
    assert decoded <= sum(lengths) + len(own_rows) * 128 // decode_mod.GATHER_EVERY
    assert decoded < 0.6 * sum(r[0] for r in ref_rows[1:])


def test_the_own_loop_is_used_only_where_it_is_exact(organism):
    model, _ = organism
    assert decode_mod.row_exact(model, torch.float32, sharded=False, routes=False)
    assert not decode_mod.row_exact(model, torch.bfloat16, sharded=False, routes=False)  # autocast
    assert not decode_mod.row_exact(model, torch.float32, sharded=True, routes=False)  # lockstep collectives
    torch.set_num_threads(2)  # a product split among threads by its shape
    assert not decode_mod.row_exact(model, torch.float32, sharded=False, routes=False)
    torch.set_num_threads(1)
    assert not decode_mod.row_exact(model, torch.float32, sharded=False, routes=True)  # routing replay's record
    moe, _ = load_model_and_tokenizer(resolve_model_name("builtin:arith-steps-moe"))
    assert not decode_mod.row_exact(moe, torch.float32, sharded=False, routes=False)  # experts batch tokens


def test_calls_sampled_together_equal_each_call_alone(organism):
    """An evaluation's batches through `generate_calls`: each call's rollout equals its own `generate`
    call bit for bit; calls whose prompts pad to the same width are sampled together (up to
    `merge_rows` rows), a call of another width on its own."""
    model, tok = organism
    s = HFSampler(model, tok, max_new_tokens=48, return_logprobs=True)
    wide = PROMPTS[:4]  # "11+12-13=": 9 characters, BOS first
    narrow = ["3+4-1=", "5+5-5=", "1+2-3=", "7-7+7="]  # 6 characters
    calls = [(wide, 11), (wide[::-1], 12), (narrow, 13), (wide[1:], 14)]
    rows, handle = count_rows(model)
    together = s.generate_calls(calls, 8)
    handle.remove()
    alone = [s.generate(prompts, 8, seed=seed) for prompts, seed in calls]
    for a, b in zip(together, alone):
        assert a.completion_ids == b.completion_ids and a.sampler_logp == b.sampler_logp
        assert a.texts == b.texts and a.prompt_ids == b.prompt_ids and a.truncated == b.truncated
    # three calls: the first two together (64 rows, one width), the narrow one, the last one (its width
    # again, after another): prefills of one row per prompt, and of one per row for the last's 3 prompts
    assert [r for r in rows if r[1] > 1] == [(8, 10), (4, 7), (24, 10)]
    s.merge_rows = 32  # one call's rows: none merged
    assert [a.completion_ids for a in s.generate_calls(calls[:2], 8)] == [b.completion_ids for b in alone[:2]]
