"""Equivalences between rules on random tensors, NSR's randomness, padding and extreme ratios."""

from __future__ import annotations

import math

import pytest
import torch

from clipbench.objectives import AGGREGATIONS, CELLS, METHODS, policy_loss


def batch(B=16, T=24, spread=0.4, seed=0, pad=True):
    """Random off-policy batch: log-ratios ~ N(0, spread), advantages with zeros, ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4
    logp = old + torch.randn(B, T, generator=g) * spread
    A = torch.randn(B, generator=g)
    A[::5] = 0.0
    lens = torch.randint(1, T + 1, (B,), generator=g) if pad else torch.full((B,), T)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    return logp, old, A, mask


def row_inputs(logp, old, A):
    """The inputs some rules and aggregations read, for any batch: rewards (topr: 1 where A > 0),
    an entropy (aspo: any non-negative (B, T)), prompt groups of two rows (prompt-mean), the
    sampler's log-probs (rollout_is: old_logp, as with sampler.old_logp: sampler)."""
    B = logp.shape[0]
    return {
        "rewards": (A > 0).float(),
        "entropy": (logp.detach() * 7.3).sin().abs(),
        "groups": torch.arange(B) // 2,
        "sampler_logp": old,
    }


def loss_and_grad(method, logp, old, A, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    out = policy_loss(method, lp, old, A, mask, **{**row_inputs(logp, old, A), **kw})
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad


def trl_delta_loss(logp, old, A, mask, eps_low, eps_high, delta):
    """TRL GRPOTrainer._compute_loss with args.delta (two-sided clipping), token-mean ("dapo"):
    coef_1 = exp(logp - old); coef_2 = clamp(coef_1, 1 - eps_low, 1 + eps_high)
    coef_1 = clamp(coef_1, max=delta)
    per_token_loss = -min(coef_1 * A, coef_2 * A)
    loss = (per_token_loss * mask).sum() / mask.sum()
    """
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    coef_1 = torch.clamp(coef_1, max=delta)
    per_token = -torch.min(coef_1 * A[:, None], coef_2 * A[:, None])
    return (per_token * mask).sum() / mask.sum(), per_token


def test_dual_clip_equals_trl_delta():
    # Equal in value and gradient for every ratio not exactly on a bound (ties have measure zero
    # for continuous random ratios), provided delta = c > 1 + eps_high (TRL's requirement); for
    # A>0 the cap never binds (min(r, delta, clip(r)) = min(r, clip(r)) when delta > 1 + eps_high)
    # and for A<0 max(min(r, c), clip(r)) = min(max(r, clip(r)), c).
    logp, old, A, mask = batch(B=64, T=32, spread=0.8, seed=1)
    r = torch.exp(logp - old)
    assert ((r > 1.6) & (mask > 0) & (A[:, None] < 0)).sum() > 20  # the dual clip binds somewhere
    lp = logp.clone().requires_grad_(True)
    want, want_tok = trl_delta_loss(lp, old, A, mask, 0.2, 0.28, 1.6)
    (want_grad,) = torch.autograd.grad(want, lp)
    out, grad = loss_and_grad("dual_clip", logp, old, A, mask, eps_low=0.2, eps_high=0.28, c=1.6)
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.token_loss, (want_tok * mask).detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_gspo_token_has_gspo_gradient(agg):
    # eps 0.02 so that some sequences are clipped and some are not
    logp, old, A, mask = batch(B=32, T=16, spread=0.1, seed=2)
    kw = dict(eps_low=0.02, eps_high=0.02, agg=agg)
    a, ga = loss_and_grad("gspo", logp, old, A, mask, **kw)
    b, gb = loss_and_grad("gspo_token", logp, old, A, mask, **kw)
    clipped = a.stats["q1/zero_grad"] + a.stats["q3/zero_grad"]
    assert 0 < clipped < mask.sum()
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)


