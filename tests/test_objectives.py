"""Golden values and gradients of every clip rule, one case per cell, arithmetic in comments.

Each case is one token: ratio r = exp(logp - old_logp) with old_logp = logp - log r, advantage A.
We check the per-token loss l (out.token_loss) and dl/dlogp (gradient of token_loss.sum()), and
that the gradient is exactly zero precisely where the contract says (and zero_grad counts it).
For token-level rules dl/dlogp = dl/dr * r.
"""

from __future__ import annotations

import math

import pytest
import torch

from clipbench.objectives import CELLS, policy_loss

LOGP = -1.0  # log-prob of every token (cispo's loss depends on it)


def run_cases(method, cases, *, generator=None, tol=2e-6, **params):
    """cases: [(r, A, expected_l, expected_grad)]; one row per case, T = 1."""
    r = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    A = torch.tensor([float(c[1]) for c in cases])
    logp = torch.full((len(cases), 1), LOGP, requires_grad=True)
    old = (LOGP - torch.log(r)).float().reshape(-1, 1)
    if method == "rollout_is":  # its ratio is against the sampler's log-probs: here the same as old
        params = {**params, "sampler_logp": old}
    out = policy_loss(method, logp, old, A, torch.ones(len(cases), 1), generator=generator, **params)
    (grad,) = torch.autograd.grad(out.token_loss.sum(), logp)
    want_l = torch.tensor([c[2] for c in cases])
    want_g = torch.tensor([c[3] for c in cases])
    torch.testing.assert_close(out.token_loss[:, 0], want_l, rtol=tol, atol=tol)
    torch.testing.assert_close(grad[:, 0], want_g, rtol=tol, atol=tol)
    # exactly zero where expected, and nowhere else (A == 0 rows: loss 0, gradient 0)
    assert torch.equal(grad[:, 0] == 0, want_g == 0)
    zero_grad = sum(out.stats[f"{c}/zero_grad"].item() for c in CELLS)
    assert zero_grad == int((want_g == 0).sum())
    return out


# r, A, l, dl/dlogp
GRPO_CASES = [
    (1.1, 2, -2.2, -2.2),  # Q1 in band: -min(1.1*2, 1.1*2) = -2.2; grad -A*r = -2.2
    (1.5, 2, -2.4, 0.0),  # Q1 past 1.2: -min(3.0, 1.2*2) = -2.4, clipped -> 0
    (0.9, 2, -1.8, -1.8),  # Q2 in band: -1.8
    (0.5, 2, -1.0, -1.0),  # Q2 below 0.8: -min(1.0, 1.6) = -1.0, unclipped -> -A*r = -1.0
    (0.9, -2, 1.8, 1.8),  # Q3 in band: -min(-1.8, -1.8) = 1.8; grad -A*r = 1.8
    (0.5, -2, 1.6, 0.0),  # Q3 below 0.8: -min(-1.0, -1.6) = 1.6, clipped -> 0
    (1.1, -2, 2.2, 2.2),  # Q4 in band: 2.2
    (1.5, -2, 3.0, 3.0),  # Q4 past 1.2: -min(-3.0, -2.4) = 3.0, unbounded -> -A*r = 3.0
    (1.5, 0, 0.0, 0.0),  # A == 0: l = 0, gradient 0
]


def test_grpo_golden():
    out = run_cases("grpo", GRPO_CASES)
    # cells: q1, q2, q3, q4 two tokens each, one zero_adv; zeroed: one in q1, one in q3
    assert [out.stats[f"{c}/tokens"].item() for c in CELLS] == [2, 2, 2, 2, 1, 0]
    assert [out.stats[f"{c}/zero_grad"].item() for c in CELLS] == [1, 0, 1, 0, 1, 0]


def test_unclipped_golden():
    # -r*A in every cell, gradient dl/dlogp = -A*r: never zero where A != 0 (no band)
    out = run_cases(
        "unclipped",
        [
            (1.5, 2, -3.0, -3.0),  # Q1 past 1.2 (grpo: clipped, 0): -1.5*2 = -3.0
            (0.5, 2, -1.0, -1.0),  # Q2: -0.5*2
            (0.5, -2, 1.0, 1.0),  # Q3 below 0.8 (grpo: clipped, 0): 0.5*2 = 1.0
            (3.0, -2, 6.0, 6.0),  # Q4 far out: 3*2 = 6.0, as grpo's
            (1.1, 2, -2.2, -2.2),  # Q1 in band: grpo's value
            (1.5, 0, 0.0, 0.0),  # A == 0
        ],
    )
    # the default band (0.2 / 0.2) counts the out-of-band tokens; none is zeroed
    assert [out.stats[f"{c}/out_of_band"].item() for c in CELLS] == [1, 1, 1, 1, 1, 0]


