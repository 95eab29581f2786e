"""Unbiased pass@k (Chen et al. 2021, arXiv 2107.03374) and avg@n.

Per problem with ``c`` correct of ``n`` samples, pass@k = 1 - C(n-c, k) / C(n, k), computed in the
stable product form 1 - prod_{i=n-c+1}^{n} (1 - k/i) (1.0 when n - c < k). The product is taken as
``-expm1(sum log1p(-k/i))`` so that small pass@k values keep full relative precision. Metrics are
averaged over problems; never "the first k samples".
"""

from __future__ import annotations

import numpy as np


def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_nk(n, k) -> tuple[int, int]:
    n, k = _check_int("n", n), _check_int("k", k)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..n (n={n}), got k={k}")
    return n, k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples."""
    n, k = _check_nk(n, k)
    c = _check_int("c", c)
    if c > n:
        raise ValueError(f"c must be <= n (n={n}), got c={c}")
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)  # (c,)
    return float(-np.expm1(np.sum(np.log1p(-k / i))))


def pass_at_k_array(n: int, c, k: int) -> np.ndarray:
    """``pass_at_k(n, c_j, k)`` for every entry of the integer array ``c`` (same shape, float64)."""
    n, k = _check_nk(n, k)
    c = np.asarray(c)
    if c.size and (not np.issubdtype(c.dtype, np.integer) or c.min() < 0 or c.max() > n):
        raise ValueError(f"c must hold integers in 0..{n}, got dtype {c.dtype} range [{c.min()}, {c.max()}]")
    out = np.empty(c.shape, dtype=np.float64)
    for value in np.unique(c):  # at most n+1 distinct counts
        out[c == value] = pass_at_k(n, int(value), k)
    return out


def _as_correct_matrix(correct) -> np.ndarray:
    """(P, n) bool matrix from bools or 0/1 numbers; ValueError otherwise."""
    m = np.asarray(correct)
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise ValueError(f"correct_matrix must be 2-D (problems, samples) and non-empty, got shape {m.shape}")
    if m.dtype != np.bool_:
        if not np.isin(m, (0, 1)).all():
            raise ValueError("correct_matrix must hold booleans or 0/1 values")
        m = m.astype(bool)
    return m


def avg_at_n(correct_matrix) -> float:
    """Mean correctness over the n samples of each problem, averaged over problems."""
    m = _as_correct_matrix(correct_matrix)  # (P, n)
    return float(m.mean(axis=1).mean())


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, plus n itself when it is not a power of two."""
    n = _check_int("n", n)
    ks = [1 << e for e in range(n.bit_length()) if 1 << e <= n]
    return ks if not ks or ks[-1] == n else [*ks, n]


def summarize(correct_matrix, ks=None) -> dict:
    """Benchmark summary of a (P problems, n samples) correctness matrix.

    Returns ``{"num_problems": P, "n": n, "avg@<n>": float, "pass@k": float for each k,
    "per_problem": {"num_correct": (P,) int, "avg@<n>": (P,) float, "pass@k": (P,) float ...}}``
    with ``ks`` defaulting to ``default_ks(n)``; Avg@n names its n (``avg@8`` for n = 8).
    """
    m = _as_correct_matrix(correct_matrix)  # (P, n)
    num_problems, n = m.shape
    ks = default_ks(n) if ks is None else [int(k) for k in ks]
    c = m.sum(axis=1)  # (P,)
    avg = f"avg@{n}"
    per = {"num_correct": c, avg: c / n}
    out: dict = {"num_problems": num_problems, "n": n, avg: float(per[avg].mean())}
    for k in ks:
        per[f"pass@{k}"] = pass_at_k_array(n, c, k)  # (P,)
        out[f"pass@{k}"] = float(per[f"pass@{k}"].mean())
    out["per_problem"] = per
    return out