def test_abc_with_huge_eps3_is_grpo_in_q4():
    logp, old, A, mask = batch(B=64, T=16, spread=0.6, seed=3)
    r = torch.exp(logp - old)
    a, ga = loss_and_grad("abc", logp, old, A, mask, eps3=1e9)
    g, gg = loss_and_grad("grpo", logp, old, A, mask)
    q4 = (A[:, None] < 0) & (r > 1) & (mask > 0)
    q13 = ((A[:, None] > 0) & (r > 1) | (A[:, None] < 0) & (r < 1)) & (mask > 0)
    assert (q4 & (r > 1.2)).sum() > 10  # grpo's unbounded Q4 region is populated
    for cell in (q4, q13):  # Q4 now unbounded like grpo; Q1/Q3 are grpo's rule anyway
        torch.testing.assert_close(a.token_loss[cell], g.token_loss[cell])
        torch.testing.assert_close(ga[cell], gg[cell])
    assert a.stats["q4/zero_grad"] == 0 == g.stats["q4/zero_grad"]


def test_nsr_p0_is_its_base_rule():
    logp, old, A, mask = batch(seed=4)
    for base, twin, _eps in (("token", "grpo", {}), ("sequence", "gspo", {})):
        kw = dict(eps_low=0.2, eps_high=0.28) if base == "token" else dict(eps_low=0.01, eps_high=0.01)
        n, gn = loss_and_grad("nsr", logp, old, A, mask, p=0.0, base=base, **kw)
        b, gb = loss_and_grad(twin, logp, old, A, mask, **kw)
        assert torch.equal(n.token_loss, b.token_loss)
        assert torch.equal(gn, gb)


def test_nsr_p1_rescues_every_band_token():
    logp, old, A, mask = batch(B=64, T=24, spread=0.5, seed=5)
    n, gn = loss_and_grad("nsr", logp, old, A, mask, p=1.0, agg="seq-mean-token-sum")
    near = sum(n.stats[f"{c}/in_band_near"] for c in CELLS)
    rescued = sum(n.stats[f"{c}/rescued"] for c in CELLS)
    assert near > 20 and rescued == near
    # brute force: band tokens have the unclipped gradient -A*r/B, tokens past the band 0
    r = torch.exp(logp - old).double()
    Ab = A[:, None].double()
    d = torch.where(Ab > 0, r - 1.28, 0.8 - r)
    band = (Ab != 0) & (d > 0) & (d <= 0.1) & (mask > 0)
    beyond = (Ab != 0) & (d > 0.1) & (mask > 0)
    assert int(band.sum()) == int(near)
    n_seq = int((mask.sum(-1) > 0).sum())
    torch.testing.assert_close(gn[band].double(), (-Ab * r / n_seq).expand_as(r)[band], rtol=1e-5, atol=1e-9)
    assert torch.all(gn[beyond] == 0)


def _replicated(K):
    """A small batch replicated K times: the replicas differ only in their NSR draws."""
    logp, old, A, mask = batch(B=6, T=20, spread=0.5, seed=6)
    return logp.repeat(K, 1), old.repeat(K, 1), A.repeat(K), mask.repeat(K, 1), logp.shape[0]


