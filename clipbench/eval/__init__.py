"""Evaluation: n samples per problem, graded, as correctness matrices; Avg@n and unbiased Pass@k.

    evaluate.py   the one evaluation of the project (the trainer of every engine, `clipbench eval`)
    passk.py      Avg@n and unbiased Pass@k from a correctness matrix
    suite.py      a run's benchmarks and the evaluation at a rollout step (stored, logged)

It sits below the trainers and the commands, above tasks (problems, graders) and models.
"""

from clipbench.eval.passk import avg_at_n, default_ks, pass_at_k, pass_at_k_array, summarize

__all__ = ["avg_at_n", "default_ks", "pass_at_k", "pass_at_k_array", "summarize"]