def test_dapo_golden():
    run_cases(
        "dapo",
        [
            (1.25, 2, -2.5, -2.5),  # Q1 inside the higher band (1.28): -1.25*2
            (1.5, 2, -2.56, 0.0),  # Q1 past 1.28: -1.28*2 = -2.56, clipped
            (0.5, -2, 1.6, 0.0),  # Q3 below 0.8: 0.8*2 = 1.6, clipped
            (1.5, -2, 3.0, 3.0),  # Q4: unbounded as grpo
            (0.5, 2, -1.0, -1.0),  # Q2: unclipped
        ],
    )


def test_dual_clip_golden():
    run_cases(
        "dual_clip",
        [
            (1.5, 2, -2.4, 0.0),  # A>0: grpo rule, clipped at 1.2
            (0.5, 2, -1.0, -1.0),  # A>0, Q2: unclipped
            (0.9, -2, 1.8, 1.8),  # Q3 in band: min(max(1.8, 1.8), 6) = 1.8
            (0.5, -2, 1.6, 0.0),  # Q3 below 0.8: min(max(1.0, 1.6), 6) = 1.6, clipped
            (1.5, -2, 3.0, 3.0),  # Q4 between 1.2 and c=3: min(max(3.0, 2.4), 6) = 3.0, -A*r
            (4.0, -2, 6.0, 0.0),  # Q4 past c: min(max(8.0, 2.4), 3*2) = 6.0 = -c*A, zero gradient
            (2.0, 0, 0.0, 0.0),
        ],
        c=3.0,
    )


def test_abc_golden():
    # (lo, hi) = (0.8, 1.2) for both signs (eps1..eps4 = 0.2); no min: l = -clip(r)*A everywhere
    out = run_cases(
        "abc",
        [
            (1.1, 2, -2.2, -2.2),  # Q1 in band
            (1.5, 2, -2.4, 0.0),  # Q1 past 1.2: -1.2*2
            (0.9, 2, -1.8, -1.8),  # Q2 in band
            (0.5, 2, -1.6, 0.0),  # Q2 below 0.8: -0.8*2 = -1.6, clipped (grpo would not clip)
            (0.9, -2, 1.8, 1.8),  # Q3 in band
            (0.5, -2, 1.6, 0.0),  # Q3 below 0.8: 0.8*2
            (1.1, -2, 2.2, 2.2),  # Q4 in band
            (1.5, -2, 2.4, 0.0),  # Q4 past 1.2: bounded 1.2*2 = 2.4, clipped (grpo: 3.0, unbounded)
            (1.5, 0, 0.0, 0.0),
        ],
    )
    assert [out.stats[f"{c}/zero_grad"].item() for c in CELLS] == [1, 1, 1, 1, 1, 0]


def test_abc_asymmetric_bands():
    run_cases(
        "abc",
        [
            (1.35, 2, -2.7, -2.7),  # A>0 band [1-eps2, 1+eps1] = [0.9, 1.4]: in
            (0.85, 2, -1.8, 0.0),  # below 0.9: -0.9*2
            (1.35, -2, 2.2, 0.0),  # A<0 band [1-eps4, 1+eps3] = [0.7, 1.1]: past 1.1 -> 1.1*2
            (0.75, -2, 1.5, 1.5),  # in band: 0.75*2
        ],
        eps1=0.4,
        eps2=0.1,
        eps3=0.1,
        eps4=0.3,
    )


def _seq_case(method, **params):
    """Two tokens per sequence; s = exp(mean(logp - old_logp)). Returns (token_loss, grad)."""
    lr = torch.tensor([[0.3, 0.1], [1e-4, -1e-4], [-0.3, -0.1], [0.2, 0.2], [0.5, 0.5]])
    A = torch.tensor([2.0, 2.0, -2.0, -2.0, 0.0])
    logp = torch.full((5, 2), LOGP, requires_grad=True)
    out = policy_loss(method, logp, LOGP - lr, A, torch.ones(5, 2), **params)
    (grad,) = torch.autograd.grad(out.token_loss.sum(), logp)
    return out, grad