@pytest.mark.parametrize("schedule,p", [("const", 0.5), ("const", 0.25), ("const", 0.3), ("linear", 0.5)])
def test_nsr_mean_gradient_matches_decay(schedule, p):
    # Per token, nsr's gradient is g * m with m ~ Bernoulli(p(d)) and g the unclipped gradient;
    # decay's is p(d) * g. Over K replicas the mean has std |g| sqrt(p(1-p)/K); we allow 5 std
    # (plus the 2^-24 resolution of torch.rand's float32 uniforms): a false alarm has probability
    # < 1e-5 per band token.
    K = 4000
    logp, old, A, mask, B = _replicated(K)
    kw = dict(p=p, schedule=schedule, agg="seq-mean-token-sum")
    n, gn = loss_and_grad("nsr", logp, old, A, mask, generator=torch.Generator().manual_seed(7), **kw)
    d, gd = loss_and_grad("decay", logp, old, A, mask, **kw)
    gn = gn.double().reshape(K, B, -1) * K  # undo the 1/K of the mean over K*B sequences
    gd_all = gd.double().reshape(K, B, -1) * K
    gd = gd_all[0]
    assert torch.equal(gd_all, gd.expand_as(gd_all))  # decay is deterministic: every replica is the same
    r = torch.exp(logp[:B] - old[:B]).double()
    g_full = -A[:B, None].double() * r / B  # the unclipped gradient of each token
    p_d = torch.where(gd != 0, gd / g_full, torch.zeros_like(gd))  # decay's p(d) (1 outside the band)
    band = (p_d > 0) & (p_d < 1 - 1e-6)
    assert band.sum() >= 5
    mean = gn.mean(0)
    std = g_full.abs() * torch.sqrt(p_d * (1 - p_d) / K)
    err = (mean - gd).abs()
    assert torch.all(err[band] <= 5 * std[band] + 1e-6 * g_full.abs()[band]), (err / std)[band].max()
    # outside the band both are deterministic and equal
    torch.testing.assert_close(mean[~band], gd[~band], rtol=1e-5, atol=1e-9)


def test_nsr_rescues_exactly_the_band_tokens_with_u_below_p_d():
    # The draws are readable: with the caller's uniforms u, a token is rescued iff it lies
    # 0 < d <= delta past its active bound and u < p(d). Brute force in float64 from the formula.
    logp, old, A, mask = batch(B=48, T=16, spread=0.5, seed=14)
    u = torch.rand(logp.shape, generator=torch.Generator().manual_seed(5))
    r = torch.exp((logp - old).double())
    Ab = A[:, None].double().expand_as(r)
    d = torch.where(Ab > 0, r - 1.28, torch.where(Ab < 0, 0.8 - r, torch.zeros_like(r)))
    band = (Ab != 0) & (d > 0) & (d <= 0.1) & (mask > 0)
    for schedule, p_d in (("const", torch.full_like(d, 0.3)), ("linear", 0.3 * (1 - d / 0.1))):
        out, grad = loss_and_grad(
            "nsr", logp, old, A, mask, uniforms=u, p=0.3, schedule=schedule, agg="seq-mean-token-sum"
        )
        want = band & (u.double() < p_d)
        assert 0 < int(want.sum()) < int(band.sum())
        got = band & (grad != 0)  # band tokens keep a gradient iff rescued
        assert torch.equal(got, want), schedule
        assert sum(out.stats[f"{c}/rescued"] for c in CELLS) == int(want.sum())
        assert sum(out.stats[f"{c}/in_band_near"] for c in CELLS) == int(band.sum())


def test_nsr_draws_from_the_generator_equal_pre_drawn_uniforms():
    # Without uniforms, nsr draws torch.rand((B, T)) from the generator: the same as pre-drawing them.
    logp, old, A, mask = batch(B=16, T=12, spread=0.5, seed=15)
    g = torch.Generator().manual_seed(3)
    a, ga = loss_and_grad("nsr", logp, old, A, mask, generator=g)
    ref = torch.Generator().manual_seed(3)
    u = torch.rand(logp.shape, generator=ref)
    b, gb = loss_and_grad("nsr", logp, old, A, mask, uniforms=u, generator=torch.Generator().manual_seed(99))
    assert torch.equal(ga, gb) and torch.equal(a.token_loss, b.token_loss)
    assert torch.equal(g.get_state(), ref.get_state())  # advanced by exactly B x T floats
    # a setting with no draws (p = 1, const) leaves the generator alone
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    policy_loss("nsr", logp, old, A, mask, generator=g, p=1.0)
    assert torch.equal(g.get_state(), state)


