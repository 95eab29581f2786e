"""Unbiased pass@k: brute force over all k-subsets, exact fractions, vectorised == scalar."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from clipbench.eval import avg_at_n, default_ks, pass_at_k, pass_at_k_array, summarize


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of the k-subsets of n samples (c correct) that contain a correct one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(outcomes[i] for i in s) for s in subsets)
    return Fraction(hits, len(subsets))


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_matches_brute_force_enumeration_for_every_small_case():
    cases = 0
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = brute_force_pass_at_k(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(float(expected), rel=1e-13, abs=1e-15), (n, c, k)
                cases += 1
    assert cases == sum(n * (n + 1) for n in range(1, 11))  # 440 (n, c, k) triples


LARGE = [
    (n, c, k)
    for n in (16, 100, 513, 1000, 1024)
    for c in sorted({0, 1, 2, 3, n // 7, n // 2, n - 40, n - 3, n - 1, n} & set(range(n + 1)))
    for k in sorted({1, 2, 4, 8, 16, 32, 64, 256, 512, n} & set(range(1, n + 1)))
]


@pytest.mark.parametrize("n", [16, 100, 513, 1000, 1024])
def test_matches_exact_fractions_up_to_n_1024(n):
    triples = [t for t in LARGE if t[0] == n]
    assert len(triples) >= 40
    for n_, c, k in triples:
        exact = exact_pass_at_k(n_, c, k)
        got = pass_at_k(n_, c, k)
        if exact == 0:
            assert got == 0.0
        else:
            assert abs(Fraction(got) - exact) / exact < Fraction(1, 10**12), (n_, c, k, got, float(exact))


def test_golden_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, rel=1e-15)
    # pass@1 = c/n
    assert pass_at_k(1024, 1, 1) == pytest.approx(1 / 1024, rel=1e-15)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, rel=1e-15)
    # n=1024, c=1, k=512: 1 - C(1023,512)/C(1024,512) = 1 - 512/1024 = 0.5
    assert pass_at_k(1024, 1, 512) == pytest.approx(0.5, rel=1e-13)
    # n-c < k -> every k-subset holds a correct sample
    assert pass_at_k(8, 5, 4) == 1.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 0, 8) == 0.0


@pytest.mark.parametrize("n,c,k", [(4, 1, 5), (4, 5, 1), (-1, 0, 1), (4, -1, 1), (4, 1, 0), (4, 1, -2), (0, 0, 1)])
def test_invalid_arguments_raise(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_non_integer_arguments_raise():
    with pytest.raises(ValueError, match="integer"):
        pass_at_k(4.0, 1, 1)
    with pytest.raises(ValueError, match="c must hold integers"):
        pass_at_k_array(4, np.array([0.5, 1.0]), 1)
    with pytest.raises(ValueError, match="c must hold integers"):
        pass_at_k_array(4, np.array([0, 5]), 1)


def test_vectorised_equals_scalar():
    rng = np.random.default_rng(0)
    for n in (1, 7, 64, 1024):
        c = rng.integers(0, n + 1, size=300)  # (300,)
        for k in default_ks(n):
            got = pass_at_k_array(n, c, k)
            assert got.shape == c.shape and got.dtype == np.float64
            assert np.array_equal(got, [pass_at_k(n, int(ci), k) for ci in c])
    c2 = np.array([[0, 1], [2, 3]])
    assert pass_at_k_array(3, c2, 2).shape == (2, 2)


def test_default_ks():
    assert default_ks(1) == [1]
    assert default_ks(8) == [1, 2, 4, 8]
    assert default_ks(12) == [1, 2, 4, 8, 12]
    assert default_ks(1024)[-1] == 1024 and len(default_ks(1024)) == 11


def test_summarize_golden_matrix():
    # problem 0: 1 of 4 correct; problem 1: none; problem 2: all four.
    m = np.array([[0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    s = summarize(m)
    assert s["num_problems"] == 3 and s["n"] == 4
    # avg@4 = (1/4 + 0 + 1) / 3 = 5/12
    assert s["avg@4"] == pytest.approx(5 / 12, rel=1e-15)
    # pass@1 = avg@n; pass@2 = (1 - C(3,2)/C(4,2) + 0 + 1)/3 = (0.5 + 0 + 1)/3 = 0.5; pass@4 = (1+0+1)/3
    assert s["pass@1"] == pytest.approx(5 / 12, rel=1e-15)
    assert s["pass@2"] == pytest.approx(0.5, rel=1e-15)
    assert s["pass@4"] == pytest.approx(2 / 3, rel=1e-15)
    assert set(k for k in s if k.startswith("pass@")) == {"pass@1", "pass@2", "pass@4"}
    per = s["per_problem"]
    assert per["num_correct"].tolist() == [1, 0, 4]
    np.testing.assert_allclose(per["pass@2"], [0.5, 0.0, 1.0], rtol=1e-15)
    np.testing.assert_allclose(per["avg@4"], [0.25, 0.0, 1.0], rtol=1e-15)


def test_summarize_is_not_first_k_samples():
    # Only the last sample is correct: a "first k samples" estimate would give pass@2 = 0.
    m = np.array([[0, 0, 0, 1]])
    assert summarize(m)["pass@2"] == pytest.approx(0.5, rel=1e-15)
    # Permuting samples within a problem leaves every metric unchanged.
    rng = np.random.default_rng(1)
    big = rng.random((50, 16)) < 0.3  # (50, 16)
    shuffled = np.stack([row[rng.permutation(16)] for row in big])
    a, b = summarize(big), summarize(shuffled)
    for key in ("avg@16", "pass@1", "pass@2", "pass@4", "pass@8", "pass@16"):
        assert a[key] == b[key]


def test_summarize_custom_ks_non_power_of_two_and_bad_input():
    m = np.ones((2, 6), dtype=int)
    m[0, :5] = 0  # problem 0: 1 of 6
    s = summarize(m)
    assert [k for k in s if k.startswith("pass@")] == ["pass@1", "pass@2", "pass@4", "pass@6"]
    # problem 0, k=4: 1 - C(5,4)/C(6,4) = 1 - 5/15 = 2/3; problem 1: 1 -> mean 5/6
    assert s["pass@4"] == pytest.approx(5 / 6, rel=1e-15)
    assert list(summarize(m, ks=[3])) == ["num_problems", "n", "avg@6", "pass@3", "per_problem"]
    assert avg_at_n(m) == pytest.approx(7 / 12, rel=1e-15)  # (1/6 + 1) / 2
    with pytest.raises(ValueError, match="2-D"):
        summarize(np.ones(4))
    with pytest.raises(ValueError, match="0/1"):
        summarize(np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="k must be in"):
        summarize(m, ks=[7])
