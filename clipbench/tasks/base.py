"""The task protocol shared by every task (arith, math) and the trainer/evaluator.

A ``Problem`` carries the fully rendered prompt (template applied, no chat template) and the gold
answer as a string. A ``Task`` owns a training pool, a held-out test pool and its reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # fully rendered prompt text
    answer: str  # gold answer, normalised to a string
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

    def is_correct(self, completion: str, problem: Problem) -> bool: ...
