"""Evaluation metrics: unbiased pass@k and avg@n over a (problems x samples) correctness matrix."""

from clipbench.eval.passk import avg_at_n, default_ks, pass_at_k, pass_at_k_array, summarize

__all__ = ["avg_at_n", "default_ks", "pass_at_k", "pass_at_k_array", "summarize"]
