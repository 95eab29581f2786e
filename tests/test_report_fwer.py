"""Proof that the report's claims keep their error rates (issue 37): synthetic stores with a known
truth, no training. Each store is a claim family the report tests (clipbench.report.claims.evaluate_claims):
grpo, abc, dapo, nsr and its decay twin at one rate, 10 seeds, each run's held-out Avg@n and entropy
drawn with a chosen effect and a chosen seed-to-seed spread.

- A/A (every effect 0): over many stores, the share with at least one claim called "holds" or "does
  not hold" wrongly (the family-wise false-positive rate) is at most 5%, with the report's Holm
  correction; without it (each claim at its own p < 0.05) it is several times that. (When GRPO's mean
  gain falls below 0 by chance, the report tests the stability claims too: the family is then 7 or 8.)
- A true effect of a stated size (GRPO's gain over the base model, +4 points at a per-seed sd of the
  difference of sqrt(3^2 + 1^2) = 3.16: Cohen's d 1.26 over 10 seeds) is found at the power the design
  states: at least the Bonferroni power (the claim tested at 0.05 / 6, the family size, which is Holm's
  first step: 0.72) and at most the unadjusted power (0.94), both from statsmodels' TTestPower.

Monte Carlo tolerance: R stores give a rate with standard error sqrt(q (1 - q) / R); the bounds allow
3 standard errors (R = 400 and q = 0.05: 0.033, so the A/A rate must be <= 0.083; each claim at its own
0.05, 0.22 here, fails it by far; R = 200 for the power: 0.11 at q = 0.5). The draws are seeded:
the test is deterministic.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from statsmodels.stats.power import TTestPower

from clipbench.report.claims import evaluate_claims
from clipbench.report.load import RunRecord

SEEDS = 10
PROBLEMS, SAMPLES = 20, 4  # 80 samples per evaluation: Avg@4 in steps of 1.25 points
SEED_SD = 3.0  # points: a run's final Avg@n around its arm's mean, seed to seed (the studies: 2-4)
BASE_SD = 1.0  # points: the base model's step-0 Avg@n, seed to seed (the studies: 1.5)
ENTROPY_SD = 0.05  # nats
BASE = 25.0  # points
R_NULL, R_POWER = 400, 200  # about 0.05 s of CPU per store: the whole file stays well under a minute
ALPHA = 0.05


def _eval(points: float, rng) -> dict:
    """An evaluation whose Avg@4 is `points` rounded to the 1.25-point grid: that many of the 80
    samples right, spread over the problems in a random order."""
    k = int(np.clip(round(points / 100 * PROBLEMS * SAMPLES), 0, PROBLEMS * SAMPLES))
    flat = np.zeros(PROBLEMS * SAMPLES, dtype=int)
    flat[rng.permutation(PROBLEMS * SAMPLES)[:k]] = 1
    return {
        "arith": {
            "problem_ids": [f"p{i}" for i in range(PROBLEMS)],
            "n": SAMPLES,
            "correct": flat.reshape(PROBLEMS, SAMPLES).tolist(),
        }
    }


def _run(method: str, seed: int, final: float, base: float, entropy: float, rng, **params) -> RunRecord:
    rows = [{"step": i, "entropy": 1.0 if i < 4 else entropy, "accuracy": 0.5} for i in range(5)]
    cfg = {
        "seed": seed,
        "model": {"name": "m"},
        "train": {"lr": 1e-4, "lr_schedule": "constant"},
        "objective": {"method": method, **params},
    }
    label = method if not params else f"{method}(p={params['p']})"
    return RunRecord(
        run_id=f"{label}-{seed}",
        path=Path("."),
        config=cfg,
        state="finished",
        metrics=rows,
        evals={0: _eval(base, rng), 5: _eval(final, rng)},
        label=label,
    )


def store(rng, learn: float = 0.0) -> list[RunRecord]:
    """One synthetic store: every arm's final Avg@n ~ N(BASE + effect, SEED_SD) per seed, the base
    model's step 0 ~ N(BASE, BASE_SD) per seed (the same for every arm of a seed), entropy ~ N(0.5,
    ENTROPY_SD); `learn`: GRPO's true gain over the base model (every other effect 0)."""
    runs = []
    for s in range(SEEDS):
        base = BASE + rng.normal(0.0, BASE_SD)
        for method, params, effect in (
            ("grpo", {}, learn),
            ("abc", {}, 0.0),
            ("dapo", {}, 0.0),
            ("nsr", {"p": 0.5}, 0.0),
            ("decay", {"p": 0.5}, 0.0),
        ):
            final = BASE + effect + rng.normal(0.0, SEED_SD)
            runs.append(_run(method, s, final, base, 0.5 + rng.normal(0.0, ENTROPY_SD), rng, **params))
    return runs


