"""The task protocol shared by every task (arith, math) and the trainer/evaluator.

A ``Problem`` carries the fully rendered prompt (template applied, no chat template) and the gold
answer as a string. A ``Task`` owns a training pool, a held-out test pool and its reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str                                           # fully rendered prompt text
    answer: str                                           # gold answer, normalised to a string
    meta: dict = field(default_factory=dict, hash=False)  # source, schema, raw problem text, ...


@runtime_checkable
class Task(Protocol):
    name: str

    def train_problems(self) -> Sequence[Problem]:
        """The training pool."""
        ...

    def test_problems(self) -> Sequence[Problem]:
        """Held-out problems (may be empty)."""
        ...

    def reward(self, completion: str, problem: Problem) -> float:
        """1.0 when correct, 0.0 otherwise."""
        ...

    def is_correct(self, completion: str, problem: Problem) -> bool:
        ...


def train_iter(task: Task, seed: int) -> Iterator[Problem]:
    """Endless stream over ``task.train_problems()``: each epoch is a fresh permutation drawn from
    ``np.random.default_rng(seed)`` (an explicit generator, never the global RNG)."""
    pool = task.train_problems()
    if len(pool) == 0:
        raise ValueError(f"task '{task.name}' has no training problems")
    rng = np.random.default_rng(seed)
    while True:
        for i in rng.permutation(len(pool)):
            yield pool[int(i)]