@pytest.mark.parametrize("method", ["gspo", "gspo_token"])
def test_gspo_golden(method):
    out, grad = _seq_case(method)
    e02 = math.exp(0.2)
    # row 0: s = e^0.2 = 1.2214 > 1.0004, A>0 -> clipped: l = -1.0004*2 per token, grad 0
    # row 1: s = e^0 = 1, in band: l = -2 per token; the sum over the row's 2 tokens of l_b has
    #        d/dlogp_t = 2 * (-A * s / 2) = -A * s = -2
    # row 2: s = e^-0.2 = 0.8187 < 0.9997, A<0 -> clipped: l = 0.9997*2 = 1.9994, grad 0
    # row 3: s = e^0.2, A<0 (Q4): unclipped: l = 2 * 1.2214 = 2.4428, grad -A*s = 2.4428
    # row 4: A == 0
    want_l = torch.tensor([[-2.0008] * 2, [-2.0] * 2, [1.9994] * 2, [2 * e02] * 2, [0.0] * 2])
    want_g = torch.tensor([[0.0] * 2, [-2.0] * 2, [0.0] * 2, [2 * e02] * 2, [0.0] * 2])
    torch.testing.assert_close(out.token_loss, want_l, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_g, rtol=1e-6, atol=1e-6)
    assert torch.equal(grad == 0, want_g == 0)
    # cells follow the sequence ratio: row 0 is q1 (zeroed), row 2 q3 (zeroed), row 3 q4
    assert out.stats["q1/zero_grad"].item() == 2 and out.stats["q3/zero_grad"].item() == 2
    assert out.stats["q4/tokens"].item() == 2


def test_nsr_golden_deterministic_p():
    # band past 1.28 is (1.28, 1.38], below 0.8 is [0.7, 0.8)
    cases_p1 = [
        (1.33, 2, -2.66, -2.66),  # Q1, d = 0.05 <= 0.1: rescued (p=1): l = -r*A = -2.66
        (1.5, 2, -2.56, 0.0),  # Q1, d = 0.22 > 0.1: stays clipped: -1.28*2
        (0.75, -2, 1.5, 1.5),  # Q3, d = 0.05: rescued: -0.75*(-2) = 1.5
        (0.5, -2, 1.6, 0.0),  # Q3, d = 0.3: clipped: 0.8*2
        (1.1, 2, -2.2, -2.2),  # in band: as grpo
        (1.5, -2, 3.0, 3.0),  # Q4: as grpo (never clipped)
    ]
    out = run_cases("nsr", cases_p1, p=1.0)
    assert out.stats["q1/rescued"].item() == 1 and out.stats["q3/rescued"].item() == 1
    assert out.stats["q1/in_band_near"].item() == 1 and out.stats["q3/in_band_near"].item() == 1
    cases_p0 = [(1.33, 2, -2.56, 0.0), (0.75, -2, 1.6, 0.0), (1.1, 2, -2.2, -2.2)]  # p = 0: base clip
    out = run_cases("nsr", cases_p0, p=0.0)
    assert out.stats["q1/rescued"].item() == 0 and out.stats["q1/in_band_near"].item() == 1


def test_nsr_sides():
    # sides=upper: only A>0 tokens past 1+eps_high are rescued
    run_cases("nsr", [(1.33, 2, -2.66, -2.66), (0.75, -2, 1.6, 0.0)], p=1.0, sides="upper")
    run_cases("nsr", [(1.33, 2, -2.56, 0.0), (0.75, -2, 1.5, 1.5)], p=1.0, sides="lower")


def test_decay_golden():
    run_cases(
        "decay",
        [
            (1.33, 2, -1.33, -1.33),  # Q1 in the band, p(d) = 0.5: l = -0.5*1.33*2, grad -0.5*A*r
            (1.5, 2, -2.56, 0.0),  # beyond the band: clipped
            (0.75, -2, 0.75, 0.75),  # Q3 in the band: -0.5*0.75*(-2)
            (0.5, -2, 1.6, 0.0),  # beyond: clipped
            (1.1, 2, -2.2, -2.2),  # in the trust band: grpo
        ],
        p=0.5,
    )
    # linear: p(d) = p * (1 - d/delta); r = 1.33: d = 0.05, p(d) = 0.5 * 0.5 = 0.25 -> l = -0.25*1.33*2
    run_cases(
        "decay",
        [(1.33, 2, -0.665, -0.665), (0.72, -2, 0.5 * 0.2 * 0.72 * 2, 0.5 * 0.2 * 0.72 * 2)],
        p=0.5,
        schedule="linear",
        tol=1e-5,
    )  # r = 0.72: d = 0.08, p(d) = 0.5*0.2 = 0.1 -> 0.1*0.72*2


