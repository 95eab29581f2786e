"""Exact micro-batching: the loss, every parameter's gradient and every count of a mini-batch are the
same whether it runs as one forward/backward, as 2 or an uneven number of micro-batches, or split
over ranks (simulated here in one process: FSDP's gradient average is the mean of the ranks' gradients;
tests/test_distributed.py runs real processes).

The step-function test runs the model in float64, so that what it measures is the split, not the
model's float32 round-off magnified by the cancellation of positive and negative advantages (in
float32 the gradients of a split batch differ by ~3e-5 relative in the first layer for that reason
alone): every parameter's gradient then agrees to ~1e-14 (measured; asserted 1e-12), while the loss
value, computed in float32 by `policy_loss`, agrees to ~2e-7 (asserted 1e-6). A wrong normaliser
would be off by a factor (>= 1e-2). The float32 training run is checked at its logged loss and
grad_norm (1e-5 relative), as the issue asks.
"""

from __future__ import annotations

import pytest
import torch

from clipbench.config import load_run_config
from clipbench.errors import ConfigError
from clipbench.models import load_model_and_tokenizer, resolve_model_name
from clipbench.objectives.advantages import compute_advantages
from clipbench.objectives.corrections import apply_correction
from clipbench.tracking.store import RunDir
from clipbench.train.distributed import Dist
from clipbench.train.logprobs import completion_logprobs
from clipbench.train.loop import run_training
from clipbench.train.packing import pack
from clipbench.train.step import (
    Objective,
    StepInputs,
    accumulate_gradients,
    draw_uniforms,
    optimizer_step,
    pack_micro_batches,
    plan_update,
)

G = 4


def _tiny():
    model, tok = load_model_and_tokenizer(resolve_model_name("builtin:arith-tiny"))
    return model.double(), tok


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


@pytest.fixture(scope="module")
def batch(tiny):
    return _make_batch(*tiny)