FAMILY = {
    "RL from verifiable rewards raises held-out accuracy",
    "ABC-GRPO keeps entropy higher than GRPO",
    "ABC-GRPO beats GRPO on held-out accuracy",
    "clip-higher keeps entropy higher than GRPO",
    "NSR beats DAPO",
    "stochastic rescue beats its deterministic twin",
}


def test_the_synthetic_store_is_the_family_it_means():
    claims = evaluate_claims(None, store(np.random.default_rng(1), learn=3.0))  # grpo gains: no cliff
    assert {c.claim for c in claims} == FAMILY and all(c.family == len(FAMILY) for c in claims)
    assert all(c.test == "paired t, seeds" and c.n == SEEDS for c in claims)


def wrong(c, p: float) -> bool:
    """A verdict the truth (every difference 0) contradicts, at p: a difference claim called either way,
    or a non-inferiority claim (at the cliff, when grpo's mean gain happens to fall below 0 and the
    report tests the stability claims: the truth, 0, lies inside the margin) called "does not hold"."""
    if c.kind == "non-inferiority":
        return p < ALPHA and c.estimate < -c.margin
    return p < ALPHA


def test_family_wise_false_positive_rate_is_at_most_5_percent():
    rng = np.random.default_rng(37)
    corrected = raw = 0
    for _ in range(R_NULL):
        claims = evaluate_claims(None, store(rng))
        corrected += any(wrong(c, c.p_holm) for c in claims)
        raw += any(wrong(c, c.p) for c in claims)
    tol = 3 * math.sqrt(ALPHA * (1 - ALPHA) / R_NULL)
    fwer, fwer_raw = corrected / R_NULL, raw / R_NULL
    assert fwer <= ALPHA + tol, (fwer, fwer_raw)
    # the correction is what keeps it: each claim at its own 0.05 errs in 22% of the families here (Holm: 4.5%;
    # 1 - 0.95^6 = 26% for 6 independent claims; these share the grpo and dapo arms)
    assert fwer_raw > 2 * ALPHA + tol, (fwer, fwer_raw)


@pytest.mark.parametrize("learn", [4.0])
def test_a_true_effect_is_found_at_the_stated_power(learn):
    d = learn / math.sqrt(SEED_SD**2 + BASE_SD**2)  # the per-seed difference's sd: final and step 0 independent
    analysis = TTestPower()
    bonferroni = analysis.power(effect_size=d, nobs=SEEDS, alpha=ALPHA / len(FAMILY), alternative="two-sided")
    unadjusted = analysis.power(effect_size=d, nobs=SEEDS, alpha=ALPHA, alternative="two-sided")
    assert bonferroni == pytest.approx(0.719, abs=1e-3) and unadjusted == pytest.approx(0.944, abs=1e-3)
    rng = np.random.default_rng(370)
    found = 0
    for _ in range(R_POWER):
        (c,) = [c for c in evaluate_claims(None, store(rng, learn)) if c.claim.startswith("RL from")]
        found += c.verdict == "holds"
    power = found / R_POWER
    # the 1.25-point grid adds a little noise (sd 0.36 points, uniform rounding): the bounds are the
    # analytic powers -+ 3 Monte Carlo standard errors
    tol = 3 * math.sqrt(0.25 / R_POWER)
    assert bonferroni - tol <= power <= unadjusted + tol, (power, bonferroni, unadjusted)