def test_cispo_golden():
    # l = -sg(clip(r, 0, 5)) * A * logp, logp = -1; grad = -clip(r) * A
    run_cases(
        "cispo",
        [
            (1.5, 2, -1.5 * 2 * -1.0, -1.5 * 2),  # 3.0, grad -3.0
            (7.0, 2, -5.0 * 2 * -1.0, -5.0 * 2),  # weight capped at 5: 10.0, grad -10.0
            (0.5, -2, -0.5 * -2 * -1.0, -0.5 * -2),  # -1.0, grad 1.0
            (0.01, 2, -0.01 * 2 * -1.0, -0.01 * 2),  # no lower cap (1 - eps_low = 0): never zero
        ],
    )


def test_sapo_golden():
    def sig(z):
        return 1.0 / (1.0 + math.exp(-z))

    def case(r, A, tau):
        s = sig(tau * (r - 1.0))
        # l = -(4/tau) * s * A; dl/dlogp = -(4/tau) * s(1-s) * tau * r * A = -4 s (1-s) r A
        return (r, A, -(4.0 / tau) * s * A, -4.0 * s * (1.0 - s) * r * A)

    run_cases(
        "sapo",
        [
            case(1.0, 2, 1.0),  # r = 1: l = -4*0.5*2 = -4, grad = -4*0.25*1*2 = -2 = -A (slope 1)
            case(1.5, 2, 1.0),  # s = sigmoid(0.5) = 0.62246: l = -4.97967, grad -2.82000
            case(1.5, -2, 1.05),  # tau_neg: s = sigmoid(0.525)
            case(0.3, -2, 1.05),
            (1.5, 0, 0.0, 0.0),
        ],
    )


def test_gppo_golden():
    run_cases(
        "gppo",
        [
            (1.5, 2, -2.56, -2.56),  # Q1 past 1.28: l = -beta*b*r/sg(r)*A = -1*1.28*1*2; grad -beta*b*A
            (0.5, -2, 1.6, 1.6),  # Q3 below 0.8: -1*0.8*(-2) = 1.6, grad 1.6
            (1.1, 2, -2.2, -2.2),  # in band: grpo
            (1.5, -2, 3.0, 3.0),  # Q4: grpo, unbounded
        ],
    )
    run_cases("gppo", [(1.5, 2, -1.28, -1.28), (0.5, -2, 0.0, 0.0)], beta_high=0.5, beta_low=0.0)


# --- the rules of issue 38 (transcription checks: tests/test_objectives_field.py) ---------------
def test_opsm_golden():
    # T = 1: the sequence's mean log(old/pi) is -log r; masked when A < 0 and -log r > delta
    run_cases(
        "opsm",
        [
            (1.1, 2, -2.2, -2.2),  # A>0: never masked, grpo
            (1.5, 2, -2.4, 0.0),  # Q1 past 1.2: grpo's clip
            (0.9, -2, 0.0, 0.0),  # Q3: -log 0.9 = 0.105 > 1e-4 -> masked (grpo: 1.8, 1.8)
            (0.5, -2, 0.0, 0.0),  # Q3 past the bound: masked (grpo: 1.6, clipped)
            (1.1, -2, 2.2, 2.2),  # Q4: -log 1.1 < 0 -> kept, grpo's unbounded -r*A
            (1.5, 0, 0.0, 0.0),
        ],
    )
    # delta = 0.2: -log 0.9 = 0.105 is kept, -log 0.5 = 0.693 masked
    run_cases("opsm", [(0.9, -2, 1.8, 1.8), (0.5, -2, 0.0, 0.0)], delta=0.2)


def test_rollout_is_golden():
    # rho = r here (sampler_logp = old); l = -sg(rho*1[0.8 < rho < 1.2])*A*logp = w*A (logp = -1), grad -w*A
    run_cases(
        "rollout_is",
        [
            (1.1, 2, 2.2, -2.2),  # Q1 in the band: w = 1.1
            (1.3, 2, 0.0, 0.0),  # Q1 past 1.2: w = 0
            (0.9, 2, 1.8, -1.8),  # Q2 in band
            (0.5, 2, 0.0, 0.0),  # Q2 below 0.8: w = 0 (grpo keeps it)
            (0.85, -2, -1.7, 1.7),  # Q3 in band: w = 0.85
            (0.7, -2, 0.0, 0.0),  # Q3 below 0.8
            (1.5, -2, 0.0, 0.0),  # Q4 past 1.2: w = 0 (grpo: unbounded)
            (1.1, 0, 0.0, 0.0),
        ],
    )