def _make_batch(model, tok):
    """16 rows (4 groups of 4): prompts of 6-9 tokens, completions of 0-9 tokens (one empty, so a
    sequence without valid tokens), one all-equal group (A = 0), old log-probs off-policy."""
    g = torch.Generator().manual_seed(0)
    prompts = [tok(p)["input_ids"] for p in ("12+7=", "3-45=", "99+99=", "5+5=")]
    lengths = torch.randint(1, 10, (4 * G,), generator=g).tolist()
    lengths[5] = 0
    completions = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in lengths]
    packed = pack([p for p in prompts for _ in range(G)], completions, tok.pad_token_id)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    adv = compute_advantages(rewards, "group").reshape(-1)  # (16,), group 1 all zero
    with torch.no_grad():
        logp, _ = completion_logprobs(model, packed, with_entropy=False)  # (16, T)
    mask = packed.completion_mask
    old = (logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)) * mask  # ratios well away from 1
    ref = (logp + 0.1 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)) * mask
    sampler = old + 0.3 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)  # a sampler that disagrees
    return packed, adv, old, ref, rewards.reshape(-1), sampler


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _run(model, tok, batch, objective, *, budget, world=1, correction=None):
    """Loss, counts and gradients of one mini-batch (all 16 rows) split by `budget` over `world` ranks."""
    packed, adv, old, ref, rewards, sampler = batch
    model.zero_grad(set_to_none=True)
    uniforms = draw_uniforms(packed.completion_ids.shape, torch.Generator().manual_seed(7), "cpu")
    inputs = StepInputs(
        advantages=adv,
        old_logp=old,
        ref_logp=ref if objective.beta else None,
        uniforms=uniforms if objective.draws else None,
        rewards=rewards,
        groups=tuple(i // G for i in range(16)),
        mask=packed.completion_mask,
        sampler_logp=sampler if objective.reads_rollout_logp else None,  # rollout_is, as rule_inputs sets it
    )
    if correction is not None:  # the sampler correction's weights and status, as rule_inputs computes them
        corr = apply_correction(correction, sampler, old, packed.completion_mask, advantages=adv)
        inputs.weights, inputs.correction_status = corr.weights, corr.status
    loss, counts, micro = 0.0, {}, []
    for rank in range(world):
        dist = Dist(rank=rank, world=world)
        (step,) = plan_update(
            packed, mini_batches=1, epochs=1, budget=budget, perm=torch.Generator().manual_seed(3), dist=dist
        )
        stats, _ = accumulate_gradients(
            model, packed, step, inputs, objective, pad_id=tok.pad_token_id, temperature=1.0, dist=dist
        )
        sums = stats.sums()
        loss += float(sums["loss"])
        micro.append([len(m) for m in step.micro])
        for k, v in sums.items():
            if k.split("/")[0] in ("q1", "q2", "q3", "q4", "zero_adv", "on_policy", "correction"):
                counts[k] = counts.get(k, 0.0) + float(v)
            elif k.startswith("stat/"):  # a rule's mini-batch statistic: the same in every call
                counts[k] = max(counts.get(k, float("-inf")), float(v))
    counts["clip_events"] = sum(v for k, v in counts.items() if k.endswith("/out_of_band"))
    grads = {n: g / world for n, g in _grads(model).items()}  # FSDP averages the ranks' gradients
    return loss, counts, grads, micro


CASES = [
    ("grpo", {}, "token-mean", 0.0, None),
    ("grpo", {}, "seq-mean-token-mean", 0.1, None),
    ("gspo", {}, "seq-mean-token-sum", 0.0, None),
    ("dual_clip", {}, "seq-mean-token-sum-norm", 0.0, None),
    ("cispo", {"eps_high": 0.2}, "token-mean", 0.0, None),
    ("nsr", {"p": 0.5}, "token-mean", 0.0, None),
    # rules with a mini-batch statistic (a no-grad pass over the whole mini-batch when split),
    # with rewards, with the entropy; the prompt-mean and token-sum aggregations; corrections
    # that mask (in the denominators) and reject (out of them)
    ("bapo", {"target": 2.0}, "token-mean", 0.0, {"name": "icepop", "low": 0.8, "high": 1.25}),
    ("m2po", {}, "prompt-mean", 0.0, None),
    ("m2po", {"action": "clip"}, "token-sum", 0.0, None),
    ("aspo", {}, "seq-mean-token-mean", 0.0, None),
    ("topr", {}, "prompt-mean", 0.0, None),
    ("grpo", {}, "token-mean", 0.0, {"name": "kl_rs", "estimator": "k1", "level": "token", "low": 0.8, "high": 1.25}),
    # the rules of issue 38: the sampler's log-probs sliced per micro-batch (rollout_is), with vaco
    # (which reads the advantages); a sequence mask (opsm); a penalty that moves zero-advantage tokens
    ("rollout_is", {"eps_low": 0.5, "eps_high": 0.5}, "token-mean", 0.0, {"name": "vaco", "high": 0.3}),
    ("opsm", {"delta": 0.02}, "seq-mean-token-mean", 0.0, None),
    ("ipo", {}, "token-sum", 0.0, None),
    ("cfpo", {}, "token-mean", 0.0, None),
]


@pytest.mark.parametrize("method, params, agg, beta, correction", CASES)
@pytest.mark.slow
def test_step_function_is_exact_over_micro_batches_and_ranks(tiny, batch, method, params, agg, beta, correction):
    """Every parameter's gradient (1e-12 relative), the loss (1e-6) and every token count equal, for
    1 micro-batch, 2 micro-batches, an uneven number, and 2 ranks with uneven micro-batches (one rank
    runs a placeholder to stay in step); nsr's draws are pre-drawn uniforms, split with the rows."""
    model, tok = tiny
    objective = Objective(method, {**params}, agg, beta, max_len=12)
    loss0, counts0, grads0, micro0 = _run(model, tok, batch, objective, budget=0, correction=correction)
    assert micro0 == [[16]] and counts0["clip_events"] > 0 and loss0 != 0.0, counts0
    # a sum of O(1) token losses: float32 round-off grows with the terms (token-sum has no normaliser)
    scale = max(abs(loss0), 1.0) * (
        sum(v for k, v in counts0.items() if k.endswith("/tokens")) if agg == "token-sum" else 1.0
    )
    # (ranks simulated in one process cannot all-reduce a mini-batch statistic's forward: the rules
    # with one are checked over two real processes below)
    for budget, world in ((120, 1), (40, 1)) + (() if objective.stat else ((40, 2),)):
        loss, counts, grads, micro = _run(
            model, tok, batch, objective, budget=budget, world=world, correction=correction
        )
        sizes = [n for m in micro for n in m]
        assert sum(sizes) == 16 and len(sizes) > 1, micro  # () placeholders count 0
        if budget == 40:
            assert len(set(sizes)) > 1, micro  # uneven micro-batches (placeholders included)
        assert abs(loss - loss0) <= 1e-6 * scale, (budget, world, loss, loss0)
        assert {k: v for k, v in counts.items() if "mass" not in k} == {
            k: v for k, v in counts0.items() if "mass" not in k
        }, (budget, world)
        assert all(abs(counts[k] - v) <= 1e-6 * max(abs(v), 1e-3) for k, v in counts0.items() if "mass" in k)
        for name, g0 in grads0.items():
            err = (grads[name] - g0).norm()
            assert err <= 1e-12 * g0.norm() + 1e-15, (budget, world, name, float(err), float(g0.norm()))


def _two_ranks(rank: int, init: str, out: str, method: str, params: dict, agg: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        model, tok = _tiny()
        batch = _make_batch(model, tok)
        objective = Objective(method, params, agg, 0.0, max_len=12)
        packed, adv, old = batch[:3]
        inputs = StepInputs(
            advantages=adv,
            old_logp=old,
            rewards=batch[4],
            groups=tuple(i // G for i in range(16)),
            mask=packed.completion_mask,
        )
        (step,) = plan_update(
            packed,
            mini_batches=1,
            epochs=1,
            budget=40,
            perm=torch.Generator().manual_seed(3),
            dist=Dist(rank=rank, world=2),
        )
        stats, _ = accumulate_gradients(
            model,
            packed,
            step,
            inputs,
            objective,
            pad_id=tok.pad_token_id,
            temperature=1.0,
            dist=Dist(rank=rank, world=2),
        )
        sums = stats.sums()
        torch.save(
            {
                "grads": _grads(model),
                "loss": float(sums["loss"]),
                "stat": {k: float(v) for k, v in sums.items() if k.startswith("stat/")},
            },
            f"{out}.{rank}",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method, params, agg", [("bapo", {"target": 2.0}, "token-mean"), ("m2po", {}, "prompt-mean")])
@pytest.mark.slow
def test_a_mini_batch_statistic_is_exact_across_two_real_processes(tiny, batch, tmp_path, method, params, agg):
    """Two gloo ranks, each with uneven micro-batches of its half of the mini-batch: the rule's
    statistic comes from a no-grad forward of every rank's rows (all-reduced) before the first
    backward, so the ranks' averaged gradients (FSDP's) equal one process's unsplit step."""
    import torch.multiprocessing as mp

    model, tok = tiny
    objective = Objective(method, params, agg, 0.0, max_len=12)
    loss0, counts0, grads0, _ = _run(model, tok, batch, objective, budget=0)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        _two_ranks, args=(init, str(tmp_path / "out"), method, params, agg), nprocs=2, join=True, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    assert abs(sum(r["loss"] for r in ranks) - loss0) <= 1e-6 * max(abs(loss0), 1.0)
    assert ranks[0]["stat"] == ranks[1]["stat"] and ranks[0]["stat"] == {
        k: v for k, v in counts0.items() if k.startswith("stat/")
    }
    for name, g0 in grads0.items():
        g = (ranks[0]["grads"][name] + ranks[1]["grads"][name]) / 2  # FSDP averages; each loss is x world
        assert (g - g0).norm() <= 1e-12 * g0.norm() + 1e-15, name


@pytest.mark.slow  # uses the built-in model (built on a fresh machine)
def test_packing_budget_whole_sequences_and_rank_lockstep(tiny, batch):
    packed = batch[0]
    rows = list(range(16))  # (test_packing)
    assert pack_micro_batches(packed, rows, 0) == [rows]  # no budget: the mini-batch, in order
    for budget in (1, 25, 40, 120):
        micro = pack_micro_batches(packed, rows, budget)
        assert sorted(i for m in micro for i in m) == rows  # every row once, never split
        for m in micro:  # within budget, or a single row that is longer than it
            assert len(m) * packed.width(m) <= budget or len(m) == 1
    assert len(pack_micro_batches(packed, rows, 1)) == 16
    # 2 ranks: each trains its block of every mini-batch; the lists are padded to equal length
    plans = [
        plan_update(
            packed,
            mini_batches=3,
            epochs=2,
            budget=25,
            perm=torch.Generator().manual_seed(1),
            dist=Dist(rank=r, world=2),
        )
        for r in range(2)
    ]
    single = plan_update(packed, mini_batches=3, epochs=2, budget=0, perm=torch.Generator().manual_seed(1), dist=Dist())
    assert len(plans[0]) == len(plans[1]) == len(single) == 6
    for s, a, b in zip(single, *plans):
        assert len(a.micro) == len(b.micro)
        assert sorted(i for m in a.micro + b.micro for i in m) == sorted(s.micro[0])  # the same mini-batch
        assert (a.tokens, a.seqs) == (b.tokens, b.seqs) == (s.tokens, s.seqs)


@pytest.mark.parametrize("method, params, agg", [("m2po", {}, "prompt-mean"), ("nsr", {"p": 0.5}, "token-mean")])
def test_the_rule_is_bound_once_per_run_not_looked_up_or_validated_per_micro_batch(
    tiny, batch, monkeypatch, method, params, agg
):
    """The Objective binds its rule when it is built (one validation); the steps' micro-batches
    (here 3 to 4 per step, a mini-batch statistic's extra forward, pre-drawn uniforms) then neither
    look the rule up in the registry nor validate its parameters again."""
    from test_objectives_inputs import Counter

    n = Counter(monkeypatch)
    objective = Objective(method, dict(params), agg, 0.0, max_len=12)
    assert n.validations == 1
    setup = (n.lookups, n.validations)
    for budget in (40, 60):
        _, _, _, micro = _run(*tiny, batch, objective, budget=budget)
        assert len(micro[0]) > 2, micro
    assert (n.lookups, n.validations) == setup


def test_grad_clip_zero_means_no_clipping_and_the_norm_is_logged():
    """grad_clip 0: the step uses the raw gradient (SGD lr 1: w -= g) and returns its norm 5."""
    for clip, expected in ((0.0, [-3.0, -4.0]), (1.0, [-0.6, -0.8])):
        w = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([w], lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        w.grad = torch.tensor([3.0, 4.0])
        model = torch.nn.Module()
        model.w = w
        norm, stepped = optimizer_step(model, opt, sched, clip)
        assert stepped and float(norm) == pytest.approx(5.0)
        assert w.detach().tolist() == pytest.approx(expected)
    w.grad = torch.tensor([float("nan"), 1.0])
    norm, stepped = optimizer_step(model, opt, sched, 1.0)
    assert not stepped and w.grad is None and w.detach().tolist() == pytest.approx([-0.6, -0.8])


SMALL = [
    "train.prompts_per_step=4",
    "sampler.group_size=4",
    "sampler.max_new_tokens=8",
    "eval.benchmarks=[]",
    "tracking.mlflow=false",
    "train.steps=2",
]


@pytest.mark.slow
@pytest.mark.parametrize("lag", [[], ["sampler.lag=1", "sampler.old_logp=sampler"]], ids=["on-policy", "lagged"])
def test_a_run_with_micro_batches_logs_the_same_loss_grad_norm_and_counts(tmp_path, lag):
    """2 rollout steps x 4 optimizer steps with and without train.micro_batch_tokens (2-4 micro-batches
    per step): the same loss and grad_norm (1e-5 relative; token losses are O(1) with unit-std
    advantages, so the scale of a near-zero net loss is taken as 1) and identical counts. Lagged
    (sampler.lag: the second rollout step sampled by the base model), the batch's staleness too:
    the same out-of-band shares, its KL and ESS within 1e-5."""
    run_training(load_run_config("recipes/arith_tiny.yaml", SMALL + lag), tmp_path / "whole")
    run_training(
        load_run_config("recipes/arith_tiny.yaml", SMALL + lag + ["train.micro_batch_tokens=40"]), tmp_path / "micro"
    )
    whole, micro = RunDir(tmp_path / "whole").read_metrics(), RunDir(tmp_path / "micro").read_metrics()
    assert len(whole) == len(micro) == 8
    assert {r["micro_batches"] for r in whole} == {1} and max(r["micro_batches"] for r in micro) > 1
    for a, b in zip(whole, micro):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(abs(a["loss"]), 1.0), (a["opt_step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (
            a["opt_step"],
            a["grad_norm"],
            b["grad_norm"],
        )
        counts = [
            k for k in a if k.split("/")[0] in ("q1", "q2", "q3", "q4", "zero_adv", "on_policy") and "mass" not in k
        ]  # token counts: exact (gradient masses are float sums)
        assert [a[k] for k in counts] == [b[k] for k in counts] and a["clip_events"] == b["clip_events"]
        stale = [k for k in a if k.startswith("offpolicy/")]
        assert bool(stale) == bool(lag)
        for k in stale:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-9), (a["opt_step"], k)
    if lag:
        assert whole[-1]["offpolicy/lag"] == 1 and whole[-1]["offpolicy/kl"] > 0


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.micro_batch_tokens=-1", "train.micro_batch_tokens: must be in [0, 1099511627776], got -1"),
        ("sampler.prompts_per_call=-2", "sampler.prompts_per_call: must be in [0, 65536], got -2"),
        ("train.max_skipped_frac=1.5", "train.max_skipped_frac: must be in [0, 1]"),
        ("launch.nproc_per_node=3", "3 processes cannot share train.prompts_per_step=8"),
    ],
)
def test_loop_keys_are_checked(override, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_run_config("recipes/arith_tiny.yaml", [override])


def test_a_grouped_aggregation_registered_after_import_runs_in_the_built_in_step(tiny, batch):
    """A user's aggregation that reads the prompt groups, registered after clipbench was imported (as a
    plugin file would), passes the preflight and trains: the built-in step hands it the mini-batch's
    prompt counts, unsplit and over micro-batches, so it equals prompt-mean's loss and gradients."""
    from clipbench.objectives.aggregation import AGGREGATIONS, prompt_mean

    AGGREGATIONS.register(
        "my-prompt-mean", lambda token_loss, maskf, n: prompt_mean(token_loss, maskf, n), needs_groups=True
    )
    model, tok = tiny
    loss0, _, grads0, _ = _run(model, tok, batch, Objective("grpo", {}, "prompt-mean", 0.0, max_len=12), budget=0)
    for budget in (0, 40):
        loss, _, grads, _ = _run(
            model, tok, batch, Objective("grpo", {}, "my-prompt-mean", 0.0, max_len=12), budget=budget
        )
        assert abs(loss - loss0) <= 1e-6 * max(abs(loss0), 1.0)
        assert all((grads[k] - g).norm() <= 1e-12 * g.norm() + 1e-15 for k, g in grads0.items())
