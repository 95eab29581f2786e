"""M2PO, TOPR, ASPO, BAPO and the token-sum / prompt-mean aggregations, each checked in value and
gradient against an independent transcription of its public implementation (tests/oracles: the
official M2PO code, the M2PO paper's Algorithm 1, AReaL, ROLL, the TOPR paper, Archer2.0, BAPO,
verl, SkyRL). Where clipbench departs from a source on purpose, the test says so (docs/objectives.md)."""

from __future__ import annotations

import pytest
import torch
from oracles import aspo_archer, bapo, m2po, skyrl_prompt_mean, topr, verl_agg

from clipbench.objectives import policy_loss
from clipbench.objectives.loss import mini_batch_stat


def make(seed=0, B=12, T=10, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2
    logp = old + torch.randn(B, T, generator=g) * spread
    A = torch.randn(B, generator=g)
    A[::5] = 0.0
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    return logp, old, A, mask, g


def ours(method, logp, old, A, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    out = policy_loss(method, lp, old, A, mask, **kw)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad


def theirs(fn, logp, *args, **kw):
    lp = logp.clone().requires_grad_(True)
    res = fn(lp, *args, **kw)
    loss = res[0] if isinstance(res, tuple) else res
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, res


def close(out, grad, want, want_grad):
    torch.testing.assert_close(out.loss.detach(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# M2PO


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_m2po_mask_is_the_papers_algorithm_1(seed):
    logp, old, A, mask, _ = make(seed)
    A2 = A[:, None].expand_as(logp)

    def paper(lp):
        return m2po.paper_m2po_loss(lp, old, A2, mask, 0.04)

    want, want_grad, (_, M) = theirs(paper, logp)
    out, grad = ours("m2po", logp, old, A, mask)  # defaults: tau 0.04, trust-region candidates, mask
    close(out, grad, want, want_grad)
    masked = int(((~M) & (mask > 0)).sum())
    assert masked > 0  # the budget binds on these batches
    assert float(out.stats["stat/m2_after"]) <= 0.04 < float(out.stats["stat/m2"])
    # the masked tokens keep their place in the denominator (the paper's 1 / sum_i |o_i|): their
    # gradient is 0, the others' is -A r / (all valid tokens)
    r = torch.exp(logp - old)
    torch.testing.assert_close(grad, torch.where(M, -A2 * r, 0.0) * mask / mask.sum(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("seed", [3, 4])
def test_m2po_all_candidates_masks_as_areal(seed):
    """AReaL's m2_threshold masks over every token, (log pi_behave - log pi_prox)^2: with the roles
    played by (logp, old_logp) its mask is m2po(candidates=all)'s. AReaL then divides by the KEPT
    tokens and clips with eps_clip; clipbench keeps the masked tokens in the denominator and uses
    the paper's unclipped surrogate (docs/objectives.md)."""
    logp, old, A, mask, _ = make(seed, spread=0.3)
    keep = m2po.areal_m2po_mask(logp, old, mask, 0.04)
    out, grad = ours("m2po", logp, old, A, mask, candidates="all")
    zero = (grad == 0) & (mask > 0)
    nonzero_adv = (A != 0)[:, None].expand_as(mask)
    assert torch.equal(zero & nonzero_adv, ~keep & (mask > 0) & nonzero_adv)
    assert int((~keep & (mask > 0)).sum()) > 0


@pytest.mark.parametrize("seed", [0, 5, 6])
def test_m2po_clip_is_the_official_code(seed):
    logp, old, A, mask, _ = make(seed)
    A2 = A[:, None].expand_as(logp)

    def official(lp):
        return m2po.official_m2po_loss(old, lp, A2, mask, 0.04)

    want, want_grad, (_, st) = theirs(official, logp)
    out, grad = ours("m2po", logp, old, A, mask, action="clip")
    close(out, grad, want, want_grad)
    assert float(out.stats["stat/clip_low"]) == pytest.approx(1 - st["m2po/clip_low"], rel=1e-6)
    assert float(out.stats["stat/clip_high"]) == pytest.approx(1 + st["m2po/clip_high"], rel=1e-6)


def test_m2po_clip_without_constraint_and_on_policy():
    # the candidates' mean M2 already within budget: no band ([0, 1e5]), the loss is -r A (official)
    logp, old, A, mask, _ = make(7, spread=0.05)
    out, grad = ours("m2po", logp, old, A, mask, action="clip")
    assert (float(out.stats["stat/clip_low"]), float(out.stats["stat/clip_high"])) == (0.0, 1e5)
    want, want_grad, _ = theirs(lambda lp: (-(A[:, None] * torch.exp(lp - old)) * mask).sum() / mask.sum(), logp)
    close(out, grad, want, want_grad)


# ---------------------------------------------------------------------------------------------
# TOPR


@pytest.mark.parametrize(
    "agg, roll_agg", [("token-mean", "token-mean"), ("seq-mean-token-mean", "seq-mean-token-mean")]
)
def test_topr_is_rolls_pg_variant(agg, roll_agg):
    logp, old, A, mask, g = make(8)
    scores = torch.tensor([1.0, 0.0, 1.0, -1.0, 0.0, 1.0, 0.5, 0.0, -0.5, 1.0, 0.0, 1.0])
    # a positive score with a negative advantage still gets plain policy gradient (the split is on the reward)
    A[0], A[2] = -0.7, 0.4

    def roll(lp):  # ROLL's log-probs and advantages are 0 at padding; its token-mean divides by the mask count
        return topr.roll_agg_loss(
            topr.roll_topr_token_loss(lp * mask, old * mask, A[:, None] * mask, scores, 0.7, 1.3),
            mask,
            roll_agg,
            global_valid_samples=int((mask.sum(-1) > 0).sum()),
        )

    want, want_grad, _ = theirs(roll, logp)
    out, grad = ours("topr", logp, old, A, mask, rewards=scores, agg=agg, positive_weight=0.7, negative_weight=1.3)
    close(out, grad, want, want_grad)


def test_topr_sequence_ratio_is_the_papers_form():
    """The paper: one loss per trajectory, -sg(w) R sum_t log p, w = 1 for R >= 0 and the trajectory
    ratio truncated to [0, 1] for R < 0; with A = R (the paper's reward, baseline 0), zero=positive,
    ratio=sequence and seq-mean-token-sum (the mean over trajectories of their sums)."""
    logp, old, A, mask, _ = make(9, spread=0.1)
    R = torch.tensor([1.0, -1.0, 0.0, -0.5, 2.0, -2.0, 1.0, -1.0, 0.0, 0.3, -0.3, 1.0])

    def paper(lp):
        return topr.paper_topr_seq_loss(lp, old, R, mask).mean()

    want, want_grad, _ = theirs(paper, logp)
    out, grad = ours("topr", logp, old, R, mask, rewards=R, zero="positive", ratio="sequence", agg="seq-mean-token-sum")
    close(out, grad, want, want_grad)


def test_topr_needs_rewards():
    logp, old, A, mask, _ = make(10)
    with pytest.raises(ValueError, match="reads the input 'reward': pass rewards="):
        policy_loss("topr", logp, old, A, mask)


# ---------------------------------------------------------------------------------------------
# ASPO


@pytest.mark.parametrize("seed", [0, 11])
def test_aspo_is_archer2s_policy_loss(seed):
    logp, old, A, mask, g = make(seed, spread=0.8)  # some r > 3 and r < 1/3: the soft dual clips act
    entropy = torch.rand(logp.shape, generator=g)
    A2 = A[:, None].expand_as(logp)

    def archer(lp):
        return aspo_archer.archer_policy_loss(old, lp, A2, mask.bool(), entropy=entropy)[0]

    want, want_grad, _ = theirs(archer, logp)
    out, grad = ours("aspo", logp, old, A, mask, entropy=entropy)
    close(out, grad, want, want_grad)
    r = torch.exp(logp - old)
    assert ((r > 3) & (A2 < 0) & (mask > 0)).any() and ((r < 1 / 3) & (A2 > 0) & (mask > 0)).any()


def test_aspo_positive_branch_is_the_flipped_weight():
    # A > 0, one sequence of 10 tokens: the 2 highest-entropy tokens take the wide band (0.4), the rest 0.2
    # (Archer2.0's `high_entropy_mask` marks the low-entropy 80%). Gradient per token: -A/r inside
    # the band (d/dlogp of -A pc/sg(pc)/sg(pc) with pc = r), 0 past 1+e, -3A below 1/3 (the soft dual
    # clip, -3A logp), all / 10 (token-mean)
    r = torch.tensor([[1.1, 1.3, 1.3, 0.5, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0]])
    entropy = torch.tensor([[0.1, 0.9, 0.2, 0.3, 0.4, 0.5, 0.05, 0.6, 0.95, 0.0]])  # top 2: positions 8, 1
    logp = torch.log(r)
    out, grad = ours("aspo", logp, torch.zeros(1, 10), torch.tensor([2.0]), torch.ones(1, 10), entropy=entropy)
    want = torch.tensor([[-2 / 1.1, -2 / 1.3, 0.0, -2 / 0.5, -6.0, -2.0, -2.0, -2.0, -2.0, -2.0]]) / 10
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)
    # the value of the positive branch is -A / min(r, 1+e): e.g. token 1 (wide band) -2/1.3
    assert float(out.token_loss[0, 1]) == pytest.approx(-2 / 1.3, rel=1e-6)


def test_aspo_ratio_on_a_bound_keeps_its_whole_gradient():
    # Bands are closed (docs/objectives.md), as torch.clamp's gradient and Archer2.0's clamp: a float32
    # ratio exactly on 1-e (A<0) or 1+e (A>0) passes its gradient whole. torch.maximum/minimum with a
    # tensor bound split it 0.5/0.5 at the tie (the bug this pins). Five tokens, equal entropy, so all
    # are low-entropy (<= the row's 0.8-quantile, ties included): e = 0.2 everywhere.
    from clipbench.objectives.rules.soft import aspo

    e = torch.tensor(0.2)
    lo, hi = 1 - e, 1 + e  # the float32 bounds the rule computes
    entropy, mask = torch.full((1, 2), 0.5), torch.ones(1, 2)
    for A, r0, want in [
        (-2.0, lo, 2.0),  # d/dr of -A*max(r, 1-e) at r = 1-e: -A = 2
        (3.0, hi, -3.0 / hi**2),
    ]:  # d/dr of -A*pc/sg(pc)/sg(pc), pc = r = 1+e: -A/r^2
        r = torch.stack([r0, torch.tensor(1.0)]).reshape(1, 2).requires_grad_(True)
        logp = torch.log(r.detach())
        loss = aspo(r, torch.full((1, 2), A), logp, entropy, mask)
        (grad,) = torch.autograd.grad(loss[0, 0], r)
        assert float(r[0, 0]) == float(r0)  # exactly on the bound
        assert float(grad[0, 0]) == pytest.approx(float(want), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# BAPO


@pytest.mark.parametrize("seed, spread", [(0, 0.4), (12, 0.6), (13, 0.2)])
def test_bapo_is_the_released_search_and_loss(seed, spread):
    logp, old, A, mask, _ = make(seed, B=16, spread=spread)
    A[A > 0] *= 0.3  # weak positives: the search has to move the bounds
    A2 = A[:, None].expand_as(logp)
    want, want_grad, (_, lo, hi, _) = theirs(lambda lp: bapo.bapo_policy_loss(old, lp, A2, mask), logp)
    out, grad = ours("bapo", logp, old, A, mask)
    close(out, grad, want, want_grad)
    assert float(out.stats["stat/clip_low"]) == pytest.approx(lo) and float(
        out.stats["stat/clip_high"]
    ) == pytest.approx(hi)
    assert hi > 1.2  # the upper loop moved (and the lower one went to its maximum first: the released order)
    assert lo == pytest.approx(0.8)


def test_bapo_measures():
    """released: a clipped negative token counts at max(r, lo) |A| >= r |A|, so raising the lower
    bound can only raise the negative side; gradient: only the tokens whose gradient the clip keeps
    count, so raising it lowers the negative side (the paper's stated intent)."""
    logp, old, A, mask, _ = make(14, B=16, spread=0.5)
    r = torch.exp(logp - old)
    shares = {}
    for measure in ("released", "gradient"):
        shares[measure] = []
        for lo in (0.6, 0.7, 0.8, 0.9):
            stat = mini_batch_stat(
                "bapo",
                logp,
                old,
                A,
                mask,
                measure=measure,
                lower_start=lo,
                lower_max=lo,
                upper_start=1.2,
                upper_max=1.2,
            )
            shares[measure].append(float(stat["pos_share"]))
    assert all(a >= b for a, b in zip(shares["released"], shares["released"][1:]))
    assert all(a <= b for a, b in zip(shares["gradient"], shares["gradient"][1:]))
    assert shares["gradient"][-1] > shares["gradient"][0]
    # gradient's negative side by hand at lo = 0.9: sum of r |A| over A < 0 tokens with 0.9 <= r <= 3
    neg = ((A[:, None] < 0) & (r >= 0.9) & (r <= 3.0) & (mask > 0)) * r * -A[:, None]
    pos = ((A[:, None] > 0) & (r <= 1.2) & (mask > 0)) * r * A[:, None]
    assert shares["gradient"][-1] == pytest.approx(float(pos.sum() / (pos.sum() + neg.sum())), rel=1e-5)


def test_bapo_bounds_are_checked():
    with pytest.raises(ValueError, match="lower_start <= lower_max <= 1 <= upper_start"):
        policy_loss("bapo", *make(0)[:4], lower_start=0.9, lower_max=0.8)


# ---------------------------------------------------------------------------------------------
# Aggregations


def test_token_sum_is_verls():
    logp, old, A, mask, _ = make(15)
    A2 = A[:, None].expand_as(logp)

    def verl(lp):
        r = torch.exp(lp - old)
        return verl_agg.verl_agg_loss(-torch.min(r * A2, r.clamp(0.8, 1.2) * A2), mask, "token-sum")

    want, want_grad, _ = theirs(verl, logp)
    out, grad = ours("grpo", logp, old, A, mask, agg="token-sum")
    close(out, grad, want, want_grad)


@pytest.mark.parametrize("method", ["grpo", "dual_clip", "cispo"])
def test_prompt_mean_is_skyrls(method):
    """SkyRL divides each prompt group's advantages by P x the group's tokens, then sums: for losses
    linear in A at a fixed sign (every PPO-family loss) that is the mean over prompts of each
    prompt's pooled token mean, which clipbench computes directly."""
    logp, old, A, mask, _ = make(16, B=12)
    groups = torch.arange(12) // 3
    bounds = [(3 * p, 3 * p + 3) for p in range(4)]
    A2 = A[:, None].expand_as(logp)

    def per_token(lp, a):
        r = torch.exp(lp - old)
        if method == "cispo":
            return -r.clamp(0.0, 5.0).detach() * a * lp
        loss = -torch.min(r * a, r.clamp(0.8, 1.2) * a)
        return torch.where(a < 0, torch.min(loss, -3.0 * a), loss) if method == "dual_clip" else loss

    def skyrl(lp):
        scaled = skyrl_prompt_mean.skyrl_scale_advantages(A2, mask, "prompt_mean", prompt_boundaries=bounds)
        return skyrl_prompt_mean.skyrl_reduce_loss(per_token(lp, scaled), mask)

    want, want_grad, _ = theirs(skyrl, logp)
    out, grad = ours(method, logp, old, A, mask, agg="prompt-mean", groups=groups)
    close(out, grad, want, want_grad)