def test_nsr_sequence_base_uses_the_first_uniform_of_each_row():
    logp, old, A, mask = batch(B=64, T=12, spread=0.3, seed=9)
    kw = dict(base="sequence", eps_low=0.02, eps_high=0.02, delta=0.1, p=0.5)
    u = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2))
    u2 = u.clone()
    u2[:, 1:] = torch.rand(64, 11, generator=torch.Generator().manual_seed(8))  # other columns change nothing
    a, ga = loss_and_grad("nsr", logp, old, A, mask, uniforms=u, **kw)
    b, gb = loss_and_grad("nsr", logp, old, A, mask, uniforms=u2, **kw)
    assert torch.equal(ga, gb)
    assert sum(a.stats[f"{c}/rescued"] for c in CELLS) > 0


def test_nsr_same_seed_same_result():
    logp, old, A, mask = batch(B=32, T=24, spread=0.5, seed=8)
    outs = [loss_and_grad("nsr", logp, old, A, mask, generator=torch.Generator().manual_seed(s)) for s in (11, 11, 12)]
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][0].token_loss, outs[1][0].token_loss)
    assert not torch.equal(outs[0][1], outs[2][1])  # another seed rescues other tokens
    # the generator advances by the same amount whatever the ratios (replayable streams)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    policy_loss("nsr", logp, old, A, mask, generator=g1)
    policy_loss("nsr", logp * 0.5, old, A, mask, generator=g2)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_nsr_sequence_base_one_draw_per_sequence():
    logp, old, A, mask = batch(B=64, T=12, spread=0.3, seed=9)
    kw = dict(base="sequence", eps_low=0.02, eps_high=0.02, delta=0.1, p=0.5)
    out, grad = loss_and_grad("nsr", logp, old, A, mask, generator=torch.Generator().manual_seed(1), **kw)
    # within a sequence the gradient is either all zero or all nonzero (one decision per sequence)
    nz = (grad != 0) & (mask > 0)
    per_seq = nz.sum(-1)
    assert torch.all((per_seq == 0) | (per_seq == mask.sum(-1)))
    rescued = sum(out.stats[f"{c}/rescued"] for c in CELLS)
    assert rescued > 0 and rescued % 1 == 0


def test_nsr_needs_a_generator():
    logp, old, A, mask = batch()
    with pytest.raises(ValueError, match="torch.Generator"):
        policy_loss("nsr", logp, old, A, mask, p=0.5)
    with pytest.raises(ValueError, match="torch.Generator"):
        policy_loss("nsr", logp, old, A, mask, p=1.0, schedule="linear")
    policy_loss("nsr", logp, old, A, mask, p=1.0)  # deterministic: no generator needed
    policy_loss("nsr", logp, old, A, mask, p=0.0)


