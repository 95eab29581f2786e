"""Exact micro-batching: a mini-batch split into row slices (micro-batches or ranks), each call given
the whole mini-batch's counts (prompt-mean: its prompt groups and each row's group tokens), its
slice of the pre-drawn uniforms and of the per-row inputs (rewards, entropy, the sampler
correction's weights and status), and the rule's mini-batch statistic (bapo, m2po: computed on the
whole mini-batch), sums to the unsplit loss and gradient, and its statistics combine to the unsplit
ones (counts exactly).

Per-call rules (``METHODS[m].per_call``: clip_cov and kl_cov, whose token choice uses this call's
covariance and token count, as verl computes them per micro-batch) are exact only unsplit; split,
they are the rule applied to each micro-batch, and their counts still combine exactly."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from clipbench.objectives import AGGREGATIONS, METHODS, combine, finalize, global_counts, policy_loss, reduction
from clipbench.objectives.aggregation import aggregate, group_counts
from clipbench.objectives.corrections import REJECTED, apply_correction
from clipbench.objectives.loss import mini_batch_stat

B, T = 8, 12
SPLITS = {"one": [8], "two": [4, 4], "uneven": [5, 2, 1]}


def _batch():
    g = torch.Generator().manual_seed(21)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + torch.randn(B, T, generator=g) * 0.5
    A = torch.randn(B, generator=g)
    A[3] = 0.0
    lens = torch.tensor([12, 3, 7, 12, 1, 9, 5, 10])
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    mask[4] = 0.0  # an all-padding row
    u = torch.rand(B, T, generator=g)
    return logp, old, A, mask, u


def _rows():
    """Per-row inputs: rewards, entropy, prompt groups of two rows, and a sampler correction (IcePop
    with a narrow band: some tokens masked; kl_rs: some rejected from the denominators)."""
    logp, old, A, mask, u = _batch()
    g = torch.Generator().manual_seed(5)
    sampler = old + torch.randn(B, T, generator=g) * 0.3
    return {
        "rewards": (A > 0).float(),
        "entropy": torch.rand(B, T, generator=g),
        "groups": torch.arange(B) // 2,
        "sampler": sampler,  # rollout_is's rollout policy
        "icepop": apply_correction({"name": "icepop", "low": 0.8, "high": 1.25}, sampler, old, mask),
        "kl_rs": apply_correction(
            {"name": "kl_rs", "estimator": "k1", "level": "token", "low": 0.8, "high": 1.25}, sampler, old, mask
        ),
        "vaco": apply_correction({"name": "vaco", "high": 0.3}, sampler, old, mask, advantages=A),
    }


# small GSPO bands so that some sequences are clipped at this spread
PARAMS = {"gspo": {"eps_low": 0.05, "eps_high": 0.05}, "gspo_token": {"eps_low": 0.05, "eps_high": 0.05}}


def _call(method, agg, logp, old, A, mask, u, idx=None, correction=None, **counts):
    rows = _rows()
    idx = torch.arange(B) if idx is None else idx
    extra = {
        "rewards": rows["rewards"][idx],
        "entropy": rows["entropy"][idx],
        "groups": rows["groups"][idx],
        "sampler_logp": rows["sampler"][idx],
    }
    if correction is not None:
        extra.update(weights=rows[correction].weights[idx], correction_status=rows[correction].status[idx])
    lp = logp.clone().requires_grad_(True)
    out = policy_loss(
        method, lp, old, A, mask, agg=agg, uniforms=u, max_len=16, **counts, **extra, **PARAMS.get(method, {})
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad


def _mini_batch(method, logp, old, A, mask, correction=None):
    """What the trainer gives every micro-batch: the counts (without rejected tokens), prompt-mean's
    group counts (B,), the rule's mini-batch statistic."""
    counted = mask
    if correction is not None:
        counted = mask * (_rows()[correction].status != REJECTED)
    counts = global_counts(counted)
    groups = group_counts(counted, _rows()["groups"])
    stat = mini_batch_stat(method, logp, old, A, mask, **PARAMS.get(method, {}))
    return counts, groups, ({} if stat is None else {"batch_stat": stat})


