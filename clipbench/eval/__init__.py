"""`clipbench eval`: a model or a run's checkpoint on benchmarks (clipbench.eval.commands).

The evaluation itself (sampling, grading, Avg@n / Pass@k) lives below the trainer and this command,
in clipbench.tasks.evaluate and clipbench.tasks.passk; the metrics are re-exported here.
"""

from clipbench.tasks.passk import avg_at_n, default_ks, pass_at_k, pass_at_k_array, summarize

__all__ = ["avg_at_n", "default_ks", "pass_at_k", "pass_at_k_array", "summarize"]