def _kw(method):
    """Stochastic rules (nsr, clip_cov) draw from a generator; the others ignore it."""
    return {"generator": torch.Generator().manual_seed(0)}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_padding_contributes_nothing(method):
    logp, old, A, mask = batch(B=8, T=10, seed=10)
    pad = mask == 0
    u = torch.rand(8, 15, generator=torch.Generator().manual_seed(1))  # the same draws at the valid positions
    # garbage at padding and 5 extra padding columns change nothing
    logp2 = torch.cat([logp.masked_fill(pad, 1e4), torch.full((8, 5), -1e4)], 1)
    old2 = torch.cat([old.masked_fill(pad, -3e4), torch.full((8, 5), 7.0)], 1)
    mask2 = torch.cat([mask, torch.zeros(8, 5)], 1)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        a, ga = loss_and_grad(method, logp, old, A, mask, agg=agg, uniforms=u[:, :10])
        b, gb = loss_and_grad(method, logp2, old2, A, mask2, agg=agg, uniforms=u)
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(gb[:, :10], ga, rtol=1e-6, atol=1e-9)
        assert torch.all(gb[mask2 == 0] == 0) and torch.all(b.token_loss[mask2 == 0] == 0)
        for k, v in a.stats.items():
            torch.testing.assert_close(b.stats[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_all_padding_row_and_batch_no_nan(method):
    logp, old, A, mask = batch(B=4, T=6, seed=11)
    mask[1] = 0
    for agg in AGGREGATIONS:
        out, grad = loss_and_grad(method, logp, old, A, mask, agg=agg, **_kw(method))
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in out.stats.values())
        assert torch.all(grad[1] == 0)
    out, grad = loss_and_grad(method, logp, old, A, torch.zeros_like(mask), **_kw(method))
    assert out.loss.item() == 0.0 and torch.all(grad == 0)
    assert all(torch.isfinite(v) for v in out.stats.values())


@pytest.mark.parametrize("method", sorted(METHODS))
def test_extreme_log_ratios_stay_finite(method):
    # log-ratios of +-50 (r = e^50 would overflow nothing in float32, but r * A and its square
    # in downstream code would; the ratio is clamped at e^20 with a straight-through gradient)
    logp = torch.tensor([[0.0, -60.0, -1.0], [-55.0, 0.0, -2.0]])
    old = torch.tensor([[-50.0, -10.0, -1.0], [-5.0, -50.0, -2.0]])
    A = torch.tensor([1.5, -2.0])
    out, grad = loss_and_grad(method, logp, old, A, torch.ones(2, 3), beta=0.1, ref_logp=old, **_kw(method))
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and torch.isfinite(out.token_loss).all()
    assert all(torch.isfinite(v) for v in out.stats.values())
    assert out.stats["ratio/max"].item() == pytest.approx(math.exp(20), rel=1e-5)


def test_grpo_q4_gradient_survives_the_clamp():
    # log r = 30 in Q4: the value uses r = e^20, the gradient is -A * e^20 (not zero)
    logp = torch.tensor([[0.0]], requires_grad=True)
    out = policy_loss("grpo", logp, torch.tensor([[-30.0]]), torch.tensor([-1.0]), torch.ones(1, 1))
    (g,) = torch.autograd.grad(out.loss, logp)
    assert g.item() == pytest.approx(math.exp(20), rel=1e-5)
    assert out.stats["q4/zero_grad"].item() == 0


def test_on_policy_every_method_has_the_same_gradient():
    # r == 1 exactly: every rule's gradient is -A (per token, token-mean), except two by design:
    # clip_cov detaches a random few high-covariance tokens even on-policy, and luspo weighs each
    # sequence's loss by its length.
    logp, _, A, mask = batch(seed=12)
    grads = {m: loss_and_grad(m, logp, logp, A, mask, **_kw(m))[1] for m in METHODS if m not in ("clip_cov", "luspo")}
    for m, g in grads.items():
        torch.testing.assert_close(g, grads["grpo"], rtol=1e-6, atol=1e-9, msg=m)
    out = policy_loss("grpo", logp, logp, A, mask)
    n_nonzero_adv = float(((A != 0)[:, None] & (mask > 0)).sum())
    assert out.stats["on_policy/tokens"].item() == n_nonzero_adv


@pytest.mark.parametrize("base", ["token", "sequence"])
@pytest.mark.parametrize("sides", ["both", "upper", "lower"])
def test_nsr_p1_equals_decay_p1(base, sides):
    # with p = 1 both rescue every band token with its full unclipped gradient
    logp, old, A, mask = batch(B=32, T=12, spread=0.3, seed=13)
    kw = dict(p=1.0, base=base, sides=sides, delta=0.1)
    if base == "sequence":
        kw.update(eps_low=0.02, eps_high=0.02)
    n, gn = loss_and_grad("nsr", logp, old, A, mask, **kw)
    d, gd = loss_and_grad("decay", logp, old, A, mask, **kw)
    torch.testing.assert_close(n.token_loss, d.token_loss)
    torch.testing.assert_close(gn, gd)
    for c in CELLS:
        assert n.stats[f"{c}/in_band_near"] == d.stats[f"{c}/in_band_near"]
        assert n.stats[f"{c}/zero_grad"] == d.stats[f"{c}/zero_grad"]
    assert sum(n.stats[f"{c}/in_band_near"] for c in CELLS) > 0
