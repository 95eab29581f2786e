"""The rules of issue 38 (opsm, rollout_is, ipo, cfpo, kimi15, cispo's unified mask) and the vaco
correction, each checked in value and gradient against an independent transcription of the upstream
code it was read from (tests/oracles/field_2026.py: slime, TRL, SkyRL, prime-rl, verl PR #5252,
ROLL, open-instruct), on random off-policy batches. The per-cell golden values are in
tests/test_objectives.py; micro-batch exactness in tests/test_objectives_split.py and
tests/test_microbatch.py."""

from __future__ import annotations

import pytest
import torch
from oracles import field_2026 as up

from clipbench.objectives import policy_loss
from clipbench.objectives.corrections import MASKED, apply_correction


def make(seed=0, B=16, T=10, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2.5
    logp = (old + torch.randn(B, T, generator=g) * spread).clamp(max=-1e-3)
    A = torch.randn(B, generator=g)
    A[::5] = 0.0
    lens = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    return logp, old, A, mask, g


def ours(method, logp, old, A, mask, agg="token-mean", **kw):
    lp = logp.clone().requires_grad_(True)
    out = policy_loss(method, lp, old, A, mask, agg=agg, **kw)
    (g,) = torch.autograd.grad(out.loss, lp)
    return out, g


def theirs(per_token, logp, mask, agg="token-mean"):
    """The source's per-token loss (a function of the current log-probs), token-mean or token-sum."""
    lp = logp.clone().requires_grad_(True)
    loss = (per_token(lp) * mask).sum() / (mask.sum() if agg == "token-mean" else 1.0)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


def close(a, b, rtol=1e-5, atol=1e-7):
    torch.testing.assert_close(a[0].loss, b[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(a[1], b[1], rtol=rtol, atol=atol)


@pytest.mark.parametrize("delta", [1e-4, 0.05])
def test_opsm_is_slimes_masked_ppo_loss(delta):
    logp, old, A, mask, _ = make(1)
    rows = [mask[b] > 0 for b in range(len(A))]

    def slime(lp):
        per = up.slime_opsm_pg_loss(
            [lp[b][r] for b, r in enumerate(rows)],
            [old[b][r] for b, r in enumerate(rows)],
            [A[b].expand(int(r.sum())) for b, r in enumerate(rows)],
            [mask[b][r] for b, r in enumerate(rows)],
            delta,
            0.2,
            0.2,
        )
        out = torch.zeros_like(lp)
        out[mask > 0] = per  # slime's concatenated response tokens, back on the (B, T) grid
        return out

    out = ours("opsm", logp, old, A, mask, delta=delta)
    close(out, theirs(slime, logp, mask))
    # TRL's mask (sampling log-probs = old_logp here) keeps and drops the same sequences
    keep = up.trl_off_policy_mask(A[:, None], logp, old, mask, delta)[:, 0] > 0
    assert (~keep).any() and (keep & (A < 0)).any()  # some A<0 sequences masked, some kept
    grpo = ours("grpo", logp, old, A, mask)[1]
    assert torch.all(out[1][~keep] == 0) and torch.equal(out[1][keep], grpo[keep])


def test_rollout_is_is_skyrls():
    logp, old, A, mask, g = make(2, spread=0.2)
    sampler = old + torch.randn(old.shape, generator=g) * 0.15  # the rollout policy: not old_logp

    def skyrl(lp):
        return up.skyrl_rollout_is(lp, sampler, A[:, None], 0.2, 0.2)

    out = ours("rollout_is", logp, old, A, mask, sampler_logp=sampler)
    close(out, theirs(skyrl, logp, mask))
    rho = torch.exp(logp - sampler)
    outside = ((rho <= 0.8) | (rho >= 1.2)) & (mask > 0)
    assert outside.any() and torch.all(out[1][outside] == 0)
    # against old_logp, it would be another loss: the ratio is the rollout policy's
    assert not torch.allclose(out[1], ours("rollout_is", logp, old, A, mask, sampler_logp=old)[1])


def test_rollout_is_needs_the_sampler_logprobs():
    logp, old, A, mask, _ = make(3)
    with pytest.raises(ValueError, match=r"rollout_is reads the input 'rollout_logp': pass sampler_logp="):
        policy_loss("rollout_is", logp, old, A, mask)


def test_ipo_is_prime_rls():
    logp, old, A, mask, _ = make(4, spread=0.6)
    logp = logp.clamp(max=-0.05)  # probabilities up to 0.95: the 0.1 threshold binds on both sides

    def prime(lp):  # prime-rl sums each sample's tokens: token-sum here
        per = torch.zeros_like(lp)
        for b in range(len(A)):
            m = mask[b] > 0
            per[b, 0] = up.prime_ipo(lp[b], old[b], A[b].expand_as(lp[b]), m, 0.1, 1.0, 1e-3)
        return per

    out = ours("ipo", logp, old, A, mask, agg="token-sum")
    want = theirs(prime, logp, torch.ones_like(mask), agg="token-sum")
    close(out, want, rtol=1e-5, atol=1e-6)
    p, q = logp.exp(), old.exp()
    assert (((p - q).abs() > 0.1) & (mask > 0)).any() and (((p - q).abs() <= 0.1) & (mask > 0)).any()


def test_cfpo_is_verls_pr():
    logp, old, A, mask, _ = make(5, spread=0.5)
    close(ours("cfpo", logp, old, A, mask), theirs(lambda lp: up.verl_cfpo(old, lp, A[:, None], 0.2), logp, mask))
    close(
        ours("cfpo", logp, old, A, mask, eps=0.3),
        theirs(lambda lp: up.verl_cfpo(old, lp, A[:, None], 0.3), logp, mask),
    )


def test_kimi15_is_rolls_and_dros():
    logp, old, A, mask, _ = make(6, spread=0.5)
    out = ours("kimi15", logp, old, A, mask)
    close(out, theirs(lambda lp: up.roll_kimi15(lp, old, A[:, None], 0.1), logp, mask))
    dro = ours("dro", logp, old, A, mask, dro_beta=0.1)  # the same loss
    torch.testing.assert_close(out[1], dro[1])


@pytest.mark.parametrize("unified", [False, True])
def test_cispo_unified_mask_is_rolls(unified):
    logp, old, A, mask, _ = make(7, spread=0.5)

    def roll(lp):
        return up.roll_cispo(torch.exp(lp - old), lp, A[:, None], 0.2, 0.28, unified)

    out = ours("cispo", logp, old, A, mask, eps_low=0.2, eps_high=0.28, unified_mask=unified)
    close(out, theirs(roll, logp, mask))
    r = torch.exp(logp - old)
    masked = (((A[:, None] > 0) & (r > 1.28)) | ((A[:, None] < 0) & (r < 0.8))) & (mask > 0)
    assert masked.any() and (torch.all(out[1][masked] == 0) if unified else torch.all(out[1][masked] != 0))


@pytest.mark.parametrize("low, high, cap", [(0.0, 2.0, 2.0), (0.0, 0.3, 2.0), (0.05, 0.3, 5.0)])
def test_vaco_is_open_instructs_tv_mask(low, high, cap):
    g = torch.Generator().manual_seed(8)
    B, T = 16, 9
    trainer = -torch.rand(B, T, generator=g) * 3
    sampler = trainer + torch.randn(B, T, generator=g) * torch.linspace(0.02, 3.0, B)[:, None]  # rows of every TV
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lens[:, None]
    A = torch.randn(B, generator=g)
    A[3] = 0.0
    got = apply_correction(
        {"name": "vaco", "low": low, "high": high, "cap": cap}, sampler, trainer, mask.float(), advantages=A
    )
    want = up.open_instruct_tv_weights(trainer, sampler, mask, A[:, None].expand(B, T), low, high, 0.0, cap)
    torch.testing.assert_close(got.weights, want * mask, rtol=1e-6, atol=0)
    masked = got.status == MASKED
    assert masked.any() and (mask & ~masked & (got.weights > 0)).any()
    # the TV of each row is the logged raw statistic, the masked tokens are those whose update raises it
    d = trainer - sampler
    assert torch.all((torch.sign(d) * A[:, None])[masked] > 0)


def test_vaco_needs_the_advantages():
    with pytest.raises(ValueError, match=r"correction 'vaco' reads the advantages: pass advantages="):
        apply_correction({"name": "vaco"}, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