def test_ipo_golden():
    # p = e^-1 = 0.36788, q = p/r; kept where |p - q| <= 0.1: l = -A*r + 1e-3*(log r)^2,
    # grad -A*r + 2e-3*log r; masked: only the penalty (also for A == 0)
    ln = math.log
    run_cases(
        "ipo",
        [
            (1.1, 2, -2.2 + 1e-3 * ln(1.1) ** 2, -2.2 + 2e-3 * ln(1.1)),  # |p - q| = 0.0334: kept
            (2.0, 2, 1e-3 * ln(2.0) ** 2, 2e-3 * ln(2.0)),  # |p - q| = 0.1839 > 0.1: masked
            (0.9, -2, 1.8 + 1e-3 * ln(0.9) ** 2, 1.8 + 2e-3 * ln(0.9)),  # |p - q| = 0.0409: kept
            (0.5, -2, 1e-3 * ln(0.5) ** 2, 2e-3 * ln(0.5)),  # |p - q| = 0.3679: masked
            (1.5, 0, 1e-3 * ln(1.5) ** 2, 2e-3 * ln(1.5)),  # A == 0: the penalty keeps a gradient
        ],
    )


def test_cfpo_golden():
    # l = -(r*A - |A|*(r-1)^2/0.4); dl/dr = -A + |A|*(r-1)/0.2; grad = dl/dr * r
    run_cases(
        "cfpo",
        [
            (1.1, 2, -(2.2 - 2 * 0.01 / 0.4), (-2 + 2 * 0.1 / 0.2) * 1.1),  # -2.15, -1.1
            (1.5, 2, -(3.0 - 2 * 0.25 / 0.4), (-2 + 2 * 0.5 / 0.2) * 1.5),  # past the stationary 1.2: -1.75, +4.5
            (0.5, -2, -(-1.0 - 2 * 0.25 / 0.4), (2 - 2 * 0.5 / 0.2) * 0.5),  # Q3 below 0.8: 2.25, -1.5 (pushed back)
            (1.5, -2, -(-3.0 - 2 * 0.25 / 0.4), (2 + 2 * 0.5 / 0.2) * 1.5),  # Q4: 4.25, 10.5
            (0.9, 2, -(1.8 - 2 * 0.01 / 0.4), (-2 - 2 * 0.1 / 0.2) * 0.9),  # Q2: -1.75, -2.7
            (1.5, 0, 0.0, 0.0),
        ],
        tol=1e-5,
    )


def test_kimi15_golden():
    # l = -A*logp + 0.05*(log r)^2 = A + 0.05*(log r)^2 (logp = -1); grad -A + 0.1*log r
    ln = math.log
    run_cases(
        "kimi15",
        [
            (1.5, 2, 2 + 0.05 * ln(1.5) ** 2, -2 + 0.1 * ln(1.5)),
            (0.5, -2, -2 + 0.05 * ln(0.5) ** 2, 2 + 0.1 * ln(0.5)),
            (1.0, 2, 2.0, -2.0),  # on-policy: the plain policy gradient
            (1.5, 0, 0.05 * ln(1.5) ** 2, 0.1 * ln(1.5)),  # A == 0: the penalty's gradient only
        ],
    )


def test_cispo_unified_mask_golden():
    # eps 0.2/0.2: l = -sg(clip(r, 0.8, 1.2))*A*logp = clip(r)*A, grad -clip(r)*A; M = 0 in PPO's zeroed cells
    cases = [
        (1.1, 2, 2.2, -2.2),  # Q1 in band
        (1.5, 2, 0.0, 0.0),  # Q1 past 1.2: masked (cispo: weight 1.2, grad -2.4)
        (0.5, 2, 1.6, -1.6),  # Q2 below 0.8: weight 0.8, kept
        (0.5, -2, 0.0, 0.0),  # Q3 below 0.8: masked
        (1.5, -2, -2.4, 2.4),  # Q4 past 1.2: weight 1.2, kept
        (1.5, 0, 0.0, 0.0),
    ]
    out = run_cases("cispo", cases, eps_low=0.2, eps_high=0.2, unified_mask=True)
    assert [out.stats[f"{c}/zero_grad"].item() for c in CELLS] == [1, 0, 1, 0, 1, 0]
    # off (the default): the same weights, nothing masked
    run_cases("cispo", [(1.5, 2, 2.4, -2.4), (0.5, -2, -1.6, 1.6)], eps_low=0.2, eps_high=0.2)