CORRECTIONS = {"grpo": ["icepop", "kl_rs", "vaco"], "bapo": ["kl_rs"], "m2po": ["icepop"], "rollout_is": ["vaco"]}


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize(
    "method, correction", [(m, None) for m in sorted(METHODS)] + [(m, c) for m, cs in CORRECTIONS.items() for c in cs]
)
def test_split_calls_sum_to_the_unsplit_loss_gradient_and_counts(method, correction, agg):
    logp, old, A, mask, u = _batch()
    full, full_grad = _call(method, agg, logp, old, A, mask, u, correction=correction)
    counts, groups, stat = _mini_batch(method, logp, old, A, mask, correction)
    order = torch.randperm(B, generator=torch.Generator().manual_seed(4))  # rows in any order
    per_call = METHODS[method].per_call
    for name, sizes in SPLITS.items():
        loss, grad, sums = 0.0, torch.zeros_like(logp), []
        for idx in order.split(sizes):
            out, g = _call(
                method,
                agg,
                logp[idx],
                old[idx],
                A[idx],
                mask[idx],
                u[idx],
                idx,
                correction,
                **counts,
                global_prompts=groups["global_prompts"],
                group_tokens=groups["group_tokens"][idx],
                **stat,
            )
            loss = loss + out.loss
            grad[idx] = g
            sums.append(out.sums)
        if per_call and name != "one":
            merged = combine(sums)
            for key in ("n_tokens", "q1/tokens", "q3/tokens", "zero_adv/tokens", "on_policy/tokens"):
                assert torch.equal(merged[key], full.sums[key]), key
            continue
        # float32 sums in another order differ by ~1e-7 of the terms' magnitude, which is the loss of
        # |l| (the terms cancel: with a correction's weights, icepop's token-sum is 0.245 of terms
        # summing to 12 in magnitude, off by 3e-6 when split)
        scale = float(aggregate(full.token_loss.detach().abs(), mask, agg, 16, groups=_rows()["groups"]))
        torch.testing.assert_close(loss, full.loss, rtol=1e-6, atol=max(1e-7, 1e-6 * scale), msg=f"{name}: loss")
        torch.testing.assert_close(grad, full_grad, rtol=1e-5, atol=1e-8, msg=f"{name}: gradient")
        merged = combine(sums)
        assert merged.keys() == full.sums.keys()
        for key, want in full.sums.items():
            if (
                key.startswith("n_")
                or key.split("/")[-1] in ("tokens", "out_of_band", "zero_grad", "rescued", "in_band_near")
                or reduction(key) != "sum"
            ):
                assert torch.equal(merged[key], want), (name, key, merged[key], want)
            else:
                torch.testing.assert_close(merged[key], want, rtol=1e-6, atol=1e-9, msg=f"{name}: {key}")
        stats = finalize(merged)
        for key, want in full.stats.items():
            torch.testing.assert_close(stats[key], want, rtol=1e-6, atol=1e-9, msg=f"{name}: {key}")


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from clipbench.objectives import all_reduce_sums

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        logp, old, A, mask, u = _batch()
        rows = torch.arange(B)[rank::world]  # this rank's rows
        counts = global_counts(mask)  # what the trainer all-reduces first
        out_r = policy_loss("nsr", logp[rows], old[rows], A[rows], mask[rows], uniforms=u[rows], **counts)
        reduced = all_reduce_sums(out_r.sums)
        if rank == 0:
            torch.save({k: v.clone() for k, v in reduced.items()}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_reduce_sums_across_two_real_processes(tmp_path):
    # Two gloo ranks each compute their half of the rows; all_reduce_sums gives the unsplit sums.
    import torch.multiprocessing as mp

    out = str(tmp_path / "sums.pt")
    init = f"file://{tmp_path / 'rendezvous'}"
    # spawn, not fork: forking a process whose OpenMP/gloo threads already run (an xdist worker that
    # has trained before) can deadlock the child; this test hung CI that way.
    mp.start_processes(_rank, args=(2, init, out), nprocs=2, join=True, start_method="spawn")
    got = torch.load(out)
    logp, old, A, mask, u = _batch()
    want = policy_loss("nsr", logp, old, A, mask, uniforms=u).sums
    assert got.keys() == want.keys()
    for key, v in want.items():
        if reduction(key) != "sum" or key.startswith("n_") or key.split("/")[-1] in ("tokens", "zero_grad"):
            assert torch.equal(got[key], v), key
        else:
            torch.testing.assert_close(got[key], v, rtol=1e-6, atol=1e-9, msg=key)
